"""Test-only helpers (shared by several test files; never imported by the library)."""
from __future__ import annotations

import torch

from lowrank_lib.attsvd.basis import trunc_svd
from lowrank_lib.attsvd.kv import LowRankKV


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


def svd_run(k: torch.Tensor, v: torch.Tensor, rank_k: int, rank_v: int | None = None) -> tuple:
    """Truncated-SVD factors (a_k, b_k, a_v, b_v) of exact K/V [B, H, n, d] in their dtype (full rank: exact)."""
    (ak, bk), (av, bv) = trunc_svd(k, rank_k), trunc_svd(v, rank_k if rank_v is None else rank_v)
    return tuple(t.to(k.dtype) for t in (ak, bk, av, bv))


def svd_kv(k, v, rank_k, rank_v=None, k_exact=None, v_exact=None) -> LowRankKV:
    """One truncated-SVD run of k/v, then optional exact rows."""
    return LowRankKV([svd_run(k, v, rank_k, rank_v)], k_exact, v_exact).validate()
