"""Perplexity over non-overlapping windows, the protocol SVD-LLM, ASVD and Basis Sharing use.

PPL = exp(total NLL / total predicted tokens). Each window of ``seq_len`` tokens is scored
independently (no context carried across windows); the first token of each window is not
predicted. Trailing tokens that do not fill a window are dropped, as in those codebases.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

__all__ = ["PerplexityResult", "windows", "perplexity", "wikitext_perplexity"]


@dataclass
class PerplexityResult:
    ppl: float
    nll: float             # mean NLL per predicted token
    tokens: int            # predicted tokens
    windows: int
    seq_len: int
    window_nll: list[float]  # mean NLL of each window (spread / noise estimates)

    def to_dict(self) -> dict:
        return asdict(self)


def windows(ids: torch.Tensor, seq_len: int, max_windows: int | None = None) -> torch.Tensor:
    """The protocol's windows of the 1-D token tensor ``ids``: the first ``max_windows`` (None = all)
    non-overlapping runs of ``seq_len`` tokens, ``[n, seq_len]``; the tail that fills no window is dropped."""
    if ids.dim() != 1:
        raise ValueError(f"ids must be 1-D [N], got shape {tuple(ids.shape)}")
    n_win = ids.numel() // seq_len
    if max_windows is not None:
        n_win = min(n_win, max_windows)
    if n_win < 1:
        raise ValueError(f"{ids.numel()} tokens do not fill one window of {seq_len}")
    return ids[: n_win * seq_len].view(n_win, seq_len)


@torch.no_grad()
def perplexity(model, ids: torch.Tensor, seq_len: int = 2048, max_windows: int | None = None,
               batch_size: int = 1, dtype: torch.dtype | None = torch.float32,
               progress: bool = True, desc: str = "ppl") -> PerplexityResult:
    """Perplexity of ``model`` on the 1-D token tensor ``ids``.

    Parameters
    ----------
    ids : LongTensor [N]
    seq_len : window length (default 2048, the papers' setting).
    max_windows : evaluate only the first k windows (quick runs); None = all.
    dtype : logits are upcast to this dtype before the log-softmax (fp32 by default).
    """
    wins = windows(ids, seq_len, max_windows)
    n_win = wins.shape[0]
    dev = next(model.parameters()).device
    per_win: list[float] = []
    total = 0.0
    bar = tqdm(range(0, n_win, batch_size), desc=desc, disable=not progress, leave=False)
    for i in bar:
        x = wins[i:i + batch_size].to(dev)
        logits = model(x).logits[:, :-1]
        if dtype is not None:
            logits = logits.to(dtype)
        nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                              reduction="none").view(x.shape[0], -1)
        for row in nll.double().mean(1).tolist():
            per_win.append(row)
        total += float(nll.double().sum())
        bar.set_postfix(ppl=f"{math.exp(total / (len(per_win) * (seq_len - 1))):.3f}")
    n_tok = n_win * (seq_len - 1)
    mean = total / n_tok
    return PerplexityResult(math.exp(mean), mean, n_tok, n_win, seq_len, per_win)


def wikitext_perplexity(model, tokenizer, split: str = "test", **kw) -> PerplexityResult:
    """Perplexity on WikiText-2 (``test`` split by default) from the repository's data folder."""
    from ..data import tokens

    return perplexity(model, tokens(tokenizer, split), **kw)
