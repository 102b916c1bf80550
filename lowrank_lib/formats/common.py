"""File helpers shared by the family modules: fake class paths for writers, weight files, configs."""
from __future__ import annotations

import contextlib
import copy
import json
import re
import sys
import types
from pathlib import Path

import torch
from torch import nn

from ..factorized import LowRankLinear
from .errors import CheckpointError, brief, fail, guarded
from .files import read_json, shard_files
from .lazy import LazyTensor
from .safetensors_file import read_safetensors

_FAKE_CLASSES: dict[str, type] = {}


def fake_class(path: str, base: type = nn.Module) -> type:
    """An empty subclass of ``base`` whose pickled GLOBAL reads ``path`` (e.g. ``component.svd_llama.X``)."""
    if path not in _FAKE_CLASSES:
        mod, _, name = path.rpartition(".")
        _FAKE_CLASSES[path] = type(name, (base,), {"__module__": mod, "__qualname__": name})
    return _FAKE_CLASSES[path]


_ABSENT = object()


@contextlib.contextmanager
def registered(classes: list, shadow: bool = False):
    """Make ``classes`` (or functions) importable at their ``__module__`` paths for the duration of a write.

    Missing modules are created in ``sys.modules`` (and removed afterwards); a class missing from an
    existing module (e.g. ``LlamaSdpaAttention`` in transformers 5) is set on it and deleted afterwards.
    An existing different object at the path is an error unless ``shadow=True`` (tests that rebuild 4.x
    files replace a transformers 5 class for the duration), in which case it is restored afterwards.
    """
    added_mods, restore = [], []
    try:
        for cls in classes:
            parts = cls.__module__.split(".")
            for i in range(1, len(parts) + 1):
                name = ".".join(parts[:i])
                if name not in sys.modules:
                    try:
                        __import__(name)
                    except ImportError:
                        sys.modules[name] = types.ModuleType(name)
                        added_mods.append(name)
            mod = sys.modules[cls.__module__]
            old = mod.__dict__.get(cls.__name__, _ABSENT)
            if old is not cls:
                if old is not _ABSENT and not shadow:
                    raise RuntimeError(f"{cls.__module__}.{cls.__name__} exists; refusing to shadow it")
                setattr(mod, cls.__name__, cls)
                restore.append((mod, cls.__name__, old))
        yield
    finally:
        for mod, name, old in reversed(restore):
            if old is _ABSENT:
                delattr(mod, name)
            else:
                setattr(mod, name, old)
        for name in reversed(added_mods):
            sys.modules.pop(name, None)


def as_class(obj: nn.Module, cls: type) -> nn.Module:
    """A shallow re-classed copy of a module (same state, pickles under ``cls``'s path)."""
    new = cls.__new__(cls)
    new.__dict__.update(obj.__dict__)
    new.__dict__["_modules"] = dict(obj._modules)
    return new


def linear_from(weight: torch.Tensor, bias: torch.Tensor | None = None) -> nn.Linear:
    """An ``nn.Linear`` around ``weight`` (and ``bias``) for pickling: the same tensor memory, no copy."""
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.detach(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach(), requires_grad=False)
    return lin


def factor_modules(model, need: tuple[str, ...] | None = None, family: str = "") -> dict[str, LowRankLinear]:
    """``{name: LowRankLinear}``; if ``need`` (leaf names), every such projection must be factorized."""
    out = {n: m for n, m in model.named_modules() if isinstance(m, LowRankLinear)}
    if need:
        for n, m in model.named_modules():
            if n.rsplit(".", 1)[-1] in need and isinstance(m, nn.Linear):
                raise CheckpointError(f"the {family} layout needs '{n}' factorized, but it is a dense Linear")
    return out


def dense_state(model, skip: set[str]) -> dict[str, torch.Tensor]:
    """State dict without the factorized modules (``skip`` = their names) and rotary buffers."""
    out = {}
    for k, v in model.state_dict().items():
        mod = k.rsplit(".", 1)[0]
        if mod in skip or mod.rsplit(".", 1)[0] in skip or "rotary_emb" in k:
            continue
        out[k] = v
    return out


def plain_config(model, **extra) -> dict:
    d = model.config.to_dict()
    d.update(extra)
    return d


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n")


def _json_default(o):
    if isinstance(o, torch.dtype):
        return str(o).replace("torch.", "")
    if isinstance(o, (set, tuple)):
        return list(o)
    return str(o)


def _state_dict(obj, p: Path) -> dict[str, LazyTensor]:
    if not isinstance(obj, dict):
        fail(p, f"expected a state dict {{name: tensor}}, found {brief(obj)}")
    for k, v in obj.items():
        if not isinstance(k, str):
            fail(p, f"state dict key {brief(k)} is not a string")
        if not isinstance(v, LazyTensor):
            fail(p, f"state dict entry '{k}' is {brief(v)}, expected a tensor", key=k)
    return obj


