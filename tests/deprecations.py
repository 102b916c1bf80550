"""Deprecations that OUR calls trigger are attributed to our frame, so pytest's filters make them errors.

transformers warns from its decorators and properties: ``@deprecate_kwarg`` uses ``stacklevel=2``, which
on a model call lands in ``torch/nn/modules/module.py`` (``Module._call_impl`` calls ``forward``), and
``ModelOutput.past_key_values`` / ``config.torch_dtype = ...`` log through ``logger.warning_once`` instead
of warning. A plain ``error::FutureWarning:lowrank_lib`` filter sees neither. :func:`install` fixes the
attribution, nothing else:

- ``warnings.warn`` of a ``DeprecationWarning`` / ``FutureWarning``: from the frame the warning names,
  step outwards over *call plumbing* only (``nn.Module.__call__``, transformers' kwarg/output wrappers,
  torch's no-grad decorator); when that reaches a frame of ``lowrank_lib/`` or ``tests/``, the warning is
  re-issued with that frame as its origin. A deprecation that transformers' own code triggers inside
  torch (no plumbing-only path to our frame) keeps its attribution and stays a warning.
- a ``transformers`` log record saying "deprecated", emitted while the nearest non-plumbing frame is ours,
  becomes a ``FutureWarning`` at that frame.

``pyproject.toml``'s ``filterwarnings`` then turns both categories from ``lowrank_lib`` and the test
modules into errors; a test that exercises a deprecated path on purpose says so with
``@pytest.mark.filterwarnings("ignore:...")``.
"""
from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = (str(ROOT / "lowrank_lib") + "/", str(ROOT / "tests") + "/")
#: files whose frames only forward a call (or a warning) on our behalf
PLUMBING = ("torch/nn/modules/module.py", "torch/utils/_contextlib.py", "transformers/utils/deprecation.py",
            "transformers/utils/generic.py", "transformers/utils/logging.py", "transformers/utils/output_capturing.py",
            "transformers/configuration_utils.py", "/logging/__init__.py", "/functools.py")
CATEGORIES = (DeprecationWarning, FutureWarning)


def _ours(frame) -> bool:
    return frame is not None and frame.f_code.co_filename.startswith(OURS)


def _plumbing(frame) -> bool:
    return frame is not None and frame.f_code.co_filename.replace("\\", "/").endswith(PLUMBING)


def _origin(frame, level: int):
    """(frame, level) of the first frame at or beyond ``frame`` that is not plumbing."""
    while _plumbing(frame):
        frame, level = frame.f_back, level + 1
    return frame, level


def install() -> None:
    """Wrap ``warnings.warn`` and hook the ``transformers`` logger (idempotent)."""
    if getattr(warnings.warn, "_lowrank_attribution", False):
        return
    original = warnings.warn

    def warn(message, category=None, stacklevel=1, source=None, **kw):
        cat = category or (type(message) if isinstance(message, Warning) else UserWarning)
        level = stacklevel
        if isinstance(cat, type) and issubclass(cat, CATEGORIES):
            try:
                named = sys._getframe(stacklevel)       # the frame the warning names (0 is this wrapper)
            except ValueError:
                named = None
            if named is not None and not _ours(named):
                frame, lvl = _origin(named, stacklevel)
                if _ours(frame):
                    level = lvl
        return original(message, category, level + 1, source, **kw)

    warn._lowrank_attribution = True
    warnings.warn = warn
    logging.getLogger("transformers").addHandler(_DeprecationLog())


class _DeprecationLog(logging.Handler):
    """A transformers deprecation logged under our call becomes a FutureWarning at our frame."""

    def emit(self, record: logging.LogRecord) -> None:
        if "deprecated" not in record.getMessage():
            return
        frame, level = _origin(sys._getframe(1), 1)
        if _ours(frame):
            warnings.warn(f"{record.getMessage()} (logged by {record.name})", FutureWarning, stacklevel=level + 1)
