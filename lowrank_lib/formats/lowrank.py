"""lowrank_lib's own checkpoint format: ``model.safetensors`` + ``lowrank_manifest.json``.

* every tensor is stored ONCE (a shared basis or tied embedding is one safetensors entry; the
  manifest maps each state key to its stored entry), so shared groups survive a round trip;
* the manifest holds the architecture config, family of origin, canonical keep, per-matrix ranks,
  shared groups and the factor map ``{module: {U, V, bias}}``;
* a quantized factor (issue 30, :mod:`lowrank_lib.quant`) is stored as its codes (``U`` / ``V`` name the int8 or
  nibble-packed uint8 tensor) and its fp16 scales, each its own tensor; the factor's ``quant`` entry gives
  ``{side: {scale, bits, group, shape}}``. Both are read in their stored dtype (never widened: the codes view the
  mapping);
* :func:`read` maps the file into memory (``mmap``, copy-on-write) and streams it into the model:
  tensors kept in their stored dtype view the mapping (nothing is copied), cast ones are converted
  one chunk at a time (:mod:`.lazy`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from ..factorized import LowRankLinear
from ..quant import QuantizedTensor
from .build import QuantizedFactor, build_model, config_dict
from .common import write_json
from .errors import brief, fail, guarded
from .files import member, read_json
from .lazy import materialize
from .safetensors_file import read_safetensors

MANIFEST = "lowrank_manifest.json"
WEIGHTS = "model.safetensors"
VERSION = 1


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
    state = model.state_dict()
    tensors = dict(model.named_parameters(remove_duplicate=False))
    # buffers as objects (state_dict detaches them: a shared quantized basis's codes would be two tensors)
    tensors.update({k: v for k, v in model.named_buffers(remove_duplicate=False) if k in state})
    tensors.update({k: v for k, v in state.items() if k not in tensors})
    for k, t in tensors.items():
        if "rotary_emb" in k:
            continue
        key = by_id.get(id(t))
        if key is None:
            key = by_id[id(t)] = k
            stored[k] = t.detach().contiguous()
        keymap[k] = key
    factors = {n: _factor_entry(n, m, keymap) for n, m in model.named_modules() if isinstance(m, LowRankLinear)}
    meta = _json_safe(getattr(model, "lowrank_meta", {}) or {})
    meta.pop("source", None)
    manifest = {"format": "lowrank_lib", "version": VERSION, "config": config_dict(model), "meta": meta,
                "factors": factors, "tensors": keymap}
    save_file(stored, str(path / WEIGHTS), metadata={"format": "pt", "lowrank_lib": str(VERSION)})
    write_json(path / MANIFEST, manifest)
    return path


def _factor_entry(n: str, m: LowRankLinear, keymap: dict[str, str]) -> dict:
    """The manifest's entry of one LowRankLinear: its stored tensors' names, rank and (quantized) codes' layout."""
    f = {"bias": keymap.get(f"{n}.bias") if m.bias is not None else None, "rank": m.rank}
    quant = {}
    for side in ("U", "V"):
        t = getattr(m, side)
        if isinstance(t, QuantizedTensor):
            f[side] = keymap[f"{n}.{side}.data"]
            quant[side] = {"scale": keymap[f"{n}.{side}.scale"], "bits": t.bits, "group": t.group,
                           "shape": list(t.shape)}
        else:
            f[side] = keymap[f"{n}.{side}"]
    if quant:
        f["quant"] = quant
    return f


def _quant_ok(q) -> bool:
    """The manifest's ``quant`` entry of a factor: ``{side: {scale: str, bits: int, group: int, shape: [o, i]}}``."""
    ints = lambda v: isinstance(v, int) and not isinstance(v, bool)
    return q is None or (isinstance(q, dict) and set(q) <= {"U", "V"} and all(
        isinstance(e, dict) and isinstance(e.get("scale"), str) and ints(e.get("bits")) and ints(e.get("group"))
        and isinstance(e.get("shape"), list) and len(e["shape"]) == 2 and all(ints(x) for x in e["shape"])
        for e in q.values()))


def write(model, path: str | Path, tokenizer=None) -> Path:
    """:func:`save` with the writer signature every family shares (our format keeps no tokenizer)."""
    return save(model, path)


