"""Per-matrix energy rank rule (Eq. 5) and its aggregator over (batch, head).

    r_M(tau) = min { r : sum_{i<=r} sigma_i^2 >= tau * sum_i sigma_i^2 }
"""
from __future__ import annotations

import math

import torch


def energy_rank(S: torch.Tensor, tau: float) -> torch.Tensor:
    """Effective rank at energy fraction ``tau`` of singular values ``S`` [..., k] (descending).

    Returns a LongTensor [...] in [1, k]; an all-zero spectrum gives rank 1.
    """
    e = S.double().pow(2)
    tot = e.sum(-1, keepdim=True)
    cum = e.cumsum(-1)
    # small relative slack so tau = 1.0 does not fail on round-off
    need = tau * tot * (1 - 1e-12)
    r = (cum < need).sum(-1) + 1
    return r.clamp(1, S.shape[-1])


def aggregate(ranks: torch.Tensor, how: str = "max", rank_max: int | None = None) -> int:
    """One rank from per-(batch, head) ranks: "max", "mean" (rounded up) or "pNN" (percentile)."""
    r = ranks.flatten().double()
    if how == "max":
        out = int(r.max())
    elif how == "mean":
        out = int(math.ceil(float(r.mean())))
    elif how.startswith("p"):
        out = int(math.ceil(float(torch.quantile(r, float(how[1:]) / 100.0))))
    else:
        raise ValueError(f"aggregator must be 'max', 'mean' or 'pNN', got {how!r}")
    if rank_max is not None:
        out = min(out, int(rank_max))
    return max(1, out)
