"""The one error contract of the checkpoint readers.

Every failure of a public reader entry point (``detect_format``, ``load_checkpoint``,
``safe_torch_load``, ``describe``, each family's ``read``) is a :class:`CheckpointError` or a
subclass. Its message starts with the file at fault and, where one tensor is at fault, names its
key with what was expected and what was found; ``.path`` and ``.key`` carry the same facts for code.

:func:`guarded` is the last line of that contract: a failure the readers did not classify (a bug of
ours, e.g. a ``TypeError`` deep inside a reader) still leaves as a :class:`CheckpointError` naming
the file, as the subclass :class:`UnclassifiedCheckpointError`, so callers can rely on one type.
The fuzz tests assert that no input ever reaches that subclass.
"""
from __future__ import annotations

import functools
import os
import pickle


class CheckpointError(ValueError):
    """A checkpoint cannot be read as what it claims to be (names the file, tensor, expected, found)."""

    def __init__(self, message: str, *, path=None, key: str | None = None):
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.key = key


class UnsafePickleError(CheckpointError, pickle.UnpicklingError):
    """The pickle names a global that is not on the allow-list; nothing from it was executed."""


class UnclassifiedCheckpointError(CheckpointError):
    """A reader failed in a way it did not classify (a lowrank_lib bug); the file is still named."""


def fail(path, message: str, key: str | None = None, cls: type = CheckpointError):
    """Raise ``cls`` with the message ``"<path>: <message>"``."""
    raise cls(f"{path}: {message}", path=path, key=key)


def brief(obj, limit: int = 80) -> str:
    """A short description of an untrusted object for an error message (never a deep ``repr``)."""
    if isinstance(obj, (str, bytes)):
        r = repr(obj[:limit]) + ("..." if len(obj) > limit else "")
        return r
    if isinstance(obj, (bool, int, float)) or obj is None:
        r = repr(obj)
        return r if len(r) <= limit else r[:limit] + "..."
    if isinstance(obj, (list, tuple, dict, set, frozenset)):
        return f"{type(obj).__name__} of {len(obj)}"
    stub = getattr(type(obj), "stub_path", None)
    return f"<{stub}>" if stub else f"<{type(obj).__name__}>"


def guarded(fn):
    """Decorate a public reader whose first argument is the path: only CheckpointError leaves it."""

    @functools.wraps(fn)
    def wrapper(path, *args, **kwargs):
        if not isinstance(path, (str, os.PathLike)):
            raise CheckpointError(f"{brief(path)}: not a path (expected str or os.PathLike)")
        try:
            return fn(path, *args, **kwargs)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - the contract: nothing else escapes a reader
            raise UnclassifiedCheckpointError(
                f"{path}: unexpected {type(e).__name__} while reading ({str(e)[:300]}); "
                f"this is a lowrank_lib bug, please report it with the file", path=path) from e

    return wrapper
