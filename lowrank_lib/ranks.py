"""The one canonical compression ratio and how every family's native "ratio" maps onto it.

Canonical ``keep``: the fraction of a matrix's parameters kept by its factors. For a W [out, in]
stored as U [out, r] + V [r, in] that is r (out + in) / (out in), so

    r = floor(keep * out * in / (out + in))                       (keep_rank)

This is SVD-LLM's and ASVD's own rule. Note that keep = 1.0 is NOT full rank: a full-rank
factorization (r = min(out, in)) holds MORE parameters than the dense matrix; exactness tests use
``full_rank=True`` instead. Ranks are clamped to [1, min(out, in)].

Native ratio of each family -> canonical keep (see ../shared/specs/checkpoint-formats.md):

===============  ===========================  =======================================================
family           native knob                  canonical keep
===============  ===========================  =======================================================
SVD-LLM v1/v2    CLI ``--ratio`` = removed    keep = 1 - ratio (the file name already holds keep);
                                              v2 varies keep per matrix around that mean
ASVD             ``param_ratio_target`` p     keep = p (asvd90 -> 0.9); per-layer p from its search
Basis Sharing    ``compression_ratio`` cr %   keep = 1 - cr/100 over the GROUP: num_basis =
                 removed                      floor(in*out*G*keep / (in + out*G)), basis counted once
Dobi-SVD         ``target_ratio`` = keep      keep = target_ratio of all Linear parameters (global,
                                              not per matrix); remap stores k*max(m,n) fp16-equivalents
Palu             ``param_ratio_target`` =     keep applies to the k/v projections only (rank of the
                 kept k/v rank fraction       latent), rounded to multiples of 32 per head group
===============  ===========================  =======================================================
"""
from __future__ import annotations

import math

__all__ = ["keep_rank", "rank_keep", "native_to_keep", "basis_sharing_num_basis"]


def keep_rank(out_features: int, in_features: int, keep: float) -> int:
    """Rank r = floor(keep * out * in / (out + in)), clamped to [1, min(out, in)]."""
    if not (0.0 < keep <= 1.0):
        raise ValueError(f"keep ratio must be in (0, 1], got {keep}")
    r = math.floor(keep * out_features * in_features / (out_features + in_features))
    return max(1, min(r, min(out_features, in_features)))


def rank_keep(out_features: int, in_features: int, rank: int) -> float:
    """Inverse of :func:`keep_rank`: the fraction of parameters a rank-r factorization holds."""
    return rank * (out_features + in_features) / (out_features * in_features)


def native_to_keep(family: str, value: float) -> float:
    """Convert a family's native ratio knob to the canonical keep fraction (the table above lives,
    with every family's other facts, in :mod:`lowrank_lib.families`; aliases accepted)."""
    from .families import native_to_keep as _to_keep

    return _to_keep(family, value)


def basis_sharing_num_basis(in_features: int, out_features: int, group_size: int, keep: float) -> int:
    """Basis Sharing's basis size for a group of G layers: floor(nx nf G keep / (nx + nf G))."""
    return math.floor(in_features * out_features * group_size * keep / (in_features + out_features * group_size))
