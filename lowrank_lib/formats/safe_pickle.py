"""Restricted reading of ``torch.save`` files: tensors and inert stubs, never code.

``torch.load(weights_only=False)`` runs whatever the pickle names (``os.system``, ``eval``...).
Family checkpoints such as SVD-LLM's ``{'model', 'tokenizer'}`` pickles need their *classes*
(``component.svd_llama.SVD_LlamaAttention``, transformers modules, tokenizers) which
``weights_only=True`` refuses. This module reads the zip archive itself and unpickles
``data.pkl`` with :class:`RestrictedUnpickler`:

* tensor rebuild functions and storage types are mapped to OUR OWN implementations
  (``torch._utils._rebuild_tensor_v2`` -> :func:`_rebuild_tensor`, ...), which only slice
  byte buffers read from the archive;
* class paths under :data:`STUB_PREFIXES` (model / tokenizer / config classes) become
  :class:`Stub` subclasses that only store the pickled state (``__dict__``, args);
* a few harmless globals are allow-listed (``OrderedDict``, ``set``, ``_codecs.encode``
  restricted to latin-1, torch dtypes, ``torch.Size``);
* EVERY other global is refused with :class:`UnsafePickleError` naming ``module.name``.

Storages are always placed on the CPU whatever location the file records (Dobi-SVD saves
``cuda:0``). Only the zip format (torch >= 1.6) is read.
"""
from __future__ import annotations

import collections
import pickle
import zipfile
from pathlib import Path

import torch

#: Module prefixes whose classes become inert stubs (state holders). A stub never runs the
#: original code, so mapping a whole package is safe: it can only hold data.
STUB_PREFIXES = ("component.", "modules.", "transformers.", "tokenizers", "torch.nn.modules.",
                 "sentencepiece", "palu.", "models.")

_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool, "UntypedStorage": torch.uint8,
}


class UnsafePickleError(pickle.UnpicklingError):
    """The pickle names a global that is not allow-listed; nothing from it was executed."""


class Stub:
    """Inert stand-in for a pickled object of a known class: holds state, runs nothing.

    ``stub_path`` is the original ``module.qualname``; ``stub_args`` the constructor args
    (REDUCE / NEWOBJ); pickled ``__dict__`` state lands in ``__dict__``.
    """

    stub_path = "?"

    def __new__(cls, *args, **kwargs):
        obj = object.__new__(cls)
        obj.__dict__["stub_args"] = args
        return obj

    def __init__(self, *args, **kwargs):
        pass

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slotstate)
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["stub_state"] = state

    def __repr__(self):
        return f"<Stub {self.stub_path}>"


_STUBS: dict[str, type] = {}


def stub_class(module: str, name: str) -> type:
    path = f"{module}.{name}"
    if path not in _STUBS:
        _STUBS[path] = type(name, (Stub,), {"stub_path": path, "__module__": "lowrank_lib.formats.stubs"})
    return _STUBS[path]


class _StorageType:
    def __init__(self, dtype):
        self.dtype = dtype


class _TensorType:  # marker for torch.Tensor / nn.Parameter as a rebuild target type
    def __init__(self, name):
        self.name = name


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if not isinstance(storage, torch.Tensor):
        raise UnsafePickleError(f"tensor rebuild got {type(storage).__name__}, not a storage")
    n_needed = storage_offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1 if all(size) else 0
    if n_needed > storage.numel():
        raise pickle.UnpicklingError(f"tensor of size {tuple(size)} stride {tuple(stride)} offset {storage_offset} "
                                     f"needs {n_needed} elements but its storage holds {storage.numel()}")
    return storage.as_strided(tuple(size), tuple(stride), storage_offset)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    if not isinstance(data, torch.Tensor):
        raise UnsafePickleError(f"parameter rebuild got {type(data).__name__}")
    return torch.nn.Parameter(data, requires_grad=False)


def _rebuild_from_type(func, new_type, args, state):
    if func not in (_rebuild_tensor, _rebuild_parameter) or not isinstance(new_type, _TensorType):
        raise UnsafePickleError("torch._tensor._rebuild_from_type_v2 with a non-tensor function or type")
    return func(*args)


def _codecs_encode(obj, encoding="utf-8", errors="strict"):
    if encoding not in ("latin1", "latin-1"):
        raise UnsafePickleError(f"_codecs.encode with encoding {encoding!r} (only latin1 is allowed)")
    return obj.encode("latin-1", errors)


def _reconstructor(cls, base, state):  # copyreg._reconstructor, protocol 0/1 objects
    if not (isinstance(cls, type) and issubclass(cls, Stub)) or base is not object:
        raise UnsafePickleError(f"copyreg._reconstructor of {cls!r} with base {base!r}")
    return cls.__new__(cls)


