"""Plain truncated SVD at a canonical keep ratio (the baseline every family is compared with).

Sweeps over keep ratios reuse one SVD per matrix: :class:`SVDSpectra` computes the spectra once,
and ``compress_svd(model, keep, spectra=...)`` only truncates.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Iterable

import torch
from tqdm.auto import tqdm

from ..factorized import LLAMA_PROJ, LowRankLinear, iter_linears, replace_with_factors, split_sqrt, thin_svd
from ..ranks import keep_rank
from .common import FullRankFactors, copy_for_factors
from .spectra_cache import cached, read_spectra, weights_digest, write_spectra


class SVDSpectra:
    """Full thin SVD ``(U, S, Vh)`` of every target projection of a dense model, computed once (:func:`thin_svd`,
    float64; stored in ``dtype``).

    Memory: about 1x the projection weights (U and Vh are [out, k] and [k, in], k = min(out, in)).
    """

    def __init__(self, model, targets: Iterable[str] = LLAMA_PROJ, include_lm_head: bool = False,
                 dtype: torch.dtype = torch.float32, progress: bool = True):
        self.targets = tuple(targets)
        self.include_lm_head = include_lm_head
        self.svd: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.bias: dict[str, torch.Tensor | None] = {}
        lins = list(iter_linears(model, self.targets, include_lm_head))
        for name, lin in tqdm(lins, desc="SVD", disable=not progress, leave=False):
            if isinstance(lin, LowRankLinear):
                raise ValueError(f"{name} is already factorized; SVDSpectra needs a dense model")
            self.svd[name] = thin_svd(lin.weight, dtype)
            self.bias[name] = None if lin.bias is None else lin.bias.detach().clone()

    def factors(self, keep: float | None = None, ranks: dict[str, int] | None = None, dtype=torch.float32):
        """``{name: LowRankLinear}`` at a canonical keep ratio, or for the matrices named in ``ranks``."""
        out = {}
        for name in (ranks if ranks is not None else self.svd):
            U, S, Vh = self.svd[name]
            r = ranks[name] if ranks is not None else keep_rank(U.shape[0], Vh.shape[1], keep)
            A, B = split_sqrt(U, S, Vh, r, dtype)
            out[name] = LowRankLinear(A, B, self.bias[name])
        return out


def compress_svd(model, keep: float | None = None, targets: Iterable[str] = LLAMA_PROJ, include_lm_head: bool = False,
                 inplace: bool = False, spectra: SVDSpectra | None = None, progress: bool = False,
                 full_rank: bool = False):
    """Replace each target projection W by its best rank-r approximation, r = keep_rank(out, in, keep), or with
    ``full_rank=True`` by its exact factors (r = min(out, in); :func:`lowrank_lib.factorize`'s full-rank check).

    Returns the factorized model (a deep copy unless ``inplace``). Pass ``spectra`` (computed on
    the same dense model) to skip the SVDs in a sweep: one SVD per matrix then serves the full-rank check and
    every keep.
    """
    if (keep is None) != full_rank:
        raise ValueError("give exactly one of keep= or full_rank=True")
    spectra = spectra or SVDSpectra(model, targets, include_lm_head, progress=progress)
    dtype = next(model.parameters()).dtype
    full = {n: min(U.shape[0], Vh.shape[1]) for n, (U, _, Vh) in spectra.svd.items()} if full_rank else None
    facs = spectra.factors(keep=keep, ranks=full, dtype=dtype)
    m = model if inplace else copy_for_factors(model, facs)
    return replace_with_factors(m, facs, {"family": "svd", "keep": 1.0 if full_rank else keep, "shared_groups": []})


class FactorSpectra(FullRankFactors):
    """The factors of an ALREADY compressed model, re-decomposed so that every lower rank is a slice (the keep
    slider of notebook 00 on a checkpoint you bring).

    For each ``LowRankLinear`` (U [out, r], V [r, in]): U = Q_u R_u and V^T = Q_v R_v (thin QR), SVD(R_u R_v^T) =
    A S B^T, and u = Q_u A sqrt(S), v = sqrt(S) B^T Q_v^T. Then u v = U V (the same map up to the rounding of the
    working precision: float64 for fp32 factors; float32 for bf16 / fp16 ones, 2^16 times finer than what they
    store and twice as fast: a LLaMA-7B-shape file in bf16 holds 224 such matrices of rank up to 2388), its
    components ordered by singular value, so u[:, :k] v[:k] is the best rank-k approximation of the STORED map
    (Eckart-Young; no calibration data: a checkpoint may come without its tokenizer or its dense model). Costs two
    QRs and an r x r SVD per matrix, not an SVD of the dense map. Truncating a shared basis (Basis Sharing) gives
    each matrix its own factors: the parameters really held may then grow, and :func:`lowrank_lib.account` says so.
    Dense projections of the model stay as they are.
    """

    method, label = "truncated", "your factors, truncated"      # the rows' name, the screen's

    def __init__(self, model, targets: Iterable[str] = LLAMA_PROJ, progress: bool = True):
        self.base, self.targets = model, tuple(targets)
        self.u: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.bias: dict[str, torch.Tensor | None] = {}
        lins = [(n, m) for n, m in iter_linears(model, self.targets) if isinstance(m, LowRankLinear)]
        if not lins:
            raise ValueError("the model has no LowRankLinear projection: FactorSpectra truncates stored factors "
                             "(use SVDSpectra or WhitenedSpectra on a dense model)")
        for name, lin in tqdm(lins, desc="factor SVD", disable=not progress, leave=False):
            wt = torch.float32 if lin.U.element_size() <= 2 and lin.V.element_size() <= 2 else torch.float64
            U, V = lin.U.detach().to(wt), lin.V.detach().to(wt)
            qu, ru = torch.linalg.qr(U)
            qv, rv = torch.linalg.qr(V.T)
            a, s, bh = torch.linalg.svd(ru @ rv.T)
            rs = s.sqrt()
            dt = lin.U.dtype
            self.u[name] = ((qu @ a) * rs).to(dt).contiguous()
            self.v[name] = (rs[:, None] * (bh @ qv.T)).to(dt).contiguous()
            self.bias[name] = None if lin.bias is None else lin.bias.detach().clone()

    #: bump when the stored factors change meaning (an old cache file then has another key: a miss)
    FORMAT = 1

    @classmethod
    def cached(cls, model, targets: Iterable[str] = LLAMA_PROJ, cache_dir: str | Path | None = None,
               progress: bool = True, max_cache_bytes: int | None = None) -> tuple["FactorSpectra", dict]:
        """``(spectra, info)`` of ``model`` (a compressed model): read back from the cache when the same weights were
        re-decomposed before (a notebook reopened on your checkpoint: the QRs and SVDs are the slider's wait, 129 s of
        154 for a Llama-3.2-1B-shape file), else computed and written there (:mod:`.spectra_cache`; a file larger
        than the limit alone is not kept). ``info``: ``hit``, ``written``, ``path``, ``key``, ``decompose_s`` (the
        work done now; 0 on a hit), ``seconds`` (all of it, hashing the weights included). ``cache_dir`` default:
        ``<model cache>/factor_spectra``, pruned to ``max_cache_bytes`` (default ``$LOWRANK_LIB_FACTOR_CACHE_GB``,
        24 GB: a 7B-shape file's bf16 factors)."""
        from ..models import cache_limit, default_cache_dir

        t0 = time.perf_counter()
        targets = tuple(targets)
        h = weights_digest(model)
        h.update(json.dumps([list(targets), cls.FORMAT, "factor"]).encode())

        def make():
            t1 = time.perf_counter()
            spectra = cls(model, targets, progress)
            return spectra, {"decompose_s": time.perf_counter() - t1}

        def load(path):
            self = cls.__new__(cls)
            self.base = model
            self.u, self.v, self.bias, self.targets = read_spectra(path, cls.FORMAT, cls.__name__)
            if set(self.u) != {n for n, m in iter_linears(model, targets) if isinstance(m, LowRankLinear)}:
                raise ValueError(f"{path}: other matrices than the model's factorized ones")
            return self

        folder = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "factor_spectra"
        limit = cache_limit("LOWRANK_LIB_FACTOR_CACHE_GB", 24) if max_cache_bytes is None else max_cache_bytes
        return cached(folder, h.hexdigest()[:32], load, make, lambda sp, p: write_spectra(sp, p, cls.FORMAT, cls.__name__),
                      limit, misses={"decompose_s": 0.0}, started=t0)

    def stored_rank(self, name: str) -> int:
        return self.u[name].shape[1]

    def truncated(self, name: str, r: int, share: bool = False) -> LowRankLinear:
        """At the stored rank, the checkpoint's own factors (the stored map exactly: the re-decomposition equals it
        only up to rounding, which in bf16 changes a random-weight 7B model's greedy answer); below it, the leading
        ``r`` components of the re-decomposition."""
        if r < self.stored_rank(name):
            return super().truncated(name, r, share)
        own = self.base.get_submodule(name)
        if share:
            return LowRankLinear(own.U, own.V, own.bias)
        return LowRankLinear(own.U.detach().clone(), own.V.detach().clone(),
                             None if own.bias is None else own.bias.detach().clone())

    def rank(self, name: str, keep: float) -> int:
        """The rank at canonical ``keep`` (:func:`keep_rank`), never above what the checkpoint stores."""
        return max(1, min(self.stored_rank(name), keep_rank(self.u[name].shape[0], self.v[name].shape[1], keep)))

    @torch.no_grad()
    def compress(self, model=None, keep: float | None = None, ranks: dict[str, int] | None = None,
                 share: bool = False):
        """A copy of the compressed model these spectra came from (``model``: that model or None; another one is
        refused), its factors truncated to ``keep`` / ``ranks``: the stored factors it replaces are never copied
        (:func:`copy_for_factors`), and with ``share`` the new ones are views of these spectra (:meth:`factors`) and the
        other parameters the checkpoint's own: nothing is copied."""
        if model is not None and model is not self.base:
            raise ValueError("FactorSpectra truncates the model it was built from; pass that model or None")
        facs = self.factors(keep, ranks, share)
        meta = dict(getattr(self.base, "lowrank_meta", None) or {})
        return replace_with_factors(copy_for_factors(self.base, facs, share), facs,
                                    {**meta, "keep": keep, "truncated_from": meta.get("keep"), "shared_groups": []})
