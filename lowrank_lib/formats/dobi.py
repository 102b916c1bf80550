"""Dobi-SVD native checkpoints, both stored forms (spec §4).

No-remap: ``DobiSVD_Noremapping-<model>-<ratio>/DobiSVD_Model.pt``, a pickled
``{'model', 'tokenizer'}`` whose every projection is ``modules.module.SVDTransformLayer`` with
``ALinear.weight`` = sqrt(S) V^T [r, in] (applied FIRST) and ``BLinear.weight`` = U sqrt(S) [out, r],
all fp16; attention modules pickle as ``transformers.models.llama.modeling_llama.LlamaSdpaAttention``,
the activation as ``torch.nn.SiLU``; storages are tagged ``cuda:0`` (saved from a GPU).

Remap: ``DobiSVD-<model>-<ratio>/`` with ``config.json``, ``pytorch_model.bin`` (state dict WITHOUT
keys containing "self_attn." or "mlp.", fp16) and ``remapping_weight.pt`` =
``{module: {us_quan, vt_quan, us_absmax, vt_absmax, tuple_info}}`` (8-bit dynamic-map codes; see
:mod:`lowrank_lib.compress.dobi`). Sigma lives on U when out >= in, on V^T otherwise.
"ratio" is the KEEP fraction of Linear parameters.

WARNING: Dobi's ALinear/BLinear mean the opposite of ASVD's.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch
from torch import nn

from ..codecs import remap_decode, remap_encode, remap_shapes, remap_us, remap_us_rows, remap_vt, remap_vt_rows
from ..factorized import LLAMA_PROJ, factor_matrix
from ..quant import DEFAULT_GROUP, quantize_blocks, storage_shapes
from .build import QuantizedFactor, build_model, check_factor_bits, llama_config
from .common import (as_class, factor_modules, fake_class, keep_from_name, linear_from, pickle_copy, plain_config,
                     read_json, read_torch_bin_dir, registered, storages_tagged, finish_dir)
from .errors import CheckpointError, brief, fail, guarded
from .files import member
from .lazy import LazyTensor, materialize
from .pickled import pair_factors, read_pickled_model

SVDT = fake_class("modules.module.SVDTransformLayer")
SDPA = fake_class("transformers.models.llama.modeling_llama.LlamaSdpaAttention")


def native_dirname(model_name: str, keep: float, remap: bool) -> str:
    base = model_name.rstrip("/").split("/")[-1]
    return f"DobiSVD-{base}-{keep}" if remap else f"DobiSVD_Noremapping-{base}-{keep}"


# --------------------------------------------------------------------------- no-remap
def write(model, path: str | Path, tokenizer=None, location: str = "cuda:0") -> Path:
    """``path``: the ``DobiSVD_Noremapping-...`` folder (``DobiSVD_Model.pt`` is written inside) or a ``.pt``."""
    facs = factor_modules(model, LLAMA_PROJ, "Dobi-SVD")
    path = Path(path)
    if path.suffix != ".pt":
        path.mkdir(parents=True, exist_ok=True)
        path = path / "DobiSVD_Model.pt"
    m = pickle_copy(model, torch.float16)
    m.__dict__.pop("lowrank_meta", None)
    for name in facs:
        f = m.get_submodule(name)
        layer = SVDT()
        layer.ALinear = linear_from(f.V.half())
        layer.BLinear = linear_from(f.U.half(), None if f.bias is None else f.bias.half())
        parent, _, leaf = name.rpartition(".")
        setattr(m.get_submodule(parent), leaf, layer)
    for layer in m.model.layers:
        layer.self_attn = as_class(layer.self_attn, SDPA)
        layer.mlp.act_fn = nn.SiLU()
    with registered([SVDT, SDPA]), storages_tagged(location):
        torch.save({"model": m, "tokenizer": tokenizer}, path)
    return path


_AB = re.compile(r"^(?P<base>.*)\.(?P<side>[AB])Linear\.(?P<kind>weight|bias)$")


@guarded
def read(path: str | Path, dtype=None, allow_nonfinite: bool = False,
         progress: bool = False):
    path = Path(path)
    if path.is_dir():
        path = path / "DobiSVD_Model.pt"
    tree, cfg = read_pickled_model(path, "dobi")
    if "modules.module.SVDTransformLayer" not in tree.classes:
        fail(path, "no modules.module.SVDTransformLayer in the pickle; not a Dobi-SVD checkpoint")
    dense, factors = pair_factors(tree.state(), _AB, lambda g: g["base"],
                                  lambda g, side, kind: f"{g['base']}.{side}Linear.{kind}", "B", "A", path,
                                  "a bias on ALinear (applied first) has no place in y = U V x + b")
    meta = {"family": "dobi", "keep": keep_from_name(path.parent.name), "shared_groups": []}
    return build_model(llama_config(cfg, str(path)), dense, factors, meta, path, dtype, allow_nonfinite,
                       buffers=set(tree.buffers))


# --------------------------------------------------------------------------- remap
def write_remap(model, path: str | Path, tokenizer=None, location: str = "cuda:0") -> Path:
    """Write the remap folder. Modules carrying ``dobi_remap`` codes that decode to their factors are
    written byte-for-byte; other factors are (lossily) encoded now."""
    facs = factor_modules(model, LLAMA_PROJ, "Dobi-SVD remap")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    entries = {}
    for name, f in facs.items():
        if f.bias is not None:
            raise CheckpointError(f"{name}: the Dobi remap layout has no place for a bias")
        entry = getattr(f, "dobi_remap", None)
        if entry is not None and not f.quantized:
            US, VT = remap_decode(entry)
            if not (torch.equal(US, f.U.detach().half()) and torch.equal(VT, f.V.detach().half())):
                entry = None  # stale codes (factors changed since): re-encode
        # factors served from the codes (``read_remap(factor_bits=...)``) are derived from them: the codes are written
        if entry is None:
            entry = remap_encode(factor_matrix(f.U).detach().float(), factor_matrix(f.V).detach().float())
        entries[name] = entry
    sd = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()
          if "self_attn." not in k and "mlp." not in k and "rotary_emb" not in k}
    torch.save(sd, path / "pytorch_model.bin")
    with storages_tagged(location):
        torch.save(entries, path / "remapping_weight.pt")
    return finish_dir(path, plain_config(model, architectures=["LlamaForCausalLM"], torch_dtype="float16"), tokenizer)


_ENTRY_KEYS = ("us_quan", "vt_quan", "us_absmax", "vt_absmax", "tuple_info")
_TENSORS = (torch.Tensor, LazyTensor)


@guarded
def read_remap(path: str | Path, dtype=None, allow_nonfinite: bool = False,
               progress: bool = False, factor_bits: int | None = None, factor_group: int = DEFAULT_GROUP):
    """``factor_bits=None``: the factors widened to fp16 as Dobi's own loader does (``dtype`` casts them further).
    ``factor_bits=8`` (or 4): served quantized (QUANT_SPEC, ``factor_group`` columns per fp16 scale), each factor
    requantized from its 8-bit codes while the file is streamed, one factor at a time: exactly
    ``quantize(<the widened fp16 factor>, factor_bits, factor_group)``, and the whole model is never widened."""
    from .safe_pickle import load_lazy

    path = Path(path)
    if factor_bits is not None:
        check_factor_bits(path, factor_bits, factor_group)
    cfg = read_json(path / "config.json", "config.json")
    cfg_obj = llama_config(cfg, str(path / "config.json"))
    dense = read_torch_bin_dir(path)
    rw = member(path, "remapping_weight.pt", "remap file")
    entries = load_lazy(rw, "state_dict")
    if not isinstance(entries, dict):
        fail(rw, f"expected {{module: entry}}, found {brief(entries)}")
    factors, codes = {}, {}
    for name, e in entries.items():
        if not isinstance(name, str):
            fail(rw, f"entry key {brief(name)} is not a module name")
        check_remap_entry(e, name, rw)
        US, VT = (_decoded(e, side) if factor_bits is None else
                  _requantized(e, side, factor_bits, factor_group, name, rw) for side in ("us", "vt"))
        factors[name] = (US, VT, None, {"U": f"{name}[us_quan]", "V": f"{name}[vt_quan]"})
        codes[name] = e
    meta = {"family": "dobi-remap", "keep": keep_from_name(path.name), "shared_groups": []}
    if factor_bits is not None:
        meta["quant"] = {"bits": int(factor_bits), "group": int(factor_group), "from": "dobi-remap codes"}
    model = build_model(cfg_obj, dense, factors, meta, path, dtype, allow_nonfinite, progress=progress)
    for name, e in codes.items():       # the codes as stored (views of the file), for a byte-exact rewrite
        model.get_submodule(name).dobi_remap = materialize(e)
    return model


def _side(e: dict, side: str):
    """One side ("us" / "vt") of a remap entry: its lazy inputs (codes, absmax, and the tail if it is this side's),
    the decoded shape, the row decoder (``codecs.remap_us_rows`` / ``remap_vt_rows``) and a loader of the inputs."""
    codes, absmax = f"{side}_quan", f"{side}_absmax"
    kind, tail = e["tuple_info"] if e["tuple_info"] is not None else (None, None)
    lazy = (e[codes], e[absmax]) + ((tail,) if kind == side else ())
    shape = remap_shapes(e)[0 if side == "us" else 1]

    def entry(*xs) -> dict:                 # the loaded inputs as the entry the row decoders read
        return {codes: xs[0], absmax: xs[1], "tuple_info": (kind, xs[2]) if len(xs) == 3 else None}

    return lazy, shape, remap_us_rows if side == "us" else remap_vt_rows, entry


def _decoded(e: dict, side: str) -> LazyTensor:
    """One factor of the entry (US [m, k] or VT [k, n], fp16) as a lazy tensor decoded when streamed (Dobi's loader:
    :func:`~lowrank_lib.codecs.remap_us` / ``remap_vt``)."""
    lazy, shape, _, entry = _side(e, side)
    full = remap_us if side == "us" else remap_vt
    return LazyTensor.derived(torch.float16, shape, lambda *xs: full(entry(*xs)), *lazy)


def _requantized(e: dict, side: str, bits: int, group: int, name: str, source) -> QuantizedFactor:
    """``quantize(<the widened US or VT>, bits, group)`` (``side`` "us" / "vt") as a :class:`QuantizedFactor` whose
    codes and scales are computed when the load streams them, decoded and quantized one block of rows at a time
    (:func:`lowrank_lib.quant.quantize_blocks`): the first of the two pieces asked for computes both and holds the
    other (the codes stream at the position of Dobi's codes, the scales at that of Dobi's absmax)."""
    lazy, shape, rows, entry = _side(e, side)
    keys = (f"{name}[{side}_quan]", f"{name}[{side}_absmax]")
    (dc, shape_c), (ds, shape_s) = storage_shapes(*shape, bits, group)
    held: dict[str, torch.Tensor] = {}

    def take(piece: str) -> torch.Tensor:
        if piece not in held:
            ent = entry(*(x.load() for x in lazy))
            try:
                q = quantize_blocks(shape, lambda r0, r1: rows(ent, r0, r1), bits, group)
            except ValueError as err:
                fail(source, f"'{keys[0]}' cannot be served at {bits} bits: {err}", key=keys[0])
            held.update(data=q.data, scale=q.scale)
        return held.pop(piece)

    return QuantizedFactor(LazyTensor.derived(dc, shape_c, lambda *_: take("data"), *lazy),
                           LazyTensor.derived(ds, shape_s, lambda *_: take("scale"), lazy[1]),
                           bits, group, shape, keys)


def check_remap_entry(e, name: str, source) -> dict:
    """A remap entry's keys, types and shapes, before decoding allocates anything (sizes come from the file)."""
    if not isinstance(e, dict) or any(k not in e for k in _ENTRY_KEYS):
        lacks = [k for k in _ENTRY_KEYS if not isinstance(e, dict) or k not in e]
        fail(source, f"entry '{name}' lacks keys {lacks}", key=name)
    uq, vq, ua, va, tail = (e[k] for k in _ENTRY_KEYS)
    for k, t, dt, nd in (("us_quan", uq, torch.uint8, 2), ("vt_quan", vq, torch.uint8, 2),
                         ("us_absmax", ua, torch.float16, 1), ("vt_absmax", va, torch.float16, 1)):
        if not isinstance(t, _TENSORS) or t.dtype != dt or t.dim() != nd:
            found = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, _TENSORS) else brief(t)
            fail(source, f"'{name}[{k}]' is {found}, expected a {nd}-D {dt} tensor", key=f"{name}[{k}]")
    k, d = uq.shape
    if vq.shape != (k, d) or ua.shape != (k,) or va.shape != (k,):
        fail(source, f"'{name}' has {k} components in us_quan {tuple(uq.shape)} but vt_quan {tuple(vq.shape)}, "
                     f"absmax {tuple(ua.shape)}/{tuple(va.shape)}", key=f"{name}[vt_quan]")
    if tail is not None:
        ok = isinstance(tail, tuple) and len(tail) == 2 and tail[0] in ("us", "vt") and \
            isinstance(tail[1], _TENSORS) and tail[1].dim() == 2 and tail[1].dtype.is_floating_point
        if not ok:
            fail(source, f"'{name}[tuple_info]' is {brief(tail)}, expected None or ('us'|'vt', 2-D tensor)",
                 key=f"{name}[tuple_info]")
        t = tail[1]
        if (tail[0] == "us" and t.shape[1] != k) or (tail[0] == "vt" and t.shape[0] != k):
            fail(source, f"'{name}[tuple_info]' tail {tuple(t.shape)} does not fit {k} components",
                 key=f"{name}[tuple_info]")
    return e
