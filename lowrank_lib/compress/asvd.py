"""ASVD (Yuan et al. 2023): activation-aware SVD with the abs-mean scaling, alpha = 0.5.

s_j = (sum_samples mean_t |x_tj|)^alpha + 1e-6; SVD(W diag(s)) = U S Vh (EXACT, so results are
deterministic; the original uses torch.svd_lowrank); V <- Vh / s; ALinear = U sqrt(S) [out, r],
BLinear = sqrt(S) V [r, in]. Rank r = int(out*in*p) // (in + out), optionally aligned up to
``rank_align``. ``keep`` is ASVD's ``param_ratio_target`` p, applied to every matrix (the original's
per-layer sensitivity search is replaced by a uniform p, or pass ``ratios={name: p}``).
"""
from __future__ import annotations

import math

import torch

from ..factorized import LLAMA_PROJ
from .calib import CalibStats
from .common import compress_each


def asvd_rank(out_f: int, in_f: int, p: float, rank_align: int = 1) -> int:
    r = int(out_f * in_f * p) // (in_f + out_f)
    if rank_align > 1:
        r = math.ceil(r / rank_align) * rank_align
    return max(1, min(r, min(out_f, in_f)))


def asvd_factors(W: torch.Tensor, scale: torch.Tensor, rank: int):
    """W [out, in], scale s [in] > 0 -> (U sqrt(S) [out, r], sqrt(S) Vh / s [r, in]) float64."""
    U, S, Vh = torch.linalg.svd(W.double() * scale.double()[None, :], full_matrices=False)
    sq = S[:rank].sqrt()
    return U[:, :rank] * sq, (sq[:, None] * Vh[:rank]) / scale.double()[None, :]


def compress_asvd(model, stats: CalibStats, keep: float, alpha: float = 0.5, targets=LLAMA_PROJ,
                  ratios: dict[str, float] | None = None, rank_align: int = 1, inplace: bool = False,
                  progress: bool = True, ranks: dict[str, int] | None = None):
    """ASVD at parameter ratio ``keep`` (or per-module ``ratios``, or explicit ``ranks``); returns the model."""
    def fn(name, lin):
        s = stats[name].abs_mean.pow(alpha) + 1e-6
        if ranks is not None:
            return asvd_factors(lin.weight, s, ranks[name])
        p = keep if ratios is None else ratios.get(name)
        if p is None or p >= 1.0:
            return None  # stays dense, as ASVD leaves p = 1 layers
        return asvd_factors(lin.weight, s, asvd_rank(lin.out_features, lin.in_features, p, rank_align))

    meta = {"family": "asvd", "keep": keep, "alpha": alpha, "shared_groups": []}
    return compress_each(model, fn, meta, targets, inplace, "asvd", progress)
