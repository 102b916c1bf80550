"""SVD-LLM v1 at every keep ratio from ONE whitened SVD per matrix (keep sliders, keep sweeps).

SVD-LLM v1 (:func:`lowrank_lib.compress.compress_svdllm`) stores, for W [out, in] with
L = chol(X^T X) and U S Vh = SVD(W L),

    u_r = U[:, :r] sqrt(S[:r])          v_r = sqrt(S[:r]) Vh[:r] L^-1

Nothing before the slicing depends on r (the rows of v solve independent triangular systems), so
the factors at EVERY rank are the leading columns / rows of the full-rank factors. This class
computes those once and then any keep is a slice: a deep copy of the model plus copies of the
slices, well under a second for SmolLM2, instead of 210 float64 SVDs.

The one decomposition comes from the symmetric eigenproblem of the smaller Gram matrix of M = W L
(float64), which LAPACK solves faster than the SVD of M: for out < in, M M^T = W X^T X W^T = U S^2 U^T
gives u = U sqrt(S) and v = S^{-1/2} U^T W (no triangular solve); otherwise M^T M = V S^2 V^T gives
u = M V S^{-1/2} and v = S^{1/2} V^T L^{-1}. Either way u v = U_r U_r^T W is SVD-LLM's rank-r map;
the factors equal ``compress_svdllm``'s up to float64 rounding and the sign of each component, and
``tests/test_compress_whitened.py`` checks the maps and logits agree at every tested keep.

Memory: the full-rank factors, about 1.5x the projection weights in ``dtype`` (default: the
model's dtype, which is what ``compress_svdllm`` returns too).
"""
from __future__ import annotations

from typing import Iterable

import torch
from tqdm.auto import tqdm

from ..factorized import LLAMA_PROJ, LowRankLinear, iter_linears, replace_with_factors
from ..ranks import keep_rank
from .calib import CalibStats, cholesky_lower
from .common import copy_for_factors


def whitened_full(W: torch.Tensor, L: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Full-rank SVD-LLM factors, components by decreasing singular value: u [out, k], v [k, in] float64
    (k = min(out, in)) with u[:, :r] @ v[:r] = SVD-LLM's rank-r map for every r. See the module doc.

    Components with a singular value below 1e-12 of the largest are zero (SVD-LLM's own factors are
    zero there too), so no factor entry blows up."""
    Wd = W.detach().double()
    M = Wd @ L
    wide = M.shape[0] < M.shape[1]
    lam, E = torch.linalg.eigh(M @ M.T if wide else M.T @ M)
    s = lam.flip(0).clamp_min(0).sqrt()
    E = E.flip(1)
    alive = (s > s[0] * 1e-12).to(s.dtype)
    rs = torch.where(alive > 0, s, torch.ones_like(s)).sqrt()          # sqrt(s), 1 where the component is 0
    if wide:                                                           # M M^T = U S^2 U^T
        return E * (rs * alive), (E.T @ Wd) * (alive / rs)[:, None]
    v = torch.linalg.solve_triangular(L, (rs * alive)[:, None] * E.T, upper=False, left=False)  # (.) L^-1
    return (M @ E) * (alive / rs), v                                   # M^T M = V S^2 V^T


class WhitenedSpectra:
    """Full-rank SVD-LLM v1 factors of every target projection of a dense model, computed once.

    ``factors(keep)`` / ``compress(model, keep)`` then truncate to SVD-LLM's rank rule
    r = keep_rank(out, in, keep) (or explicit ``ranks``) without another SVD.
    """

    def __init__(self, model, stats: CalibStats, targets: Iterable[str] = LLAMA_PROJ,
                 dtype: torch.dtype | None = None, progress: bool = True):
        self.targets = tuple(targets)
        self.u: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.bias: dict[str, torch.Tensor | None] = {}
        chol: dict[int, torch.Tensor] = {}
        lins = list(iter_linears(model, self.targets))
        for name, lin in tqdm(lins, desc="whitened SVD", disable=not progress, leave=False):
            if isinstance(lin, LowRankLinear):
                raise ValueError(f"{name} is already factorized; WhitenedSpectra needs a dense model")
            st = stats[name]
            if id(st) not in chol:   # q/k/v and gate/up share one statistic, hence one Cholesky factor
                chol[id(st)] = cholesky_lower(st.xtx)
            dt = dtype or lin.weight.dtype
            u, v = whitened_full(lin.weight, chol[id(st)])
            self.u[name], self.v[name] = u.to(dt), v.to(dt)
            self.bias[name] = None if lin.bias is None else lin.bias.detach().clone()

    def rank(self, name: str, keep: float) -> int:
        """SVD-LLM's rank for matrix ``name`` at canonical ``keep``."""
        return keep_rank(self.u[name].shape[0], self.v[name].shape[1], keep)

    def factors(self, keep: float | None = None, ranks: dict[str, int] | None = None) -> dict[str, LowRankLinear]:
        """``{name: LowRankLinear}`` at canonical ``keep`` (every matrix) or for the matrices in ``ranks``."""
        if (keep is None) == (ranks is None):
            raise ValueError("give exactly one of keep= or ranks=")
        out = {}
        for name in (ranks if ranks is not None else self.u):
            if name not in self.u:
                raise KeyError(f"{name} is not a decomposed projection")
            full = self.u[name].shape[1]
            r = ranks[name] if ranks is not None else self.rank(name, keep)
            if not 1 <= r <= full:
                raise ValueError(f"{name}: rank {r} outside [1, {full}]")
            b = self.bias[name]      # copies: a compressed model never aliases the cache
            out[name] = LowRankLinear(self.u[name][:, :r].clone(memory_format=torch.contiguous_format),
                                      self.v[name][:r].clone(), None if b is None else b.clone())
        return out

    @torch.no_grad()
    def compress(self, model, keep: float | None = None, ranks: dict[str, int] | None = None):
        """A factorized deep copy of the dense ``model`` these spectra came from (``compress_svdllm``'s result)."""
        meta = {"family": "svdllm", "variant": "v1", "keep": keep, "shared_groups": []}
        facs = self.factors(keep, ranks)
        return replace_with_factors(copy_for_factors(model, facs), facs, meta)
