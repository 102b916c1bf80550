"""Restricted reading of ``torch.save`` files: tensors and inert stubs, never code.

``torch.load(weights_only=False)`` runs whatever the pickle names (``os.system``, ``eval``...).
Family checkpoints such as SVD-LLM's ``{'model', 'tokenizer'}`` pickles need their *classes*
(``component.svd_llama.SVD_LlamaAttention``, transformers 4.x modules, tokenizers), which
``torch.load(weights_only=True)`` refuses, and ``torch.serialization.add_safe_globals`` would need
the real classes importable (they are gone from transformers 5, or never installed). So the
standard mechanism is used directly: :class:`RestrictedUnpickler` is a ``pickle.Unpickler`` whose
``find_class`` and ``persistent_load`` are ours.

What a pickle may name (exact ``module.name`` pairs, no prefixes, so ``tokenizers`` is not
``tokenizersX`` and a function next to an allowed class is refused):

* :data:`TENSOR_GLOBALS`: the tensor rebuild functions and storage types torch writes, mapped to
  OUR implementations, which only slice byte buffers of the file (and check every offset, size and
  stride first); ``OrderedDict``, ``set``, ``frozenset``, ``torch.Size``, dtypes, ``torch.device``
  (kept as the plain tuple ``('device', type, index)``); ``_codecs.encode`` restricted to latin-1
  (protocol 2 stores bytes that way); HF ``kernels``' ``_rebuild_kernel_func`` (transformers >= 5.25 pickles
  a module's functions through it; an inert stub holding the function's module and name, nothing imported);
* :data:`FAMILY_CLASSES`: per family, the classes its original code really pickles (transformers
  4.35 to 4.45 and 5.x Llama/Mistral module, config and tokenizer classes, ``torch.nn`` containers,
  the family's own ``component.*`` / ``modules.*`` classes). Each becomes an inert :class:`Stub`
  that only stores the pickled state;
* EVERY other global is refused with :class:`UnsafePickleError` naming ``module.name``.

Before unpickling, :func:`~.pickle_scan.scan` bounds the opcode stream (op count, memo indices,
frames). Tensors and storages handed to the unpickler are wrapped (:class:`_TensorRef`,
:class:`_Storage`) so no pickle opcode can call a tensor method (``BUILD`` would call
``Tensor.__setstate__``). What they wrap is a :class:`~.lazy.LazyTensor`: its dtype, size, stride and
offset were checked against its storage's size, but no byte of it has been read, so a pickle refused
halfway (a global not on the list after a hundred tensors) has cost the pickle's bytes only.
:func:`load_lazy` returns the object with lazy tensors (what the family readers stream);
:func:`safe_torch_load` reads them into tensors. Storages land on the CPU whatever device the file
records.
"""
from __future__ import annotations

import collections
import pickle
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import CheckpointError, UnsafePickleError, brief, fail, guarded
from .lazy import LazyStorage, LazyTensor, materialize
from .pickle_scan import scan
from .torchfile import MAX_PICKLE_BYTES, open_torch_file

# --------------------------------------------------------------------------- the allow-lists
_TORCH_NN = {
    "torch.nn.modules.linear": ("Linear",),
    "torch.nn.modules.sparse": ("Embedding",),
    "torch.nn.modules.container": ("ModuleList", "ModuleDict", "Sequential"),
    "torch.nn.modules.activation": ("SiLU",),
}
_LLAMA_MODULES = ("LlamaForCausalLM", "LlamaModel", "LlamaDecoderLayer", "LlamaAttention", "LlamaSdpaAttention",
                  "LlamaFlashAttention2", "LlamaMLP", "LlamaRMSNorm", "LlamaRotaryEmbedding",
                  "LlamaLinearScalingRotaryEmbedding", "LlamaDynamicNTKScalingRotaryEmbedding")
_MISTRAL_MODULES = ("MistralForCausalLM", "MistralModel", "MistralDecoderLayer", "MistralAttention",
                    "MistralSdpaAttention", "MistralFlashAttention2", "MistralMLP", "MistralRMSNorm",
                    "MistralRotaryEmbedding")
