"""lowrank_lib's own checkpoint format: ``model.safetensors`` + ``lowrank_manifest.json``.

* every tensor is stored ONCE (a shared basis or tied embedding is one safetensors entry; the
  manifest maps each state key to its stored entry), so shared groups survive a round trip;
* the manifest holds the architecture config, family of origin, canonical keep, per-matrix ranks,
  shared groups and the factor map ``{module: {U, V, bias}}``;
* :func:`read` maps the file into memory (``mmap``, copy-on-write) and builds the model on
  tensors that view the mapping: nothing is copied when the stored dtype is the one asked for.
"""
from __future__ import annotations

import json
import mmap
from pathlib import Path

import torch
from safetensors.torch import save_file

from ..factorized import LowRankLinear
from .build import CheckpointError, build_model, config_dict
from .common import read_json, write_json

MANIFEST = "lowrank_manifest.json"
WEIGHTS = "model.safetensors"
VERSION = 1
_DT = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
       "BOOL": torch.bool}


def _json_safe(obj):
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items() if not isinstance(v, torch.Tensor)}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    return str(obj)


def save(model, path: str | Path) -> Path:
    """Write ``path/`` = model.safetensors + lowrank_manifest.json. Returns the folder."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    stored: dict[str, torch.Tensor] = {}
    by_id: dict[int, str] = {}
    keymap: dict[str, str] = {}
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update({k: v for k, v in model.state_dict().items() if k not in tensors})
    for k, t in tensors.items():
        if "rotary_emb" in k:
            continue
        key = by_id.get(id(t))
        if key is None:
            key = by_id[id(t)] = k
            stored[k] = t.detach().contiguous()
        keymap[k] = key
    factors = {n: {"U": keymap[f"{n}.U"], "V": keymap[f"{n}.V"],
                   "bias": keymap.get(f"{n}.bias") if m.bias is not None else None, "rank": m.rank}
               for n, m in model.named_modules() if isinstance(m, LowRankLinear)}
    meta = _json_safe(getattr(model, "lowrank_meta", {}) or {})
    meta.pop("source", None)
    manifest = {"format": "lowrank_lib", "version": VERSION, "config": config_dict(model), "meta": meta,
                "factors": factors, "tensors": keymap}
    save_file(stored, str(path / WEIGHTS), metadata={"format": "pt", "lowrank_lib": str(VERSION)})
    write_json(path / MANIFEST, manifest)
    return path


def mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file as views of a copy-on-write memory map (zero copy)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CheckpointError(f"{path}: truncated (no 8-byte header length)")
        n = int.from_bytes(head, "little")
        if n <= 0 or 8 + n > size:
            raise CheckpointError(f"{path}: header length {n} does not fit a {size}-byte file (truncated?)")
        header = json.loads(f.read(n))
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    base = 8 + n
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        s, e = v["data_offsets"]
        if base + e > size:
            raise CheckpointError(f"{path}: tensor '{k}' needs bytes up to {base + e} but the file has {size} (truncated)")
        dt = _DT[v["dtype"]]
        numel = 1
        for d in v["shape"]:
            numel *= d
        if numel == 0:
            out[k] = torch.empty(v["shape"], dtype=dt)
            continue
        out[k] = torch.frombuffer(mm, dtype=dt, count=numel, offset=base + s).view(v["shape"])
    return out


def read(path: str | Path, dtype=torch.float32, use_mmap: bool = True):
    path = Path(path)
    man = read_json(path / MANIFEST)
    if man.get("format") != "lowrank_lib" or man.get("version") != VERSION:
        raise CheckpointError(f"{path / MANIFEST}: format {man.get('format')!r} version {man.get('version')!r}, "
                              f"expected lowrank_lib version {VERSION}")
    wpath = path / WEIGHTS
    if not wpath.exists():
        raise CheckpointError(f"{wpath}: weight file missing")
    if use_mmap:
        stored = mmap_safetensors(wpath)
    else:
        from safetensors.torch import load_file

        stored = load_file(str(wpath))
    keymap = man["tensors"]
    missing = sorted({v for v in keymap.values() if v not in stored})
    if missing:
        raise CheckpointError(f"{wpath}: tensor(s) {missing[:5]} listed in the manifest are missing")
    fkeys = set()
    factors = {}
    for n, f in man["factors"].items():
        U, V = stored[f["U"]], stored[f["V"]]
        if U.shape[1] != f["rank"] or V.shape[0] != f["rank"]:
            raise CheckpointError(f"{wpath}: '{n}' factors U {tuple(U.shape)} V {tuple(V.shape)}, manifest rank {f['rank']}")
        factors[n] = (U, V, stored[f["bias"]] if f.get("bias") else None)
        fkeys.update({f"{n}.U", f"{n}.V", f"{n}.bias"})
    dense = {k: stored[v] for k, v in keymap.items() if k not in fkeys}
    meta = dict(man.get("meta") or {})
    meta.pop("ranks", None)
    return build_model(man["config"], dense, factors, meta, path, dtype)
