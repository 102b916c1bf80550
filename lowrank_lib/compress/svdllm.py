"""SVD-LLM v1 (truncation-aware whitening) and v2 (per-type heterogeneous ranks, loss-optimised truncation).

v1 (Wang et al., ICLR'25): with L = chol(X^T X) (float64, shift fallback), take SVD(W L) and store
u = U_r sqrt(S_r) [out, r], v = sqrt(S_r) Vh_r L^-1 [r, in]; r = keep_rank(out, in, keep).

v2 (NAACL'25; no official code): for every matrix, D = W S with S S^T = X^T X (S = U_s sqrt(Lambda_s)
from the eigendecomposition, "loss-optimised": no Cholesky), truncation loss
L_i = ||sigma_{k+1:}(D)||_2 at the uniform rank k. Within each projection type G the removed
fraction R_i = |G| R (1/log L_i) / sum_j (1/log L_j) (R = 1 - keep), so matrices whose truncation
costs more lose less. Ranks r_i = keep_rank(out, in, 1 - R_i).
"""
from __future__ import annotations

import math

import torch

from ..factorized import LLAMA_PROJ
from ..ranks import keep_rank
from .calib import CalibStats, cholesky_lower
from .common import compress_each, leaf, whitened_factors


def compress_svdllm(model, stats: CalibStats, keep: float, targets=LLAMA_PROJ, inplace: bool = False,
                    progress: bool = True, ranks: dict[str, int] | None = None):
    """SVD-LLM v1 at canonical ``keep`` (same rank rule as the original, per matrix); ``ranks`` overrides."""
    chol: dict[int, torch.Tensor] = {}

    def fn(name, lin):
        st = stats[name]
        if id(st) not in chol:
            chol[id(st)] = cholesky_lower(st.xtx)
        r = ranks[name] if ranks is not None else keep_rank(lin.out_features, lin.in_features, keep)
        return whitened_factors(lin.weight, chol[id(st)], r)

    return compress_each(model, fn, {"family": "svdllm", "variant": "v1", "keep": keep, "shared_groups": []},
                         targets, inplace, "svd-llm v1", progress)


def _sqrt_cov(xtx: torch.Tensor, rel_floor: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """S = U_s sqrt(Lambda) and S^-1 = Lambda^-1/2 U_s^T (eigenvalues floored at rel_floor * max)."""
    lam, Us = torch.linalg.eigh(xtx.double())
    lam = lam.clamp_min(float(lam.max()) * rel_floor)
    return Us * lam.sqrt(), (Us / lam.sqrt()).T


def loss_optimised_factors(W: torch.Tensor, S: torch.Tensor, S_inv: torch.Tensor, rank: int):
    """SVD(W S) = U_d Sigma Vh_d; u = U_d sqrt(Sigma_r), v = sqrt(Sigma_r) Vh_d,r S^-1. float64."""
    U, Sig, Vh = torch.linalg.svd(W.double() @ S, full_matrices=False)
    s = Sig[:rank].sqrt()
    return U[:, :rank] * s, (s[:, None] * Vh[:rank]) @ S_inv


@torch.no_grad()
def v2_keep_ratios(model, stats: CalibStats, keep: float, targets=LLAMA_PROJ) -> dict[str, float]:
    """Heterogeneous keep per matrix, mean removal R = 1 - keep within each projection type.

    If some truncation loss is <= e (log <= 1, where 1/log misbehaves), all losses of that type are
    scaled by the same factor so the smallest is e; keeps are clamped to [0.05, 1].
    """
    from ..factorized import iter_linears

    R = 1.0 - keep
    losses: dict[str, dict[str, float]] = {}
    sq: dict[int, torch.Tensor] = {}
    for name, lin in iter_linears(model, targets):
        st = stats[name]
        if id(st) not in sq:
            sq[id(st)] = _sqrt_cov(st.xtx)[0]
        sig = torch.linalg.svdvals(lin.weight.double() @ sq[id(st)])
        k = keep_rank(lin.out_features, lin.in_features, keep)
        losses.setdefault(leaf(name), {})[name] = float(sig[k:].norm())
    out = {}
    for typ, group in losses.items():
        vals = torch.tensor(list(group.values()), dtype=torch.float64).clamp_min(1e-30)
        if float(vals.min()) <= math.e:
            vals = vals * (math.e / float(vals.min())) * (1 + 1e-9)
        inv = 1.0 / vals.log()
        Ri = len(group) * R * inv / inv.sum()
        for (name, _), r in zip(group.items(), Ri.tolist()):
            out[name] = min(1.0, max(0.05, 1.0 - r))
    return out


def compress_svdllm_v2(model, stats: CalibStats, keep: float, targets=LLAMA_PROJ, inplace: bool = False,
                       progress: bool = True):
    """SVD-LLM v2: heterogeneous per-type keep ratios + loss-optimised truncation (two SVDs)."""
    keeps = v2_keep_ratios(model, stats, keep, targets)
    sq: dict[int, tuple] = {}

    def fn(name, lin):
        st = stats[name]
        if id(st) not in sq:
            sq[id(st)] = _sqrt_cov(st.xtx)
        r = keep_rank(lin.out_features, lin.in_features, keeps[name])
        return loss_optimised_factors(lin.weight, *sq[id(st)], r)

    meta = {"family": "svdllm", "variant": "v2", "keep": keep, "keep_per_matrix": keeps, "shared_groups": []}
    return compress_each(model, fn, meta, targets, inplace, "svd-llm v2", progress)
