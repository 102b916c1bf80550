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

from ..compress.dobi import remap_decode, remap_encode
from ..factorized import LLAMA_PROJ
from .build import CheckpointError, build_model, llama_config
from .common import (as_class, clone_for_pickle, factor_modules, fake_class, keep_from_name, linear_from,
                     plain_config, read_json, read_torch_bin_dir, registered, retag_storages, finish_dir)
from .pickled import read_pickled_model

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
    m = clone_for_pickle(model).half()
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
    with registered([SVDT, SDPA]):
        torch.save({"model": m, "tokenizer": tokenizer}, path)
    if location != "cpu":
        retag_storages(path, location)
    return path


def read(path: str | Path, dtype=torch.float32):
    path = Path(path)
    if path.is_dir():
        path = path / "DobiSVD_Model.pt"
    state, cfg, classes = read_pickled_model(path)
    if "modules.module.SVDTransformLayer" not in classes:
        raise CheckpointError(f"{path}: no modules.module.SVDTransformLayer in the pickle; not a Dobi-SVD checkpoint")
    factors, dense = {}, {}
    for k, v in state.items():
        mt = re.match(r"^(.*)\.ALinear\.weight$", k)
        if mt:
            base = mt.group(1)
            bk = f"{base}.BLinear.weight"
            if bk not in state:
                raise CheckpointError(f"{path}: '{k}' has no partner '{bk}'")
            factors[base] = (state[bk], v, state.get(f"{base}.BLinear.bias"))
        elif re.search(r"\.(A|B)Linear\.(weight|bias)$", k):
            continue
        else:
            dense[k] = v
    meta = {"family": "dobi", "keep": keep_from_name(path.parent.name), "shared_groups": []}
    return build_model(llama_config(cfg, str(path)), dense, factors, meta, path, dtype)


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
        if entry is not None:
            US, VT = remap_decode(entry)
            if not (torch.equal(US, f.U.detach().half()) and torch.equal(VT, f.V.detach().half())):
                entry = None  # stale codes (factors changed since): re-encode
        entries[name] = entry if entry is not None else remap_encode(f.U.detach().float(), f.V.detach().float())
    sd = {k: v.detach().half().contiguous() for k, v in model.state_dict().items()
          if "self_attn." not in k and "mlp." not in k and "rotary_emb" not in k}
    torch.save(sd, path / "pytorch_model.bin")
    torch.save(entries, path / "remapping_weight.pt")
    if location != "cpu":
        retag_storages(path / "remapping_weight.pt", location)
    return finish_dir(path, plain_config(model, architectures=["LlamaForCausalLM"], torch_dtype="float16"), tokenizer)


_ENTRY_KEYS = ("us_quan", "vt_quan", "us_absmax", "vt_absmax", "tuple_info")


def read_remap(path: str | Path, dtype=torch.float32):
    from .safe_pickle import safe_torch_load

    path = Path(path)
    cfg = read_json(path / "config.json")
    dense = read_torch_bin_dir(path)
    rw = path / "remapping_weight.pt"
    entries = safe_torch_load(rw)
    if not isinstance(entries, dict):
        raise CheckpointError(f"{rw}: expected {{module: entry}}, found {type(entries).__name__}")
    factors, codes = {}, {}
    for name, e in entries.items():
        if not isinstance(e, dict) or any(k not in e for k in _ENTRY_KEYS):
            raise CheckpointError(f"{rw}: entry '{name}' lacks keys {[k for k in _ENTRY_KEYS if k not in (e or {})]}")
        k = e["us_quan"].shape[0]
        if e["vt_quan"].shape[0] != k or e["us_absmax"].shape != (k,) or e["vt_absmax"].shape != (k,):
            raise CheckpointError(f"{rw}: '{name}' has {k} components in us_quan but vt_quan "
                                  f"{tuple(e['vt_quan'].shape)}, absmax {tuple(e['us_absmax'].shape)}/"
                                  f"{tuple(e['vt_absmax'].shape)}")
        US, VT = remap_decode(e)
        factors[name] = (US, VT, None)
        codes[name] = e
    meta = {"family": "dobi-remap", "keep": keep_from_name(path.name), "shared_groups": []}
    model = build_model(llama_config(cfg, str(path / "config.json")), dense, factors, meta, path, dtype)
    for name, e in codes.items():
        model.get_submodule(name).dobi_remap = e
    return model
