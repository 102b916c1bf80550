"""SVD-LLM v1 (truncation-aware whitening) and v2 (per-type heterogeneous ranks, loss-optimised truncation).

v1 (Wang et al., ICLR'25, arXiv 2403.07378; its Theorem 3.2, "truncation-aware data whitening"): with
L = chol(X^T X) (float64, shift fallback), take SVD(W L) and store u = U_r sqrt(S_r) [out, r],
v = sqrt(S_r) Vh_r L^-1 [r, in]; r = keep_rank(out, in, keep). The map u v = U_r U_r^T W minimises
||(W - W_r) X||_F among rank-r maps.

v2 (Wang et al., NAACL'25, arXiv 2503.12340; no official code, see the spec):

* §3.1 heterogeneous compression-ratio allocation (:func:`v2_truncation_losses`, :func:`v2_allocate`):
  the theoretical truncation loss L_i = ||sigma_{k+1:}(W S)||_2 of every matrix at the uniform rank k;
  within each projection type G (all ``q_proj`` of the model, ...) the removed fraction
  R_i = |G| R (1/log L_i) / sum_j (1/log L_j), R = 1 - keep; ranks r_i = keep_rank(out, in, 1 - R_i).
* §3.2 loss-optimised weight truncation (:func:`loss_optimised_factors`): S S^T = X^T X from the
  eigendecomposition (S = U_s sqrt(Lambda_s), no Cholesky), SVD(W S) = U_d Sigma Vh_d, truncate,
  u = U_d sqrt(Sigma_r), v = sqrt(Sigma_r) Vh_d,r S^-1. It reaches the same minimum as v1's whitening.

Why v2 lost to v1 on SmolLM2 (issue 31; ``benchmarks/results/compressors_smollm2_w4x2048_c16x512_svdllm.json``,
first 4 WikiText-2 test windows of 2048, calibration 16 x 512; PPL at keep 0.8 / 0.6, dense 20.04):

======================================================  ============  ============
variant                                                  keep 0.8      keep 0.6
======================================================  ============  ============
v1                                                       51.32         134.82
v2's truncation alone (uniform ranks)                    51.32         134.82
v2's allocation alone (v1 truncation), paper units       52.02         150.15
full v2, paper units (the default now)                   52.02         150.15
full v2, raw losses (the compressor before issue 31)     52.64         159.43
======================================================  ============  ============

* the truncation is NOT the cause: per matrix, v1 and v2 reach the theoretical minimum to 4e-14
  (float64) and to 1.4e-11 after rounding the factors to fp32 (:func:`truncation_loss_table`; v2 is
  the lower of the two in 116 / 123 of 210 matrices at keep 0.8 / 0.6: a coin flip). SmolLM2's X^T X is well enough
  conditioned in float64 for Cholesky, so the paper's "more stable" truncation has nothing to fix here;
* the allocation is. L_i is in absolute units (L_i^2 sums over calibration tokens) and 1/log L_i is
  not scale-invariant: with our 8192 tokens, layer 0's ``o_proj`` has L = 1.2 (log L = 0.2) and the
  formula gives it R_i > 1, outside its range; the guard then cut it to keep 0.05. Taking the losses
  in the paper's token units (``loss_tokens``, default 256 x 2048) keeps the formula in range at 0.8
  and recovers part of the gap (52.64 -> 52.02, 159.4 -> 150.2), but the allocation itself still
  removes ranks where the LOCAL loss is small, mostly layer 0's attention (o_proj keep 0.37 / 0.05,
  v_proj 0.63 / 0.28 at 0.8 / 0.6), whose error then runs through all 30 layers. That is the method
  as published, not a bug: on this 135M model its heuristic costs 1.4 % / 11 % perplexity against
  v1's uniform ranks.
"""
from __future__ import annotations

import math

import torch

from ..factorized import LLAMA_PROJ, thin_svd
from ..ranks import keep_rank
from .calib import CalibStats, LayerStats, cholesky_lower
from .common import BoundedCache, compress_each, leaf, whitened_factors

__all__ = ["compress_svdllm", "loss_optimised_factors", "PAPER_CALIB_TOKENS", "v2_truncation_losses", "v2_allocate",
           "v2_keep_ratios", "v2_ranks", "compress_svdllm_v2", "truncation_loss", "truncation_loss_table"]


def compress_svdllm(model, stats: CalibStats, keep: float, targets=LLAMA_PROJ, inplace: bool = False,
                    progress: bool = True, ranks: dict[str, int] | None = None):
    """SVD-LLM v1 at canonical ``keep`` (same rank rule as the original, per matrix); ``ranks`` overrides."""
    chol = BoundedCache()              # one Cholesky factor per statistic (q / k / v and gate / up share theirs)

    def fn(name, lin):
        st = stats[name]
        r = ranks[name] if ranks is not None else keep_rank(lin.out_features, lin.in_features, keep)
        return whitened_factors(lin.weight, chol.get(id(st), lambda: cholesky_lower(st.xtx)), r)

    return compress_each(model, fn, {"family": "svdllm", "variant": "v1", "keep": keep, "shared_groups": []},
                         targets, inplace, "svd-llm v1", progress)