_ALLOWED = {
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set, ("__builtin__", "set"): set,
    ("builtins", "frozenset"): frozenset, ("__builtin__", "frozenset"): frozenset,
    ("builtins", "slice"): slice, ("__builtin__", "slice"): slice,
    ("builtins", "object"): object, ("__builtin__", "object"): object,
    ("_codecs", "encode"): _codecs_encode,
    ("copyreg", "_reconstructor"): _reconstructor, ("copy_reg", "_reconstructor"): _reconstructor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): _TensorType("Tensor"),
    ("torch.nn.parameter", "Parameter"): _TensorType("Parameter"),
    ("torch", "Size"): torch.Size,
}
for _n, _dt in _STORAGE_DTYPES.items():
    _ALLOWED[("torch", _n)] = _StorageType(_dt)
for _n in ("float16", "float32", "float64", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool"):
    _ALLOWED[("torch", _n)] = getattr(torch, _n)


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickler for ``data.pkl``: allow-listed globals, stubs for model classes, refuse the rest."""

    def __init__(self, file, storages: dict[str, torch.Tensor], source: str = "<pickle>"):
        super().__init__(file)
        self._storages = storages
        self._source = source

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in _ALLOWED:
            return _ALLOWED[key]
        if any(module == p.rstrip(".") or module.startswith(p) for p in STUB_PREFIXES) and name.isidentifier():
            return stub_class(module, name)
        raise UnsafePickleError(f"{self._source}: refusing to unpickle global '{module}.{name}' "
                                f"(not on lowrank_lib's allow-list; nothing was executed)")

    def persistent_load(self, pid):
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"{self._source}: unexpected persistent id {pid!r}")
        _, stype, key, _location, numel = pid
        if not isinstance(stype, _StorageType):
            raise UnsafePickleError(f"{self._source}: persistent id with storage type {stype!r}")
        if key not in self._storages:
            raise pickle.UnpicklingError(f"{self._source}: storage record data/{key} is missing (truncated file?)")
        raw = self._storages[key]
        t = raw.view(stype.dtype) if raw.numel() else torch.empty(0, dtype=stype.dtype)
        if t.numel() < numel:
            raise pickle.UnpicklingError(f"{self._source}: storage data/{key} holds {t.numel()} elements, "
                                         f"the pickle expects {numel} (truncated file?)")
        return t


def safe_torch_load(path: str | Path):
    """Load a ``torch.save`` zip archive with :class:`RestrictedUnpickler`; storages on the CPU.

    Raises :class:`UnsafePickleError` for a refused global, ``ValueError`` for a file that is not a
    torch zip archive or is truncated.
    """
    path = Path(path)
    try:
        zf = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as e:
        raise ValueError(f"{path}: not a torch.save zip archive ({e}); truncated, or the legacy format "
                         f"(re-save it with torch >= 1.6)") from e
    with zf:
        names = zf.namelist()
        pkls = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkls) != 1:
            raise ValueError(f"{path}: expected one data.pkl in the archive, found {pkls}")
        prefix = pkls[0][: -len("data.pkl")]
        storages = {}
        try:
            for n in names:
                if n.startswith(prefix + "data/"):
                    buf = bytearray(zf.read(n))
                    storages[n[len(prefix) + 5:]] = torch.frombuffer(buf, dtype=torch.uint8) if buf else \
                        torch.empty(0, dtype=torch.uint8)
            data = zf.read(pkls[0])
        except (zipfile.BadZipFile, OSError, EOFError) as e:
            raise ValueError(f"{path}: corrupt or truncated archive ({e})") from e
    import io

    return RestrictedUnpickler(io.BytesIO(data), storages, str(path)).load()


def pickle_globals(path: str | Path) -> set[str]:
    """``module.name`` of every global the archive's pickle references (read, never executed)."""
    import pickletools

    with zipfile.ZipFile(path) as zf:
        pkl = [n for n in zf.namelist() if n.endswith("data.pkl")][0]
        data = zf.read(pkl)
    out, strings = set(), []
    for op, arg, _ in pickletools.genops(data):
        if op.name == "GLOBAL":
            out.add(arg.replace(" ", "."))
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
            strings.append(arg)
        elif op.name == "STACK_GLOBAL" and len(strings) >= 2:
            out.add(f"{strings[-2]}.{strings[-1]}")
    return out


# --------------------------------------------------------------------------- stub trees -> tensors
def module_state(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flatten a stubbed nn.Module tree (``_parameters``/``_buffers``/``_modules``) to a state dict."""
    out: dict[str, torch.Tensor] = {}
    d = getattr(obj, "__dict__", {})
    for kind in ("_parameters", "_buffers"):
        for k, v in (d.get(kind) or {}).items():
            if isinstance(v, torch.Tensor):
                out[prefix + k] = v
    for k, sub in (d.get("_modules") or {}).items():
        if sub is not None:
            out.update(module_state(sub, f"{prefix}{k}."))
    return out


def stub_plain(obj, depth: int = 0):
    """Plain data (dict/list/str/number) from a stub's state, e.g. a pickled config's attributes."""
    if depth > 8:
        return None
    if isinstance(obj, Stub):
        return {k: stub_plain(v, depth + 1) for k, v in obj.__dict__.items() if not k.startswith("stub_")}
    if isinstance(obj, dict):
        return {str(k): stub_plain(v, depth + 1) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [stub_plain(v, depth + 1) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return None
