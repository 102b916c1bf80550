"""Activation statistics of each projection's input, collected with forward hooks.

For every target Linear with input X (tokens x in) we accumulate, over calibration batches,

* ``xtx``     = sum_t x_t x_t^T          [in, in]   per-batch fp32 Gram (as SVD-LLM), summed in float64
* ``abs_mean`` = sum_samples mean_t |x_t|  [in]       float64 (ASVD's activation scale)
* ``tokens``   number of tokens seen.

Projections that read the same tensor (q/k/v, gate/up) share one statistic (``INPUT_OF``), so a
Llama layer costs four Gram updates, not seven. Everything runs on the dense model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ..factorized import LLAMA_PROJ, iter_linears

__all__ = ["calibration_data", "CalibStats", "cholesky_lower", "collect_stats", "INPUT_OF", "LayerStats"]

#: Projections whose input equals another projection's input in a Llama layer.
INPUT_OF = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


@dataclass
class LayerStats:
    xtx: torch.Tensor          # [in, in] float64, sum over tokens
    abs_mean: torch.Tensor     # [in] float64, sum over samples of per-sample mean |x|
    tokens: int = 0
    samples: int = 0


@dataclass
class CalibStats:
    """Per-module statistics; ``stats[name]`` works for every target (shared entries aliased)."""

    stats: dict[str, LayerStats] = field(default_factory=dict)
    n_samples: int = 0
    seq_len: int = 0

    def __getitem__(self, name: str) -> LayerStats:
        return self.stats[name]

    def __contains__(self, name: str) -> bool:
        return name in self.stats


def _source_name(name: str) -> str:
    parent, _, leaf = name.rpartition(".")
    src = INPUT_OF.get(leaf)
    return f"{parent}.{src}" if src else name


@torch.no_grad()
def collect_stats(model: nn.Module, batches: torch.Tensor, targets=LLAMA_PROJ, batch_size: int = 1,
                  progress: bool = True) -> CalibStats:
    """Run ``batches`` [n, seq] through ``model`` and gather input statistics of every target.

    Returns a :class:`CalibStats`; k/v share q's entry, up shares gate's (same object).
    """
    names = [n for n, _ in iter_linears(model, targets)]
    owners = {n: _source_name(n) for n in names}
    owners = {n: (o if o in owners else n) for n, o in owners.items()}
    acc: dict[str, LayerStats] = {}
    hooks = []

    def make_hook(name):
        def hook(mod, inp, out):
            x = inp[0].detach()                      # (B, T, in)
            xs = x.reshape(-1, x.shape[-1]).float()
            st = acc.get(name)
            if st is None:
                st = acc[name] = LayerStats(torch.zeros(xs.shape[1], xs.shape[1], dtype=torch.float64),
                                            torch.zeros(xs.shape[1], dtype=torch.float64))
            st.xtx += (xs.T @ xs).double()           # per-batch Gram in fp32 (as SVD-LLM), summed in fp64
            st.abs_mean += x.abs().double().mean(dim=1).sum(0)  # per-sample mean over tokens, summed
            st.tokens += xs.shape[0]
            st.samples += x.shape[0]
        return hook

    mods = dict(model.named_modules())
    for n in set(owners.values()):
        hooks.append(mods[n].register_forward_hook(make_hook(n)))
    try:
        dev = next(model.parameters()).device
        for i in tqdm(range(0, batches.shape[0], batch_size), desc="calibration", disable=not progress, leave=False):
            model(batches[i:i + batch_size].to(dev), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    return CalibStats({n: acc[o] for n, o in owners.items()}, int(batches.shape[0]), int(batches.shape[1]))


def calibration_data(model_name_or_tok, n_samples: int, seq_len: int, seed: int = 0, vocab_size: int | None = None):
    """``[n, seq]`` calibration ids: WikiText-2 valid windows for a tokenizer, random ids otherwise."""
    from .. import data

    if model_name_or_tok is None:
        if vocab_size is None:
            raise ValueError("random calibration tokens need vocab_size")
        return data.random_token_batches(vocab_size, n_samples, seq_len, seed)
    return data.calibration_batches(model_name_or_tok, n_samples, seq_len, seed)


def cholesky_lower(A: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Lower Cholesky factor L (L L^T = A) in float64 with SVD-LLM's fallback.

    If ``A`` is not positive definite, add (-lambda_min + eps) I and retry (SVD-LLM uses 1e-6,
    Basis Sharing 7e-6). ``A`` [n, n] -> L [n, n] float64.
    """
    A = A.double()
    L, info = torch.linalg.cholesky_ex(A)
    if int(info) == 0:
        return L
    lam_min = torch.linalg.eigvalsh(A)[0]
    A = A + (-lam_min + eps) * torch.eye(A.shape[0], dtype=A.dtype)
    L, info = torch.linalg.cholesky_ex(A)
    if int(info) != 0:
        raise torch.linalg.LinAlgError(f"Cholesky failed even after the (-lambda_min + {eps}) I shift")
    return L
