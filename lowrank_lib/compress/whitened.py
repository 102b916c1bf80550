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

On disk: :meth:`WhitenedSpectra.cached` keeps the factors of a (model, calibration tokens, targets, dtype) as one
safetensors file under ``<model cache>/whitened/<key>.safetensors`` (the key: sha256 of the weights, the
calibration token ids, the targets and the dtype), memory-mapped back on the next call: a notebook reopened
skips the calibration and the SVDs (SmolLM2: 32 s -> under a second). The folder stays under a byte limit, least
recently used first out (:mod:`lowrank_lib.compress.spectra_cache`, shared with :meth:`FactorSpectra.cached`).
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterable

import torch
from tqdm.auto import tqdm

from ..factorized import LLAMA_PROJ, LowRankLinear, iter_linears, replace_with_factors
from ..ranks import keep_rank
from .calib import CalibStats, cholesky_lower, collect_stats
from .common import BoundedCache, FullRankFactors, copy_for_factors
from .spectra_cache import cached, read_spectra, weights_digest, write_spectra


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


class WhitenedSpectra(FullRankFactors):
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
        chol = BoundedCache()          # q/k/v and gate/up share one statistic, hence one Cholesky factor
        lins = list(iter_linears(model, self.targets))
        for name, lin in tqdm(lins, desc="whitened SVD", disable=not progress, leave=False):
            if isinstance(lin, LowRankLinear):
                raise ValueError(f"{name} is already factorized; WhitenedSpectra needs a dense model")
            st = stats[name]
            dt = dtype or lin.weight.dtype
            u, v = whitened_full(lin.weight, chol.get(id(st), lambda: cholesky_lower(st.xtx)))
            self.u[name], self.v[name] = u.to(dt), v.to(dt)
            self.bias[name] = None if lin.bias is None else lin.bias.detach().clone()

    method, label = "svdllm", "SVD-LLM v1"      # the rows' name, the screen's

    #: bump when the stored factors change meaning (an old file then has another key: a miss)
    FORMAT = 1

    @classmethod
    def from_factors(cls, u: dict, v: dict, bias: dict, targets: Iterable[str] = LLAMA_PROJ) -> "WhitenedSpectra":
        """Spectra from stored full-rank factors (what :meth:`save` wrote), without computing anything."""
        self = cls.__new__(cls)
        self.targets, self.u, self.v, self.bias = tuple(targets), dict(u), dict(v), dict(bias)
        return self

    def save(self, path: str | Path) -> Path:
        """Write the factors as one safetensors file (``u.<name>``, ``v.<name>``, ``bias.<name>``)."""
        return write_spectra(self, path, self.FORMAT)

    @classmethod
    def load(cls, path: str | Path) -> "WhitenedSpectra":
        """The spectra :meth:`save` wrote, memory-mapped (ValueError for a file of another format or a missing
        tensor)."""
        u, v, bias, targets = read_spectra(path, cls.FORMAT)
        return cls.from_factors(u, v, bias, targets)

    @staticmethod
    def key(model, calib_ids: torch.Tensor, targets: Iterable[str] = LLAMA_PROJ,
            dtype: torch.dtype | None = None) -> str:
        """The cache key: sha256 of the weights (names and bytes), the calibration token ids, the targets, the
        dtype and :attr:`FORMAT`."""
        h = weights_digest(model)
        h.update(calib_ids.to(torch.int64).contiguous().numpy().tobytes())
        h.update(json.dumps([list(targets), str(dtype), WhitenedSpectra.FORMAT]).encode())
        return h.hexdigest()[:32]

    @classmethod
    def cached(cls, model, calib_ids: torch.Tensor, targets: Iterable[str] = LLAMA_PROJ,
               dtype: torch.dtype | None = None, cache_dir: str | Path | None = None, progress: bool = True,
               max_cache_bytes: int | None = None) -> tuple["WhitenedSpectra", dict]:
        """``(spectra, info)`` of ``model`` calibrated on ``calib_ids`` [n, seq]: read from the cache when this
        (weights, tokens, targets, dtype) was decomposed before, else calibrated (:func:`collect_stats`),
        decomposed and written there (atomically; :func:`lowrank_lib.compress.spectra_cache.cached`). ``info``:
        ``hit``, ``path``, ``key``, ``written``, ``stats_s`` / ``whiten_s`` (the work done now; 0 on a hit),
        ``seconds`` (all of it, the key's hashing included). ``cache_dir`` default: ``<model cache>/whitened``;
        after a write the folder is pruned to ``max_cache_bytes`` (default :func:`cache_limit`)."""
        t0 = time.perf_counter()
        targets = tuple(targets)

        def make():
            t1 = time.perf_counter()
            stats = collect_stats(model, calib_ids, targets, progress=progress)
            t2 = time.perf_counter()
            spectra = cls(model, stats, targets, dtype, progress)
            return spectra, {"stats_s": t2 - t1, "whiten_s": time.perf_counter() - t2}

        return cached(Path(cache_dir) if cache_dir is not None else default_cache_dir(),
                      cls.key(model, calib_ids, targets, dtype), cls.load, make, cls.save,
                      cache_limit() if max_cache_bytes is None else max_cache_bytes,
                      misses={"stats_s": 0.0, "whiten_s": 0.0}, started=t0)

    def rank(self, name: str, keep: float) -> int:
        """SVD-LLM's rank for matrix ``name`` at canonical ``keep``."""
        return keep_rank(self.u[name].shape[0], self.v[name].shape[1], keep)

    @torch.no_grad()
    def compress(self, model, keep: float | None = None, ranks: dict[str, int] | None = None, share: bool = False):
        """A factorized deep copy of the dense ``model`` these spectra came from (``compress_svdllm``'s result); with
        ``share`` its factors are views of these spectra (:meth:`factors`) and its other parameters ``model``'s own
        (:func:`copy_for_factors`): nothing is copied."""
        meta = {"family": "svdllm", "variant": "v1", "keep": keep, "shared_groups": []}
        facs = self.factors(keep, ranks, share)
        return replace_with_factors(copy_for_factors(model, facs, share), facs, meta)


def default_cache_dir() -> Path:
    """``<model cache>/whitened`` (:func:`lowrank_lib.models.default_cache_dir`)."""
    from ..models import default_cache_dir as root

    return root() / "whitened"


def cache_limit() -> int:
    """Bytes the spectra cache may hold: ``$LOWRANK_LIB_WHITENED_CACHE_GB`` (default 8 GB, a few models' worth)."""
    from ..models import cache_limit as limit

    return limit("LOWRANK_LIB_WHITENED_CACHE_GB", 8)
