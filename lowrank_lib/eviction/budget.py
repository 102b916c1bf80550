"""Token budgets of eviction at a BYTE budget: how many tokens each (layer, batch row, KV head) keeps.

Bytes are the bytes really held by a ragged cache (:mod:`lowrank_lib.kv.methods.composed`): per kept token its key
and value rows plus its position, stored in the smallest integer type that holds every position
(:func:`index_dtype`). Three allocations:

- ``"head"``: every head keeps the same number of tokens (the classic per-head top-k: H2O, SnapKV, ...);
- ``"layer"``: every layer keeps the same number, shared among its heads by their scores (a uniform
  per-layer budget, KVzip's ablation);
- ``"global"``: the top scores of ALL layers and heads together (KVzip's non-uniform allocation).

Scores are ``[B, H, S]`` per layer, higher = keep; ``+inf`` marks tokens a policy always keeps (sinks, a
recent window). Ties are broken by position (later first), so allocations are deterministic.
"""
from __future__ import annotations

import torch

MODES = ("head", "layer", "global")


def index_dtype(S: int) -> torch.dtype:
    """Smallest signed integer dtype holding positions 0 .. S - 1."""
    return torch.int16 if S <= 2 ** 15 else torch.int32


def token_bytes(head_dim: int, elt: int, S: int) -> int:
    """Bytes one kept token costs per KV head: its key and value rows + its stored position."""
    return 2 * head_dim * elt + torch.empty(0, dtype=index_dtype(S)).element_size()


def with_window(score: torch.Tensor, window: int) -> torch.Tensor:
    """A copy of ``score`` [.., S] with the newest ``window`` tokens forced (+inf)."""
    s = score.float().clone()
    if window > 0:
        s[..., -window:] = float("inf")
    return s


def _tiebreak(score: torch.Tensor) -> torch.Tensor:
    S = score.shape[-1]
    return score.float() + torch.arange(S, device=score.device) * 1e-12


def keep_counts(scores: list[torch.Tensor], n_tokens: int, mode: str = "global") -> list[torch.Tensor]:
    """Tokens kept per (layer, batch row, head), ``[B, H]`` long per layer, ``n_tokens`` in all (or fewer when
    the prompt is shorter). ``mode`` as in the module docstring."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    L = len(scores)
    B, H, S = scores[0].shape
    n_tokens = max(0, min(int(n_tokens), L * B * H * S))
    if mode == "head":
        per = n_tokens // (L * B * H)
        return [torch.full((B, H), per, dtype=torch.long, device=s.device) for s in scores]
    if mode == "layer":
        per = n_tokens // L
        out = []
        for s in scores:
            flat = _tiebreak(s).reshape(-1)
            top = flat.topk(min(per, flat.numel())).indices
            c = torch.zeros(B * H, dtype=torch.long, device=s.device)
            c.index_add_(0, top // S, torch.ones_like(top))
            out.append(c.view(B, H))
        return out
    flat = torch.cat([_tiebreak(s).reshape(-1) for s in scores])
    top = flat.topk(n_tokens).indices
    c = torch.zeros(L * B * H, dtype=torch.long, device=flat.device)
    c.index_add_(0, top // S, torch.ones_like(top))
    return list(c.view(L, B, H).unbind(0))


def select(score: torch.Tensor, counts: torch.Tensor) -> list[list[torch.Tensor]]:
    """Kept positions per batch row and head: ``[b][h]`` -> sorted long [counts[b, h]] (top scores)."""
    B, H, S = score.shape
    s = _tiebreak(score)
    return [[s[b, h].topk(int(counts[b, h])).indices.sort().values for h in range(H)] for b in range(B)]
