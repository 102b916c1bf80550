"""Small helpers the compressors share: whitened SVD, per-matrix loops, applying factors."""
from __future__ import annotations

import copy
from collections import OrderedDict
from typing import Any, Callable, Hashable, Iterable

import torch
from tqdm.auto import tqdm

from ..factorized import LLAMA_PROJ, LowRankLinear, iter_linears, replace_with_factors, thin_svd
from ..host import available_memory

__all__ = ["BoundedCache", "FullRankFactors", "whitened_factors", "compress_each", "copy_for_factors", "leaf"]


class BoundedCache:
    """Matrices a compressor derives once and reads again (a statistic's Cholesky factor or square roots, shared by
    q / k / v and gate / up; Dobi's eigenvectors between its allocation and its factors), kept while they fit in
    ``budget`` bytes (default: an eighth of the memory available when the cache is made). Past it the least
    recently used entry is dropped, and made again if asked for again. A compressor walks the layers in order, so
    a model whose derived matrices fit keeps them all (as a plain dict would), and a larger one holds a few layers'
    worth instead of every layer's: SVD-LLM's float64 Cholesky factors are 10 GB at Llama-3.2-1B, 44 GB at
    LLaMA-2-7B. ``made`` counts the entries made (a second count for a key means it was dropped and made again)."""

    def __init__(self, budget: int | None = None):
        self.budget = available_memory() // 8 if budget is None else int(budget)
        self._entries: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self.bytes = 0
        self.made = 0

    def get(self, key: Hashable, make: Callable[[], Any]):
        """The entry for ``key``, made by ``make()`` when absent."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key][0]
        value = make()
        self.made += 1
        self.put(key, value)
        return value

    def put(self, key: Hashable, value) -> None:
        n = sum(t.numel() * t.element_size() for t in (value if isinstance(value, (tuple, list)) else (value,))
                if isinstance(t, torch.Tensor))
        if key in self._entries:
            self.bytes -= self._entries.pop(key)[1]
        self._entries[key] = (value, n)
        self.bytes += n
        while self.bytes > self.budget and len(self._entries) > 1:
            self.bytes -= self._entries.popitem(last=False)[1][1]

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)


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

    Factors keep the projection's dtype; the bias (if any) is kept as is. ``fn`` reads ``model``'s own projections;
    the model returned is :func:`copy_for_factors` of it (the weights the factors replace are never copied: a deep
    copy of a 7B model would hold 13 GB more in bf16), or ``model`` itself with ``inplace``.
    """
    new = {}
    for name, lin in tqdm(list(iter_linears(model, targets)), desc=desc, disable=not progress, leave=False):
        if isinstance(lin, LowRankLinear):
            raise ValueError(f"{name} is already factorized; compress the dense model")
        out = fn(name, lin)
        if out is None:
            continue
        U, V = out
        dt = lin.weight.dtype
        b = None if lin.bias is None else lin.bias.detach().clone()
        new[name] = LowRankLinear(U.to(dt).contiguous(), V.to(dt).contiguous(), b)
    return replace_with_factors(model if inplace else copy_for_factors(model, new), new, meta)


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