#: Classes a transformers 4.35-4.45 (or 5.x) Llama/Mistral model and its tokenizer pickle.
TRANSFORMERS_CLASSES = {
    "transformers.models.llama.modeling_llama": _LLAMA_MODULES,
    "transformers.models.llama.configuration_llama": ("LlamaConfig",),
    "transformers.models.mistral.modeling_mistral": _MISTRAL_MODULES,
    "transformers.models.mistral.configuration_mistral": ("MistralConfig",),
    "transformers.generation.configuration_utils": ("GenerationConfig",),
    "transformers.activations": ("SiLUActivation",),
    "transformers.models.llama.tokenization_llama": ("LlamaTokenizer",),
    "transformers.models.llama.tokenization_llama_fast": ("LlamaTokenizerFast",),
    "transformers.models.gpt2.tokenization_gpt2": ("GPT2Tokenizer",),
    "transformers.models.gpt2.tokenization_gpt2_fast": ("GPT2TokenizerFast",),
    "transformers.tokenization_utils_fast": ("PreTrainedTokenizerFast",),
    "transformers.tokenization_utils_tokenizers": ("TokenizersBackend",),     # transformers 5
    "transformers.tokenization_utils_base": ("AddedToken",),                  # 4.x without `tokenizers`
    "transformers.tokenization_utils": ("Trie",),                             # slow tokenizers' added-token trie
    "tokenizers": ("Tokenizer", "AddedToken"),
    "tokenizers.models": ("Model", "BPE", "Unigram", "WordPiece", "WordLevel"),
    # transformers >= 5.25 with HF `kernels`: a model's kernel mode (an enum); its functions: _rebuild_kernel_func
    "kernels._internals.layer.mode": ("Mode",),
}
#: Per pickling family: the classes its saved files hold (``module`` -> class names).
FAMILY_CLASSES: dict[str, dict[str, tuple[str, ...]]] = {
    # SVD-LLM (transformers 4.35.2): component/svd_llama.py and component/svd_mistral.py
    "svdllm": {"component.svd_llama": ("SVD_LlamaAttention", "SVD_LlamaAttention_cache", "SVD_LlamaMLP",
                                       "LlamaRotaryEmbedding", "LlamaRMSNorm"),
               "component.svd_mistral": ("SVD_MistralAttention", "SVD_MistralMLP", "MistralRotaryEmbedding",
                                         "MistralRMSNorm")},
    # Dobi-SVD (transformers 4.37.2): modules/module.py
    "dobi": {"modules.module": ("SVDTransformLayer", "SVDTransformLayer_remapping")},
}
#: The class names that identify a family in a pickle (detection).
FAMILY_MARKERS = {"svdllm": ("component.svd_llama.", "component.svd_mistral.", "component.svd_opt."),
                  "dobi": ("modules.module.SVDTransformLayer",)}


def allowed_classes(family: str | None) -> frozenset[str]:
    """``module.name`` of every class stubbed for ``family``: "state_dict" none, None every family's."""
    if family == "state_dict":
        return frozenset()
    fams = list(FAMILY_CLASSES) if family is None else [family]
    if any(f not in FAMILY_CLASSES for f in fams):
        raise CheckpointError(f"no pickle allow-list for family {family!r}; one of {sorted(FAMILY_CLASSES)} "
                              f"or 'state_dict'")
    out = set()
    for table in [_TORCH_NN, TRANSFORMERS_CLASSES] + [FAMILY_CLASSES[f] for f in fams]:
        out.update(f"{m}.{n}" for m, names in table.items() for n in names)
    return frozenset(out)


