"""Palu (Chang et al., ICLR'25): head-group low-rank k_proj / v_proj, latents in the KV cache.

The output rows of k_proj / v_proj [out = n_kv_heads * head_dim, in] are split into
G = n_kv_heads / head_group_size contiguous groups of gd = out / G rows. Each group g gets a
whitened SVD (SVD-LLM's, L = chol(X^T X)): SVD(W_g L) = U S Vh, U_g = U_r sqrt(S_r) [gd, r_g],
VT_g = sqrt(S_r) Vh_r L^-1 [r_g, in]. Palu stores ``VT`` = cat_g VT_g [sum r_g, in] and the
separate U_g.

Representation choice: in the ONE representation the layer is ``LowRankLinear`` with
V = VT [sum r_g, in] and U = blockdiag(U_1..U_G) [out, sum r_g] (dense, zeros off the diagonal
blocks), which computes exactly Palu's ``concat_g U_g latent_g``. The off-block zeros cost
(G - 1)/G of U's entries in memory (none for G = 1); the native file stores only the blocks, and
``lowrank_meta["head_wise_ranks"]`` keeps the block structure so the writer can cut them out again.

Ranks ("uniform", Palu's rule): r_g = round(gd * keep / align) * align, clamped to [align, gd]
(align = 32 in Palu; smaller for tiny test models). ``keep`` = Palu's ``param_ratio_target``,
the kept fraction of k/v rank; q, o and the MLP stay dense.
"""
from __future__ import annotations

import torch

from ..codecs import block_diag_u, split_block_diag  # noqa: F401 (re-export)
from ..geometry import geometry
from .calib import CalibStats, cholesky_lower
from .common import BoundedCache, compress_each, whitened_factors

__all__ = ["PALU_TARGETS", "palu_group_rank", "compress_palu"]

PALU_TARGETS = ("k_proj", "v_proj")


def palu_group_rank(group_dim: int, keep: float, align: int = 32) -> int:
    r = int(round(group_dim * keep / align)) * align
    return max(min(align, group_dim), min(r, group_dim))


def compress_palu(model, stats: CalibStats, keep: float, head_group_size: int = 1, align: int = 32,
                  whiten: bool = True, inplace: bool = False, progress: bool = True):
    """Palu k/v factors (G head groups per projection); ``lowrank_meta['head_wise_ranks']``."""
    n_kv = geometry(model).n_kv_heads
    if n_kv % head_group_size:
        raise ValueError(f"head_group_size {head_group_size} does not divide num_key_value_heads {n_kv}")
    G = n_kv // head_group_size
    chol = BoundedCache()
    hw: dict[str, list[int]] = {}

    def fn(name, lin):
        W = lin.weight
        gd = W.shape[0] // G
        r = palu_group_rank(gd, keep, align)
        st = stats[name]
        L = (chol.get(id(st), lambda: cholesky_lower(st.xtx)) if whiten
             else torch.eye(W.shape[1], dtype=torch.float64))
        Us, Vs = zip(*[whitened_factors(W[g * gd:(g + 1) * gd], L, r) for g in range(G)])
        hw[name] = [r] * G
        return block_diag_u(list(Us)), torch.cat(Vs, dim=0)

    meta = {"family": "palu", "keep": keep, "head_group_size": head_group_size, "rank_align": align,
            "decomposition": "whiten" if whiten else "svd", "head_wise_ranks": hw, "shared_groups": []}
    return compress_each(model, fn, meta, PALU_TARGETS, inplace, "palu", progress)