def _sqrt_cov(xtx: torch.Tensor, rel_floor: float = 1e-10) -> tuple[torch.Tensor, torch.Tensor]:
    """S = U_s sqrt(Lambda) and S^-1 = Lambda^-1/2 U_s^T (eigenvalues floored at rel_floor * max)."""
    lam, Us = torch.linalg.eigh(xtx.double())
    lam = lam.clamp_min(float(lam.max()) * rel_floor)
    return Us * lam.sqrt(), (Us / lam.sqrt()).T


def _sqrt_cov_of(st: LayerStats, roots: BoundedCache) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_sqrt_cov` of ``st.xtx``, computed once per statistic into ``roots`` (id(st) -> (S, S^-1)), a cache the
    caller keeps for one compression: v2's allocation and its factors both read it (one eigh per distinct input;
    q / k / v and gate / up share theirs), and it is freed with the call, not kept beside the statistics. Past the
    cache's budget (a model whose roots do not fit in memory) the factors' pass takes them again."""
    return roots.get(id(st), lambda: _sqrt_cov(st.xtx))


def loss_optimised_factors(W: torch.Tensor, S: torch.Tensor, S_inv: torch.Tensor, rank: int):
    """SVD(W S) = U_d Sigma Vh_d; u = U_d sqrt(Sigma_r), v = sqrt(Sigma_r) Vh_d,r S^-1. float64."""
    U, Sig, Vh = thin_svd(W.double() @ S)
    s = Sig[:rank].sqrt()
    return U[:, :rank] * s, (s[:, None] * Vh[:rank]) @ S_inv


#: SVD-LLM's calibration set (256 WikiText-2 samples x 2048 tokens): the token count at which v2's paper took its
#: truncation losses, hence the unit of its 1 / log(L) allocation (see :func:`v2_truncation_losses`)
PAPER_CALIB_TOKENS = 256 * 2048


@torch.no_grad()
def v2_truncation_losses(model, stats: CalibStats, keep: float, targets=LLAMA_PROJ,
                         loss_tokens: int | None = PAPER_CALIB_TOKENS,
                         roots: BoundedCache | None = None) -> dict[str, float]:
    """v2 §3.1: each matrix's theoretical truncation loss at the UNIFORM rank k, L_i = ||sigma_{k+1:}(W S)||_2.

    L_i^2 is a sum over calibration tokens, so its size (and log L_i, which the allocation divides by)
    depends on how many tokens were seen: ``loss_tokens`` expresses every L_i for that many tokens,
    L_i * sqrt(loss_tokens / tokens) (default: the paper's 256 x 2048); ``None`` keeps the raw value. ``roots``: the
    square roots of X^T X already taken (:func:`compress_svdllm_v2` shares them with its factors), filled in here.
    """
    from ..factorized import iter_linears

    out: dict[str, float] = {}
    roots = BoundedCache() if roots is None else roots
    for name, lin in iter_linears(model, targets):
        st = stats[name]
        sig = thin_svd(lin.weight.double() @ _sqrt_cov_of(st, roots)[0])[1]
        k = keep_rank(lin.out_features, lin.in_features, keep)
        scale = 1.0 if loss_tokens is None else math.sqrt(loss_tokens / max(int(st.tokens), 1))
        out[name] = float(sig[k:].norm()) * scale
    return out


def v2_allocate(losses: dict[str, float], keep: float, min_keep: float = 0.05) -> dict[str, float]:
    """v2 §3.1 (its allocation pseudocode): within each projection type G (every ``q_proj`` of the model, ...)
    the removed fraction of matrix i is R_i = |G| R (1 / log L_i) / sum_{j in G} (1 / log L_j), R = 1 - keep,
    so the mean removal of every type is R and a matrix with a larger loss loses less. Returns keep_i = 1 - R_i.

    Outside the paper's range: if some L_i <= e (log L_i <= 1, where 1 / log explodes or turns negative),
    every loss of that type is multiplied by one factor so that the smallest is e; keeps are clamped to
    [``min_keep``, 1] (then the type's mean removal is no longer exactly R).
    """
    R = 1.0 - keep
    groups: dict[str, dict[str, float]] = {}
    for name, loss in losses.items():
        groups.setdefault(leaf(name), {})[name] = loss
    out = {}
    for group in groups.values():
        vals = torch.tensor(list(group.values()), dtype=torch.float64).clamp_min(1e-30)
        if float(vals.min()) <= math.e:
            vals = vals * (math.e / float(vals.min())) * (1 + 1e-9)
        inv = 1.0 / vals.log()
        Ri = len(group) * R * inv / inv.sum()
        for name, r in zip(group, Ri.tolist()):
            out[name] = min(1.0, max(min_keep, 1.0 - r))
    return out


def v2_keep_ratios(model, stats: CalibStats, keep: float, targets=LLAMA_PROJ,
                   loss_tokens: int | None = PAPER_CALIB_TOKENS,
                   roots: BoundedCache | None = None) -> dict[str, float]:
    """Heterogeneous keep per matrix: :func:`v2_allocate` of :func:`v2_truncation_losses` (``roots``: see there)."""
    return v2_allocate(v2_truncation_losses(model, stats, keep, targets, loss_tokens, roots), keep)


def v2_ranks(model, stats: CalibStats, keep: float, targets=LLAMA_PROJ,
             loss_tokens: int | None = PAPER_CALIB_TOKENS) -> dict[str, int]:
    """SVD-LLM v2's per-matrix ranks (its heterogeneous allocation, :func:`v2_keep_ratios`, under the rank rule)."""
    from ..factorized import iter_linears

    keeps = v2_keep_ratios(model, stats, keep, targets, loss_tokens)
    return {n: keep_rank(lin.out_features, lin.in_features, keeps[n]) for n, lin in iter_linears(model, targets)}


def compress_svdllm_v2(model, stats: CalibStats, keep: float, targets=LLAMA_PROJ, inplace: bool = False,
                       progress: bool = True, allocation: str = "v2", ranks: dict[str, int] | None = None,
                       loss_tokens: int | None = PAPER_CALIB_TOKENS):
    """SVD-LLM v2: heterogeneous per-type keep ratios (``allocation="v2"``; ``"uniform"``: v1's rank rule, to
    measure the truncation alone) + loss-optimised truncation (two SVDs). ``ranks`` overrides both."""
    if allocation not in ("v2", "uniform"):
        raise ValueError(f"allocation must be 'v2' or 'uniform', got {allocation!r}")
    roots = BoundedCache()                # X^T X's square roots: the allocation's, then the factors'
    keeps = (v2_keep_ratios(model, stats, keep, targets, loss_tokens, roots) if allocation == "v2" and ranks is None
             else None)

    def fn(name, lin):
        st = stats[name]
        if ranks is not None:
            r = ranks[name]
        else:
            r = keep_rank(lin.out_features, lin.in_features, keep if keeps is None else keeps[name])
        return loss_optimised_factors(lin.weight, *_sqrt_cov_of(st, roots), r)

    meta = {"family": "svdllm", "variant": "v2", "keep": keep, "allocation": allocation if ranks is None else "ranks",
            "loss_tokens": loss_tokens, "shared_groups": []}
    if keeps is not None:
        meta["keep_per_matrix"] = keeps
    return compress_each(model, fn, meta, targets, inplace, "svd-llm v2", progress)


def truncation_loss(W: torch.Tensor, U: torch.Tensor, V: torch.Tensor, xtx: torch.Tensor) -> float:
    """||W X - U V X||_F over the calibration inputs, from X^T X: sqrt(tr((W - UV) X^T X (W - UV)^T)), float64."""
    D = W.double() - U.double() @ V.double()
    return float(torch.einsum("ij,jk,ik->", D, xtx.double(), D).clamp_min(0).sqrt())


@torch.no_grad()
def truncation_loss_table(model, stats: CalibStats, keep: float, targets=LLAMA_PROJ,
                          dtype: torch.dtype | None = None) -> dict[str, dict[str, float]]:
    """Per matrix at v1's uniform rank: the theoretical minimum ||sigma_{r+1:}(W S)|| and the loss
    ||(W - W_r) X||_F that v1 (Cholesky whitening) and v2 (eigen square root, two SVDs) reach, in float64
    and with the factors rounded to ``dtype`` (default: the weight's dtype), all on the same X^T X."""
    from ..factorized import iter_linears

    derived = BoundedCache()        # ONE budget for both: each statistic's square roots (key id) and Cholesky factor
    out = {}
    for name, lin in iter_linears(model, targets):
        st = stats[name]
        L = derived.get(("cholesky", id(st)), lambda: cholesky_lower(st.xtx))
        S, S_inv = _sqrt_cov_of(st, derived)
        W = lin.weight.detach()
        dt = dtype or W.dtype
        r = keep_rank(lin.out_features, lin.in_features, keep)
        u1, v1 = whitened_factors(W, L, r)
        u2, v2 = loss_optimised_factors(W, S, S_inv, r)
        row = {"rank": r, "minimum": float(thin_svd(W.double() @ S)[1][r:].norm()),
               "v1": truncation_loss(W, u1, v1, st.xtx), "v2": truncation_loss(W, u2, v2, st.xtx),
               "v1_rounded": truncation_loss(W, u1.to(dt), v1.to(dt), st.xtx),
               "v2_rounded": truncation_loss(W, u2.to(dt), v2.to(dt), st.xtx)}
        out[name] = row
    return out