@guarded
def mmap_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Tensors of a safetensors file as views of a copy-on-write memory map (zero copy), header validated."""
    return materialize(read_safetensors(path, use_mmap=True))


def _manifest(path: Path) -> dict:
    mp = path / MANIFEST
    man = read_json(mp, "manifest")
    if man.get("format") != "lowrank_lib" or man.get("version") != VERSION:
        fail(mp, f"format {brief(man.get('format'))} version {brief(man.get('version'))}, expected lowrank_lib "
                 f"version {VERSION}")
    for k, typ in (("config", dict), ("tensors", dict), ("factors", dict)):
        if not isinstance(man.get(k), typ):
            fail(mp, f"'{k}' is {brief(man.get(k))}, expected an object", key=k)
    if not isinstance(man.get("meta") or {}, dict):
        fail(mp, f"'meta' is {brief(man.get('meta'))}, expected an object", key="meta")
    for k, v in man["tensors"].items():
        if not isinstance(v, str):
            fail(mp, f"tensors['{k}'] is {brief(v)}, expected the name of a stored tensor", key=k)
    for n, f in man["factors"].items():
        ok = isinstance(f, dict) and isinstance(f.get("U"), str) and isinstance(f.get("V"), str) and \
            (f.get("bias") is None or isinstance(f.get("bias"), str)) and isinstance(f.get("rank"), int) and \
            not isinstance(f.get("rank"), bool) and _quant_ok(f.get("quant"))
        if not ok:
            fail(mp, f"factors['{n}'] is {brief(f)}, expected {{U, V, bias, rank[, quant]}}", key=n)
    return man


@guarded
def read(path: str | Path, dtype=None, use_mmap: bool = True, allow_nonfinite: bool = False,
         progress: bool = False):
    path = Path(path)
    man = _manifest(path)
    wpath = member(path, WEIGHTS, "weight file")
    stored = read_safetensors(wpath, use_mmap=use_mmap)
    keymap = man["tensors"]
    missing = sorted({v for v in keymap.values() if v not in stored})
    if missing:
        fail(wpath, f"tensor(s) {missing[:5]} listed in the manifest are missing", key=missing[0])
    unused = sorted(set(stored) - set(keymap.values()))
    if unused:
        fail(wpath, f"tensor(s) {unused[:5]} are stored but the manifest does not use them", key=unused[0])
    fkeys = set()
    factors = {}
    qfactors: dict[tuple[str, str], QuantizedFactor] = {}       # one object per stored (codes, scales): sharing
    for n, f in man["factors"].items():
        quant = f.get("quant") or {}
        for side in ("U", "V", "bias"):
            if f.get(side) is not None and f[side] not in stored:
                fail(wpath, f"'{n}' factor {side} is '{f[side]}', which is not stored", key=f[side])
        sides = {}
        for side in ("U", "V"):
            q = quant.get(side)
            if q is None:
                sides[side] = stored[f[side]]
                continue
            if q["scale"] not in stored:
                fail(wpath, f"'{n}' factor {side}'s scales are '{q['scale']}', which is not stored", key=q["scale"])
            key = (f[side], q["scale"])
            qf = qfactors.setdefault(key, QuantizedFactor(stored[f[side]], stored[q["scale"]], q["bits"], q["group"],
                                                          q["shape"], key))
            if (qf.bits, qf.group, list(qf.shape)) != (q["bits"], q["group"], q["shape"]):
                fail(path / MANIFEST, f"'{n}' factor {side}: codes '{key[0]}' are listed with two layouts", key=key[0])
            sides[side] = qf
            fkeys.update({f"{n}.{side}.data", f"{n}.{side}.scale"})
        U, V = sides["U"], sides["V"]
        if U.dim() != 2 or V.dim() != 2 or U.shape[1] != f["rank"] or V.shape[0] != f["rank"]:
            fail(wpath, f"'{n}' factors '{f['U']}' {tuple(U.shape)} / '{f['V']}' {tuple(V.shape)}, manifest rank "
                        f"{f['rank']}", key=f["U"])
        factors[n] = (U, V, stored[f["bias"]] if f.get("bias") else None,
                      {"U": f["U"], "V": f["V"], "bias": f.get("bias") or f"{n}.bias"})
        fkeys.update({f"{n}.U", f"{n}.V", f"{n}.bias"})
    dense = {k: stored[v] for k, v in keymap.items() if k not in fkeys}
    meta = dict(man.get("meta") or {})
    meta.pop("ranks", None)
    return build_model(man["config"], dense, factors, meta, path, dtype, allow_nonfinite, progress=progress)
