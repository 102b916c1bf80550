"""Plain truncated SVD at a canonical keep ratio (the baseline every family is compared with).

Sweeps over keep ratios reuse one SVD per matrix: :class:`SVDSpectra` computes the spectra once,
and ``compress_svd(model, keep, spectra=...)`` only truncates.
"""
from __future__ import annotations

from typing import Iterable

import torch
from tqdm.auto import tqdm

from ..factorized import LLAMA_PROJ, LowRankLinear, iter_linears, replace_with_factors, split_sqrt
from ..ranks import keep_rank
from .common import copy_for_factors


class SVDSpectra:
    """Full thin SVD ``(U, S, Vh)`` of every target projection of a dense model, computed once.

    Memory: about 1x the projection weights (U and Vh are [out, k] and [k, in], k = min(out, in)).
    """

    def __init__(self, model, targets: Iterable[str] = LLAMA_PROJ, include_lm_head: bool = False,
                 compute_dtype: torch.dtype = torch.float32, progress: bool = True):
        self.targets = tuple(targets)
        self.include_lm_head = include_lm_head
        self.svd: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.bias: dict[str, torch.Tensor | None] = {}
        lins = list(iter_linears(model, self.targets, include_lm_head))
        for name, lin in tqdm(lins, desc="SVD", disable=not progress, leave=False):
            if isinstance(lin, LowRankLinear):
                raise ValueError(f"{name} is already factorized; SVDSpectra needs a dense model")
            self.svd[name] = torch.linalg.svd(lin.weight.detach().to(compute_dtype), full_matrices=False)
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


def compress_svd(model, keep: float, targets: Iterable[str] = LLAMA_PROJ, include_lm_head: bool = False,
                 inplace: bool = False, spectra: SVDSpectra | None = None, progress: bool = False):
    """Replace each target projection W by its best rank-r approximation, r = keep_rank(out, in, keep).

    Returns the factorized model (a deep copy unless ``inplace``). Pass ``spectra`` (computed on
    the same dense model) to skip the SVDs in a sweep.
    """
    spectra = spectra or SVDSpectra(model, targets, include_lm_head, progress=progress)
    dtype = next(model.parameters()).dtype
    facs = spectra.factors(keep=keep, dtype=dtype)
    m = model if inplace else copy_for_factors(model, facs)
    return replace_with_factors(m, facs, {"family": "svd", "keep": keep, "shared_groups": []})
