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
    lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = nn.Parameter(weight.detach().clone(), requires_grad=False)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().clone(), requires_grad=False)
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


def _state_dict(obj, p: Path) -> dict[str, torch.Tensor]:
    if not isinstance(obj, dict):
        fail(p, f"expected a state dict {{name: tensor}}, found {brief(obj)}")
    for k, v in obj.items():
        if not isinstance(k, str):
            fail(p, f"state dict key {brief(k)} is not a string")
        if not isinstance(v, torch.Tensor):
            fail(p, f"state dict entry '{k}' is {brief(v)}, expected a tensor", key=k)
    return obj


def _merge(out: dict, part: dict, p: Path) -> None:
    dup = next((k for k in part if k in out), None)
    if dup is not None:
        fail(p, f"tensor '{dup}' is stored in two weight files", key=dup)
    out.update(part)


@guarded
def read_safetensors_dir(d: Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or its shards (index json), each file validated first."""
    out: dict[str, torch.Tensor] = {}
    for p in shard_files(d, "model.safetensors.index.json", "model.safetensors"):
        _merge(out, read_safetensors(p), p)
    return out


@guarded
def read_torch_bin_dir(d: Path, name: str = "pytorch_model.bin") -> dict[str, torch.Tensor]:
    """State dict(s) of ``pytorch_model.bin`` (or shards + index) through the restricted unpickler
    (tensors only: a state dict needs no classes)."""
    from .safe_pickle import safe_torch_load

    out: dict[str, torch.Tensor] = {}
    for p in shard_files(d, f"{name}.index.json", name):
        _merge(out, _state_dict(safe_torch_load(p, "state_dict"), p), p)
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


def retag_storages(path: Path, location: str = "cuda:0") -> None:
    """Rewrite a torch zip archive so every storage is tagged ``location`` (as saved from a GPU).

    Protocol-2 pickles have no frames or offsets, so replacing the BINUNICODE ``'cpu'`` opcodes in
    ``data.pkl`` is exact. The archive is rewritten uncompressed with the same records.
    """
    import pickletools
    import struct
    import zipfile

    with zipfile.ZipFile(path) as zf:
        records = [(i.filename, zf.read(i.filename)) for i in zf.infolist()]
    out = []
    for name, data in records:
        if name.endswith("data.pkl"):
            pieces, last = [], 0
            for op, arg, pos in pickletools.genops(data):
                if op.name in ("BINUNICODE", "SHORT_BINUNICODE") and arg == "cpu":
                    n = 5 if op.name == "BINUNICODE" else 2
                    pieces.append(data[last:pos])
                    enc = location.encode()
                    pieces.append((b"X" + struct.pack("<I", len(enc)) if n == 5 else b"\x8c" + bytes([len(enc)])) + enc)
                    last = pos + n + 3
            pieces.append(data[last:])
            data = b"".join(pieces)
        out.append((name, data))
    tmp = path.with_suffix(path.suffix + ".tmp")
    with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in out:
            zf.writestr(name, data)
    tmp.replace(path)


def clone_for_pickle(model):
    """Deep copy of a model for re-classing before ``torch.save`` (never mutate the caller's)."""
    return copy.deepcopy(model)


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