def _merge(out: dict, part: dict, p: Path) -> None:
    dup = next((k for k in part if k in out), None)
    if dup is not None:
        fail(p, f"tensor '{dup}' is stored in two weight files", key=dup)
    out.update(part)


@guarded
def read_safetensors_dir(d: Path) -> dict[str, LazyTensor]:
    """All tensors of ``model.safetensors`` or its shards (index json), each header validated first; lazy."""
    out: dict[str, LazyTensor] = {}
    for p in shard_files(d, "model.safetensors.index.json", "model.safetensors"):
        _merge(out, read_safetensors(p), p)
    return out


@guarded
def read_torch_bin_dir(d: Path, name: str = "pytorch_model.bin") -> dict[str, LazyTensor]:
    """State dict(s) of ``pytorch_model.bin`` (or shards + index) through the restricted unpickler
    (tensors only: a state dict needs no classes); lazy."""
    from .safe_pickle import load_lazy

    out: dict[str, LazyTensor] = {}
    for p in shard_files(d, f"{name}.index.json", name):
        _merge(out, _state_dict(load_lazy(p, "state_dict"), p), p)
    return out


def single_pt(folder: Path) -> Path:
    """The one ``.pt`` checkpoint in a folder (SVD-LLM saves one file per run); refused if none or several."""
    pts = sorted(p for p in Path(folder).glob("*.pt") if p.is_file())
    if len(pts) != 1:
        fail(folder, f"expected exactly one .pt checkpoint in the folder, found {[p.name for p in pts][:5]}")
    return pts[0]


def keep_from_name(name: str) -> float | None:
    m = re.search(r"(\d+(?:\.\d+)?)(?:\.pt)?$", name)
    return float(m.group(1)) if m else None


@contextlib.contextmanager
def storages_tagged(location: str):
    """During the block, ``torch.save`` records every storage's device as ``location`` (``"cuda:0"``: a file
    saved from a GPU, as Dobi-SVD's are) while the bytes come from the CPU tensors.

    ``torch.serialization.location_tag`` is looked up each time a storage is pickled, so replacing it
    for the block is exact for every pickle protocol and container, and keeps torch's own record
    layout (64-byte aligned storages), which rewriting the archive afterwards would not. Not
    thread-safe (the writers are not run concurrently)."""
    import torch.serialization as ts

    if location == "cpu":
        yield
        return
    orig = ts.location_tag
    ts.location_tag = lambda storage: location
    try:
        yield
    finally:
        ts.location_tag = orig


def pickle_copy(model: nn.Module, dtype: torch.dtype | None = None) -> nn.Module:
    """A copy of a module tree to re-class and pickle, holding NO second copy of the weights.

    Every module is a new object with its own ``_parameters`` / ``_buffers`` / ``_modules`` dicts and
    new ``Parameter`` objects around the same tensor memory (converted to ``dtype`` where it differs:
    then the converted tensor is the only copy); ``LowRankLinear`` modules are not copied (the writers
    replace them by the family's modules). A tensor shared by several modules (tied embeddings) stays
    shared. The caller's model is never mutated (a ``deepcopy`` held every weight twice).
    """
    memo: dict[int, object] = {}

    def conv(t):
        if id(t) not in memo:
            c = t.detach()
            if dtype is not None and c.is_floating_point() and c.dtype != dtype:
                c = c.to(dtype)
            memo[id(t)] = nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else c
        return memo[id(t)]

    def walk(mod):
        if isinstance(mod, LowRankLinear):
            return mod
        if id(mod) not in memo:
            new = copy.copy(mod)
            memo[id(mod)] = new
            new.__dict__["_parameters"] = {k: None if v is None else conv(v) for k, v in mod._parameters.items()}
            new.__dict__["_buffers"] = {k: None if v is None else conv(v) for k, v in mod._buffers.items()}
            new.__dict__["_modules"] = {k: None if v is None else walk(v) for k, v in mod._modules.items()}
        return memo[id(mod)]

    return walk(model)


def finish_dir(path: Path, cfg: dict, tokenizer=None) -> Path:
    """Write ``config.json`` (and the tokenizer files, if any) into an HF-style checkpoint folder."""
    write_json(path / "config.json", cfg)
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def family_config(path: Path, key: str, family: str) -> tuple[dict, object]:
    """``config.json`` of a folder and its family-specific entry ``key`` (refused if absent)."""
    cfg = read_json(Path(path) / "config.json", "config.json")
    if key not in cfg:
        fail(Path(path) / "config.json", f"no {key}; not a {family} checkpoint")
    return cfg, cfg[key]


__all__ = ["CheckpointError", "read_json"]
