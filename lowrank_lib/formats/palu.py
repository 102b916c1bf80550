"""Palu native checkpoints: ``<model>_ratio-<r>_gs-<g>-<search>-<decomp>/`` HF export (spec §6).

Only k_proj / v_proj are factorized: ``<m>.VT.weight`` [sum_g r_g, in] and ``<m>.U.<g>.weight``
[group_dim, r_g] (+ ``.bias`` per group). ``config.json``: full config with ``model_type: "palullama"``,
``architectures: ["PaluLlamaForCausalLM"]``, ``head_wise_ranks: {module: [r_g, ...]}`` and
``original_model_name_or_path``. "ratio" is the KEEP fraction of k/v rank. Sigma split sqrt/sqrt.

In the ONE representation U is the dense block-diagonal [out, sum r_g] (see
:mod:`lowrank_lib.compress.palu`); the file holds only the G blocks (sum_g group_dim * r_g entries).
"""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from ..codecs import block_diag_u, split_block_diag
from ..geometry import geometry
from .build import CheckpointError, build_model, llama_config
from .errors import brief, fail, guarded
from .lazy import LazyTensor
from .common import (dense_state, factor_modules, family_config, finish_dir, keep_from_name, plain_config,
                     read_safetensors_dir)


def native_dirname(model_name: str, keep: float, group_size: int, search: str = "uniform",
                   decomp: str = "whiten") -> str:
    return f"{model_name.rstrip('/').split('/')[-1]}_ratio-{keep}_gs-{group_size}-{search}-{decomp}"


def write(model, path: str | Path, tokenizer=None, original: str = "") -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    facs = factor_modules(model)
    bad = [n for n in facs if n.rsplit(".", 1)[-1] not in ("k_proj", "v_proj")]
    if bad:
        raise CheckpointError(f"the Palu layout only factorizes k_proj/v_proj, but {bad[:3]} are factorized")
    hw = dict((getattr(model, "lowrank_meta", {}) or {}).get("head_wise_ranks") or {})
    sd = dense_state(model, set(facs))
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for name, f in facs.items():
        ranks = hw.get(name, [f.rank])
        blocks = split_block_diag(f.U.detach(), ranks)
        hw[name] = list(ranks)
        sd[f"{name}.VT.weight"] = f.V.detach()
        gd = blocks[0].shape[0]
        for g, blk in enumerate(blocks):
            sd[f"{name}.U.{g}.weight"] = blk.contiguous()
            if f.bias is not None:
                sd[f"{name}.U.{g}.bias"] = f.bias.detach()[g * gd:(g + 1) * gd].contiguous()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = plain_config(model, model_type="palullama", architectures=["PaluLlamaForCausalLM"],
                       head_wise_ranks=hw, original_model_name_or_path=original)
    return finish_dir(path, cfg, tokenizer)


@guarded
def read(path: str | Path, dtype=None, allow_nonfinite: bool = False,
         progress: bool = False):
    path = Path(path)
    cfg, hw = family_config(path, "head_wise_ranks", "Palu")
    cfg_obj = llama_config(dict(cfg, model_type="llama"), str(path / "config.json"))
    if not isinstance(hw, dict):
        fail(path / "config.json", f"head_wise_ranks is {brief(hw)}, expected {{module: [rank per group]}}",
             key="head_wise_ranks")
    g_kv = geometry(cfg_obj).kv_dim
    sd = read_safetensors_dir(path)
    factors = {}
    for name, ranks in hw.items():
        if not (isinstance(ranks, list) and ranks and len(ranks) <= 4096 and
                all(isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in ranks)):
            fail(path / "config.json", f"head_wise_ranks['{name}'] = {brief(ranks)}, expected a list of positive ints",
                 key=name)
        vk = f"{name}.VT.weight"
        if vk not in sd:
            fail(path, f"head_wise_ranks lists '{name}' but tensor '{vk}' is missing", key=vk)
        VT = sd.pop(vk)
        if VT.dim() != 2 or VT.shape[0] != sum(ranks):
            fail(path, f"'{vk}' has shape {tuple(VT.shape)}, expected [{sum(ranks)}, in] (sum of head_wise_ranks "
                       f"{ranks})", key=vk)
        blocks, biases = [], []
        for g, r in enumerate(ranks):
            uk = f"{name}.U.{g}.weight"
            if uk not in sd:
                fail(path, f"tensor '{uk}' is missing (head group {g} of '{name}')", key=uk)
            U = sd.pop(uk)
            if U.dim() != 2 or U.shape[1] != r or (blocks and U.shape[0] != blocks[0].shape[0]) or \
                    U.dtype != VT.dtype:
                fail(path, f"'{uk}' has shape {tuple(U.shape)} {U.dtype}, expected "
                           f"[{blocks[0].shape[0] if blocks else 'group_dim'}, {r}] {VT.dtype}", key=uk)
            blocks.append(U)
            b = sd.pop(f"{name}.U.{g}.bias", None)
            if b is not None:
                biases.append(b)
        if biases and len(biases) != len(blocks):
            fail(path, f"'{name}' has a bias on {len(biases)} of its {len(blocks)} head groups",
                 key=f"{name}.U.0.bias")
        out = sum(b.shape[0] for b in blocks)
        if name.rsplit(".", 1)[-1] not in ("k_proj", "v_proj") or out != g_kv:
            fail(path, f"head_wise_ranks lists '{name}' with {len(blocks)} groups of {blocks[0].shape[0]} rows; Palu "
                       f"factorizes k_proj / v_proj of {g_kv} rows", key=f"{name}.U.0.weight")
        bias = None
        if biases:
            if any(b.dtype != biases[0].dtype for b in biases):
                fail(path, f"'{name}' head-group biases mix dtypes {sorted({str(b.dtype) for b in biases})}",
                     key=f"{name}.U.0.bias")
            bias = LazyTensor.derived(biases[0].dtype, (sum(b.numel() for b in biases),),
                                      lambda *bs: torch.cat([b.reshape(-1) for b in bs]), *biases)
        U = LazyTensor.derived(VT.dtype, (out, sum(ranks)), lambda *bl: block_diag_u(list(bl)), *blocks)
        factors[name] = (U, VT, bias, {"U": f"{name}.U.*.weight", "V": vk, "bias": f"{name}.U.*.bias"})
    stray = [k for k in sd if ".VT." in k or ".U." in k]
    if stray:
        fail(path, f"factor tensors {stray[:3]} are not listed in head_wise_ranks", key=stray[0])
    meta = {"family": "palu", "keep": _keep(path.name), "head_wise_ranks": hw, "shared_groups": []}
    return build_model(cfg_obj, sd, factors, meta, path, dtype, allow_nonfinite, progress=progress)


def _keep(name: str):
    import re

    m = re.search(r"_ratio-([0-9.]+)_", name)
    return float(m.group(1)) if m else keep_from_name(name)
