"""Small helpers the compressors share: whitened SVD, per-matrix loops, applying factors."""
from __future__ import annotations

import copy
from typing import Callable, Iterable

import torch
from tqdm.auto import tqdm

from ..factorized import LLAMA_PROJ, LowRankLinear, iter_linears, replace_with_factors, thin_svd

__all__ = ["FullRankFactors", "whitened_factors", "compress_each", "copy_for_factors", "leaf"]


def whitened_factors(W: torch.Tensor, L: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SVD-LLM truncation-aware whitening: SVD(W L) = U S Vh, u = U_r sqrt(S_r), v = sqrt(S_r) Vh_r L^-1.

    W [out, in], L [in, in] lower Cholesky factor of X^T X (float64) -> u [out, r], v [r, in] float64.
    Minimises ||(W - u v) X||_F among rank-r maps (Theorem 3.2 of SVD-LLM).
    """
    U, S, Vh = thin_svd(W.double() @ L)
    s = S[:rank].sqrt()
    v = torch.linalg.solve_triangular(L, s[:, None] * Vh[:rank], upper=False, left=False)  # (.) L^-1
    return U[:, :rank] * s, v


@torch.no_grad()
def compress_each(model, fn: Callable[[str, torch.nn.Linear], tuple], meta: dict, targets: Iterable[str] = LLAMA_PROJ,
                  inplace: bool = False, desc: str = "compress", progress: bool = True):
    """Apply ``fn(name, linear) -> (U, V) | None`` to every target projection; returns the new model.

    Factors keep the projection's dtype; the bias (if any) is kept as is.
    """
    m = model if inplace else copy.deepcopy(model)
    new = {}
    for name, lin in tqdm(list(iter_linears(m, targets)), desc=desc, disable=not progress, leave=False):
        if isinstance(lin, LowRankLinear):
            raise ValueError(f"{name} is already factorized; compress the dense model")
        out = fn(name, lin)
        if out is None:
            continue
        U, V = out
        dt = lin.weight.dtype
        b = None if lin.bias is None else lin.bias.detach().clone()
        new[name] = LowRankLinear(U.to(dt).contiguous(), V.to(dt).contiguous(), b)
    return replace_with_factors(m, new, meta)


def copy_for_factors(model, names: Iterable[str], share: bool = False):
    """A deep copy of ``model`` in which ``replace_with_factors`` is about to replace the modules ``names`` (``Linear``
    or ``LowRankLinear``): a parameter that only those modules hold (a weight; a checkpoint's factors U / V, a
    basis every sharer of which is replaced) is not copied (a one-element placeholder stands in until the
    replacement), which saves a copy of most of the model's bytes. Every other parameter (the embedding, a tied head,
    a basis shared with a module that stays) is copied as usual, or with ``share`` held by the copy as it is (the
    same tensor: for a copy that is used and dropped; changing it in place would change ``model``)."""
    names = set(names)
    holders: dict[int, set[str]] = {}
    params: dict[int, torch.nn.Parameter] = {}
    for n, m in model.named_modules():
        for p in m.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(n)
            params[id(p)] = p
    # the placeholder: the parameter's shape, dtype and device over ONE element (stride 0), so the replacement's
    # checks (shapes, device) read what they would read on the original
    memo = {i: torch.nn.Parameter(params[i].new_empty(()).expand(params[i].shape), requires_grad=False)
            for i, hs in holders.items() if hs <= names}
    if share:
        memo.update({i: p for i, p in params.items() if i not in memo})
    return copy.deepcopy(model, memo)


def leaf(name: str) -> str:
    return name.rsplit(".", 1)[-1]


class FullRankFactors:
    """Full-rank factors ``u[name]`` [out, k] / ``v[name]`` [k, in] (components by decreasing importance) and
    ``bias[name]``, of which every lower rank is a slice; a subclass defines ``rank(name, keep)``."""

    u: dict[str, torch.Tensor]
    v: dict[str, torch.Tensor]
    bias: dict[str, torch.Tensor | None]

    def rank(self, name: str, keep: float) -> int:
        raise NotImplementedError

    def factors(self, keep: float | None = None, ranks: dict[str, int] | None = None,
                share: bool = False) -> dict[str, LowRankLinear]:
        """``{name: LowRankLinear}`` at canonical ``keep`` (every matrix, :meth:`rank`) or for the matrices in
        ``ranks``; copies, so a compressed model never aliases these factors, unless ``share``: then views of them
        (no bytes copied; for a model that is used and dropped, as the keep slider's: changing its weights in place
        would change these spectra; ``compress(..., share=True)`` also shares the model's other parameters)."""
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
            out[name] = self.truncated(name, r, share)
        return out

    def truncated(self, name: str, r: int, share: bool = False) -> LowRankLinear:
        """Matrix ``name`` at rank ``r`` (checked by :meth:`factors`): the leading ``r`` components, copied or (``share``)
        views."""
        b = self.bias[name]
        if share:
            return LowRankLinear(self.u[name][:, :r], self.v[name][:r], b)
        return LowRankLinear(self.u[name][:, :r].clone(memory_format=torch.contiguous_format),
                             self.v[name][:r].clone(), None if b is None else b.clone())