# --------------------------------------------------------------------------- stubs
class Stub:
    """Inert stand-in for a pickled object of an allow-listed class: holds state, runs nothing.

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
        if isinstance(state, tuple) and len(state) == 2 and (state[0] is None or isinstance(state[0], dict)) \
                and (state[1] is None or isinstance(state[1], dict)):
            state = {**(state[0] or {}), **(state[1] or {})}  # (dict, slotstate)
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.__dict__["stub_state"] = state

    def __repr__(self):
        return f"<Stub {self.stub_path}>"


_STUBS: dict[str, type] = {}


def stub_class(path: str) -> type:
    if path not in _STUBS:
        name = path.rpartition(".")[2]
        _STUBS[path] = type(name, (Stub,), {"stub_path": path, "__module__": "lowrank_lib.formats.stubs"})
    return _STUBS[path]


# --------------------------------------------------------------------------- tensors, never exposed to opcodes
class _Inert:
    __slots__ = ()

    def __setstate__(self, state):
        raise UnsafePickleError("a pickle opcode tried to set state on a tensor or storage")

    def __reduce__(self):
        raise TypeError("not picklable")


class _Storage(_Inert):
    """A typed storage from the file (:class:`~.lazy.LazyStorage`) as the unpickler sees it."""

    __slots__ = ("lazy", "key")

    def __init__(self, lazy: LazyStorage, key):
        self.lazy, self.key = lazy, key


class _TensorRef(_Inert):
    __slots__ = ("tensor",)

    def __init__(self, tensor):
        self.tensor = tensor


class _StorageType:
    def __init__(self, dtype):
        self.dtype = dtype

    def __call__(self, *a, **k):
        raise UnsafePickleError("a pickle tried to construct a storage directly")


class _TensorType:  # marker for torch.Tensor / nn.Parameter as a rebuild target type
    def __init__(self, name):
        self.name = name

    def __call__(self, *a, **k):
        raise UnsafePickleError(f"a pickle tried to call torch.{self.name} directly")


_MAX_DIMS = 32


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _rebuild_tensor(storage, storage_offset, size, stride, requires_grad=False, backward_hooks=None, metadata=None):
    if not isinstance(storage, _Storage):
        raise UnsafePickleError(f"tensor rebuild got {brief(storage)}, not a storage of the file")
    key = f"storage {storage.key}"
    if not (_is_int(storage_offset) and storage_offset >= 0):
        raise CheckpointError(f"{key}: tensor offset {brief(storage_offset)} is not a non-negative int", key=key)
    if not isinstance(size, (tuple, list)) or not isinstance(stride, (tuple, list)) or len(size) != len(stride) \
            or len(size) > _MAX_DIMS:
        raise CheckpointError(f"{key}: tensor size {brief(size)} / stride {brief(stride)} are not matching "
                              f"tuples of at most {_MAX_DIMS} dims", key=key)
    if not all(_is_int(s) and s >= 0 for s in size) or not all(_is_int(s) and s >= 0 for s in stride):
        raise CheckpointError(f"{key}: tensor size {tuple(size)} stride {tuple(stride)} must be non-negative "
                              f"ints (negative strides are not a torch layout)", key=key)
    hooks_ok = backward_hooks is None or (isinstance(backward_hooks, dict) and not backward_hooks)
    if not isinstance(requires_grad, bool) or not hooks_ok:
        raise CheckpointError(f"{key}: tensor rebuild with requires_grad {brief(requires_grad)} and backward "
                              f"hooks {brief(backward_hooks)} (torch.save writes neither)", key=key)
    n = storage.lazy.numel
    if all(size):
        need = storage_offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1
    else:
        need = storage_offset
    if need > n:
        raise CheckpointError(f"{key}: tensor of size {tuple(size)} stride {tuple(stride)} offset {storage_offset} "
                              f"needs {need} elements but its storage holds {n}", key=key)
    st = storage.lazy
    return _TensorRef(LazyTensor(st.dtype, tuple(size), st, st.elem_offset + storage_offset, tuple(stride)))


def _rebuild_tensor_v1(storage, storage_offset, size, stride):
    return _rebuild_tensor(storage, storage_offset, size, stride)


def _rebuild_parameter(data, requires_grad=False, backward_hooks=None, state=None):
    if not isinstance(data, _TensorRef):
        raise UnsafePickleError(f"parameter rebuild got {brief(data)}, not a tensor of the file")
    data.tensor.parameter = True
    return data


def _rebuild_from_type(func, new_type, args, state):
    if func not in (_rebuild_tensor, _rebuild_parameter) or not isinstance(new_type, _TensorType) \
            or not isinstance(args, tuple):
        raise UnsafePickleError("torch._tensor._rebuild_from_type_v2 with a non-tensor function, type or arguments")
    return func(*args)


def _codecs_encode(obj, encoding="utf-8", errors="strict"):
    if encoding not in ("latin1", "latin-1") or not isinstance(obj, str) or errors != "strict":
        raise UnsafePickleError(f"_codecs.encode of {brief(obj)} with encoding {brief(encoding)} "
                                f"(only str to latin1 is allowed)")
    return obj.encode("latin-1")


def _reconstructor(cls, base, state):  # copyreg._reconstructor, protocol 0/1 objects
    if not (isinstance(cls, type) and issubclass(cls, Stub)) or base is not object or state is not None:
        raise UnsafePickleError(f"copyreg._reconstructor of {brief(cls)} with base {brief(base)}")
    return cls.__new__(cls)


def _safe_set(cls):
    def make(items=()):
        if not isinstance(items, (list, tuple)):
            raise UnsafePickleError(f"{cls.__name__}() of {brief(items)}")
        return cls(items)
    return make


def _ordered_dict(items=()):
    if not isinstance(items, (list, tuple)):
        raise UnsafePickleError(f"OrderedDict() of {brief(items)}")
    return collections.OrderedDict(items)


def _size(dims=()):
    if not isinstance(dims, (list, tuple)) or not all(_is_int(d) for d in dims):
        raise UnsafePickleError(f"torch.Size of {brief(dims)}")
    return torch.Size(dims)


def _device(*args):
    """``torch.device(...)`` kept as plain data (a module may remember where it ran): ('device', type, index)."""
    if not (1 <= len(args) <= 2 and isinstance(args[0], str) and len(args[0]) <= 32
            and (len(args) == 1 or args[1] is None or _is_int(args[1]))):
        raise UnsafePickleError(f"torch.device of {brief(args)}")
    return ("device",) + args


_DOTTED = re.compile(r"[A-Za-z_][A-Za-z0-9_.]{0,199}")


def _kernel_func(*args):
    """``kernels._internals.layer.layer._rebuild_kernel_func(module, name)``: transformers >= 5.25 wraps a
    module's functions (``LlamaAttention.rotary_pos_emb`` = ``apply_rotary_pos_emb``) in HF ``kernels``
    hub-kernel objects (``nn.Module`` s, so a BUILD with module state follows), pickled as this call with the
    function's dotted module and name. Nothing is imported or resolved: the attribute becomes an inert
    :class:`Stub` (path ``kernels.KernelFunction``, ``stub_args == (module, name)``) holding that state."""
    module, name = args if len(args) == 2 else (None, None)
    if not (isinstance(module, str) and isinstance(name, str) and _DOTTED.fullmatch(module) and _DOTTED.fullmatch(name)):
        raise UnsafePickleError(f"kernels' _rebuild_kernel_func of {brief(args)} "
                                f"(expects a dotted module name and a function name)")
    return stub_class("kernels.KernelFunction")(module, name)


_STORAGE_DTYPES = {
    "FloatStorage": torch.float32, "HalfStorage": torch.float16, "BFloat16Storage": torch.bfloat16,
    "DoubleStorage": torch.float64, "LongStorage": torch.int64, "IntStorage": torch.int32,
    "ShortStorage": torch.int16, "CharStorage": torch.int8, "ByteStorage": torch.uint8,
    "BoolStorage": torch.bool,
}
_OBJECT = object
#: Every non-class global a pickle may name, and what it becomes.
TENSOR_GLOBALS: dict[tuple[str, str], object] = {
    ("collections", "OrderedDict"): _ordered_dict,
    ("builtins", "set"): _safe_set(set), ("__builtin__", "set"): _safe_set(set),
    ("builtins", "frozenset"): _safe_set(frozenset), ("__builtin__", "frozenset"): _safe_set(frozenset),
    ("builtins", "object"): _OBJECT, ("__builtin__", "object"): _OBJECT,      # only for _reconstructor
    ("_codecs", "encode"): _codecs_encode,
    ("copyreg", "_reconstructor"): _reconstructor, ("copy_reg", "_reconstructor"): _reconstructor,
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor_v1,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): _TensorType("Tensor"),
    ("torch.nn.parameter", "Parameter"): _TensorType("Parameter"),
    ("torch", "Size"): _size,
    ("torch", "device"): _device,
    ("kernels._internals.layer.layer", "_rebuild_kernel_func"): _kernel_func,
}
for _n, _dt in _STORAGE_DTYPES.items():
    TENSOR_GLOBALS[("torch", _n)] = _StorageType(_dt)
for _n in ("float16", "float32", "float64", "bfloat16", "int8", "uint8", "int16", "int32", "int64", "bool"):
    TENSOR_GLOBALS[("torch", _n)] = getattr(torch, _n)


# --------------------------------------------------------------------------- the unpickler
_KEY = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_MAX_NUMEL = 1 << 48


class RestrictedUnpickler(pickle.Unpickler):
    """``data.pkl`` unpickler: allow-listed globals, stubs for allow-listed classes, refuse the rest."""

    def __init__(self, file, torch_file, classes: frozenset[str], source: str = "<pickle>"):
        super().__init__(file, encoding="utf-8")    # torch.load's encoding for protocol-2 strings
        self._tf = torch_file
        self._classes = classes
        self._source = source
        self.storages: dict[str, _Storage] = {}
        self.used: dict[str, tuple[object, int]] = {}      # key -> (the container's Record, element size)

    def find_class(self, module: str, name: str):
        key = (module, name)
        if key in TENSOR_GLOBALS:
            return TENSOR_GLOBALS[key]
        path = f"{module}.{name}"
        if path in self._classes:
            return stub_class(path)
        raise UnsafePickleError(f"{self._source}: refusing to unpickle global '{path}' (not on lowrank_lib's "
                                f"allow-list for this file; nothing was executed)", path=self._source, key=path)

    def persistent_load(self, pid):
        if isinstance(pid, tuple) and len(pid) == 4 and pid[0] == "module" and self._tf.kind == "legacy":
            # the legacy container names each nn.Module class once as ('module', class, source file, source);
            # the class itself came through find_class, so it is an allow-listed stub
            if not (isinstance(pid[1], type) and issubclass(pid[1], Stub)):
                raise UnsafePickleError(f"legacy module id names {brief(pid[1])}, not an allow-listed class")
            return pid[1]
        if not (isinstance(pid, tuple) and len(pid) in (5, 6) and pid[0] == "storage"):
            raise UnsafePickleError(f"persistent id {brief(pid)} (torch writes ('storage', type, key, location, "
                                    f"numel))")
        stype, key, location, numel = pid[1:5]
        view = pid[5] if len(pid) == 6 else None
        if not isinstance(stype, _StorageType):
            raise UnsafePickleError(f"persistent id with storage type {brief(stype)}")
        if not (isinstance(key, str) and _KEY.fullmatch(key)) or not isinstance(location, str) or \
                not (_is_int(numel) and 0 <= numel <= _MAX_NUMEL):
            raise CheckpointError(f"persistent id has key {brief(key)}, location {brief(location)}, numel "
                                  f"{brief(numel)}")
        elsize = stype.dtype.itemsize
        st = self.storages.get(key)
        if st is None:
            rec = self._tf.storage(key, numel * elsize)
            self.used[key] = (rec, elsize)
            st = self.storages[key] = _Storage(LazyStorage(rec, stype.dtype, numel), key)
        elif st.lazy.dtype != stype.dtype or st.lazy.numel != numel:
            raise CheckpointError(f"storage {key} is referenced as {st.lazy.numel} x {st.lazy.dtype} and as "
                                  f"{numel} x {stype.dtype}", key=key)
        if view is not None:
            if not (isinstance(view, tuple) and len(view) == 3 and isinstance(view[0], str) and _is_int(view[1])
                    and _is_int(view[2]) and 0 <= view[1] and 0 <= view[2] and view[1] + view[2] <= numel):
                raise CheckpointError(f"storage {key}: view {brief(view)} outside its {numel} elements", key=key)
            return _Storage(LazyStorage(st.lazy.record, stype.dtype, view[2], st.lazy.elem_offset + view[1]),
                            f"{key}[{view[1]}:+{view[2]}]")
        return st

    def load(self):
        try:
            return super().load()
        except CheckpointError as e:
            if e.path is None:
                raise type(e)(f"{self._source}: {e}", path=self._source, key=e.key) from None
            raise
        except Exception as e:  # noqa: BLE001 - any other failure of unpickling allow-listed data = corruption
            raise CheckpointError(f"{self._source}: corrupt pickle ({type(e).__name__}: {str(e)[:200]})",
                                  path=self._source) from None


def _load_raw(path, family: str | None):
    """Unpickle ``path`` with the allow-list of ``family``; tensors still wrapped."""
    path = Path(path)
    classes = allowed_classes(family)
    tf = open_torch_file(path)
    try:
        stream, length = tf.pickle_stream()
        start = stream.tell()
        s = scan(stream, path, length=length)
        if tf.kind == "zip" and s.end != length:
            fail(path, f"data.pkl has {length - s.end} bytes after its STOP opcode (corrupt or two readings)")
        stream.seek(start)
        u = RestrictedUnpickler(stream, tf, classes, str(path))
        obj = u.load()
        if stream.tell() - start != s.end:
            fail(path, "the pickle's length as unpickled differs from its scanned length (corrupt)")
        tf.finish(u.used, s.end)
        return obj
    finally:
        tf.close()


@guarded
def load_lazy(path: str | Path, family: str | None = None):
    """:func:`safe_torch_load` without reading the tensors: every tensor is a :class:`~.lazy.LazyTensor`
    (dtype, shape and location checked; read when the caller streams it)."""
    return unwrap(_load_raw(path, family), path)


@guarded
def safe_torch_load(path: str | Path, family: str | None = None):
    """Load a ``torch.save`` file (zip or legacy, as torch decides) with :class:`RestrictedUnpickler`.

    ``family``: whose class allow-list applies ("svdllm", "dobi", "state_dict" for tensors only,
    None for every family's). Storages land on the CPU. Raises :class:`UnsafePickleError` for a
    refused global and :class:`CheckpointError` for anything malformed (a corrupt record: when read).
    """
    obj = unwrap(_load_raw(path, family), path)
    return _materialize_all(obj)


def _materialize_all(obj):
    """Tensors for the lazy tensors in containers AND in stub state (``materialize`` walks containers)."""
    seen: set[int] = set()

    def walk(o):
        if isinstance(o, Stub):
            if id(o) in seen:
                return o
            seen.add(id(o))
            for k, v in list(o.__dict__.items()):
                o.__dict__[k] = walk(v)
            return o
        if isinstance(o, dict):
            if id(o) not in seen:
                seen.add(id(o))
                for k in list(o):
                    o[k] = walk(o[k])
            return o
        if isinstance(o, list):
            if id(o) not in seen:
                seen.add(id(o))
                for i, v in enumerate(o):
                    o[i] = walk(v)
            return o
        if isinstance(o, tuple):
            return tuple(walk(v) for v in o)
        if isinstance(o, (set, frozenset)):
            return o
        return materialize(o)

    return walk(obj)


@guarded
def pickle_globals(path: str | Path) -> set[str]:
    """``module.name`` of every global the file's object pickle references (scanned, never executed)."""
    path = Path(path)
    tf = open_torch_file(path)
    try:
        stream, length = tf.pickle_stream()
        return scan(stream, path, length=length).names()
    finally:
        tf.close()


# --------------------------------------------------------------------------- walking what came out
MAX_DEPTH = 100
MAX_NODES = 5_000_000


def unwrap(obj, source, max_depth: int = MAX_DEPTH):
    """Replace every wrapped tensor in containers and stub state by the tensor (in place where mutable).

    Each container is visited once (shared subtrees and cycles included); nesting deeper than
    ``max_depth`` is refused.
    """
    done: dict[int, object] = {}
    count = [0]

    def walk(o, depth):
        if isinstance(o, _TensorRef):
            return o.tensor
        if isinstance(o, _Storage):
            fail(source, f"a bare storage ({o.key}) outside any tensor")
        if not isinstance(o, (dict, list, tuple, set, frozenset, Stub)):
            return o
        oid = id(o)
        if oid in done:
            return done[oid]
        if depth > max_depth:
            fail(source, f"objects nested deeper than {max_depth} levels; refusing")
        count[0] += 1
        if count[0] > MAX_NODES:
            fail(source, f"more than {MAX_NODES} containers in the pickle; refusing")
        if isinstance(o, Stub):
            done[oid] = o
            d = o.__dict__
            for k in list(d):
                d[k] = walk(d[k], depth + 1)
            return o
        if isinstance(o, dict):
            done[oid] = o
            for k in list(o):
                o[k] = walk(o[k], depth + 1)
            return o
        if isinstance(o, list):
            done[oid] = o
            for i, v in enumerate(o):
                o[i] = walk(v, depth + 1)
            return o
        if isinstance(o, tuple):
            new = tuple(walk(v, depth + 1) for v in o)
            done[oid] = new
            return new
        new = type(o)(walk(v, depth + 1) for v in o)     # set / frozenset
        done[oid] = new
        return new

    return walk(obj, 0)


_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*|[0-9]+")
MAX_MODULES = 1 << 20
MAX_MODULE_DEPTH = 64


@dataclass
class ModuleTree:
    """A pickled ``nn.Module`` tree flattened: tensors by state-dict key, module class paths."""

    params: dict[str, LazyTensor] = field(default_factory=dict)
    buffers: dict[str, LazyTensor] = field(default_factory=dict)
    classes: set[str] = field(default_factory=set)

    def state(self) -> dict[str, LazyTensor]:
        return {**self.params, **self.buffers}


def module_tree(root, source) -> ModuleTree:
    """Walk ``_modules`` / ``_parameters`` / ``_buffers`` of a stubbed module tree, each module once.

    The module graph must be a tree: a module reachable under two names (or a cycle) is refused
    (torch's own ``state_dict`` would walk it once per path). Keys must be attribute names.
    """
    out = ModuleTree()
    seen: dict[int, str] = {}
    stack = [("", root, 0)]
    while stack:
        prefix, obj, depth = stack.pop()
        where = prefix[:-1] or "<root>"
        d = getattr(obj, "__dict__", None) if isinstance(obj, Stub) else None
        if d is None or not isinstance(d.get("_modules", {}), dict) or "_parameters" not in d:
            fail(source, f"module '{where}' is {brief(obj)}, expected a pickled nn.Module", key=where)
        if id(obj) in seen:
            fail(source, f"module '{where}' is the same object as '{seen[id(obj)]}': the module graph is not a tree",
                 key=where)
        seen[id(obj)] = where
        if len(seen) > MAX_MODULES or depth > MAX_MODULE_DEPTH:
            fail(source, f"module tree larger than {MAX_MODULES} modules or deeper than {MAX_MODULE_DEPTH}")
        out.classes.add(obj.stub_path)
        for kind, dest in (("_parameters", out.params), ("_buffers", out.buffers)):
            entries = d.get(kind) or {}
            if not isinstance(entries, dict):
                fail(source, f"module '{where}'.{kind} is {brief(entries)}, expected a dict", key=where)
            for k, v in entries.items():
                if not (isinstance(k, str) and _NAME.fullmatch(k)):
                    fail(source, f"module '{where}' has a {kind[1:-1]} named {brief(k)}", key=where)
                if v is None:
                    continue
                t = v.tensor if isinstance(v, _TensorRef) else v
                if not isinstance(t, LazyTensor):
                    fail(source, f"'{prefix}{k}' is {brief(v)}, expected a tensor", key=prefix + k)
                dest[prefix + k] = t
        for k, sub in (d.get("_modules") or {}).items():
            if not (isinstance(k, str) and _NAME.fullmatch(k)):
                fail(source, f"module '{where}' has a submodule named {brief(k)}", key=where)
            if sub is not None:
                stack.append((f"{prefix}{k}.", sub, depth + 1))
    return out


def plain_data(obj, source, what: str = "config", max_depth: int = 12, max_nodes: int = 100_000):
    """Plain JSON-like data (dict/list/str/number/bool/None) from pickled state, e.g. a config's attributes.

    Stubs become dicts of their attributes; tensors, bytes and other objects become None. Dict keys
    must be str/int/float/bool/None and stay distinct once turned into strings; cycles and nesting
    beyond ``max_depth`` are refused.
    """
    count = [0]
    active: set[int] = set()

    def conv(o, depth):
        if isinstance(o, (str, bool, int, float)) or o is None:
            return o
        if isinstance(o, (_TensorRef, LazyTensor)) or not isinstance(o, (Stub, dict, list, tuple)):
            return None
        if depth > max_depth:
            fail(source, f"{what} nested deeper than {max_depth} levels")
        count[0] += 1
        if count[0] > max_nodes:
            fail(source, f"{what} holds more than {max_nodes} containers")
        if id(o) in active:
            fail(source, f"{what} contains itself (a cycle)")
        active.add(id(o))
        try:
            if isinstance(o, (list, tuple)):
                return [conv(v, depth + 1) for v in o]
            items = {k: v for k, v in o.__dict__.items() if not str(k).startswith("stub_")} \
                if isinstance(o, Stub) else o
            out = {}
            for k, v in items.items():
                if not (isinstance(k, (str, int, float, bool)) or k is None):
                    fail(source, f"{what} has a key of type {type(k).__name__}")
                sk = k if isinstance(k, str) else str(k)
                if sk in out:
                    fail(source, f"{what} has keys that collide as strings ({brief(sk)}: mixed-type keys)")
                out[sk] = conv(v, depth + 1)
            return out
        finally:
            active.discard(id(o))

    return conv(obj, 0)


__all__ = ["FAMILY_CLASSES", "FAMILY_MARKERS", "ModuleTree", "RestrictedUnpickler", "Stub", "TENSOR_GLOBALS",
           "TRANSFORMERS_CLASSES", "UnsafePickleError", "allowed_classes", "load_lazy", "module_tree", "pickle_globals",
           "plain_data", "safe_torch_load", "unwrap", "MAX_PICKLE_BYTES"]
