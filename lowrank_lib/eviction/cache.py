"""Eviction at matched memory: a cache layer that keeps ``n`` tokens per (batch row, KV head) after prefill.

Real eviction: the dropped rows are freed (the stored tensors are [B, H, n, d]); ``get_mask_sizes`` and
``get_seq_length`` keep positions right (RoPE positions continue from the logical length). Every policy
is a small dataclass with ``score(K, V, obs) -> [B, H, S]`` (higher = keep); the newest ``window``
tokens are always kept. Generated tokens are appended exactly (the accumulate schedule).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..geometry import geometry
from ..hf.cache import CompressedKVCache, Observation, PrefillCompressedLayer


@dataclass
class EvictionBudget:
    """Tokens kept per KV head: ``tokens`` if set, else round(``fraction`` * S). ``window`` newest always kept."""

    fraction: float | None = None
    tokens: int | None = None
    window: int = 32

    def keep(self, S: int) -> int:
        n = self.tokens if self.tokens is not None else round((self.fraction or 1.0) * S)
        return max(1, min(S, int(n)))


class EvictionLayer(PrefillCompressedLayer):
    """One layer of an eviction cache: ``policy.score`` picks which prefill tokens survive."""

    def __init__(self, policy, budget: EvictionBudget, **kwargs):
        super().__init__()
        self.policy, self.budget = policy, budget
        self.kept_idx: torch.Tensor | None = None   # [B, H, n] kept prefill positions (sorted)
        self.needs_queries = getattr(policy, "needs_queries", False)

    def compress(self, obs: Observation | None) -> None:
        K, V = self.keys, self.values                      # [B, H, S, d]
        B, H, S, d = K.shape
        n = self.budget.keep(S)
        if n >= S:
            return
        if obs is not None and obs.k_valid is not None:
            raise NotImplementedError("eviction policies do not support padded batches (left padding): "
                                      "run one prompt per batch")
        if obs is None and self.needs_queries:
            raise RuntimeError(f"{type(self.policy).__name__} scores with attention and needs the post-RoPE "
                               f"queries: run the prefill inside lowrank_lib.hf.capture(model, cache)")
        w = min(self.budget.window, n)
        score = self.policy.score(K, V, obs).float()        # [B, H, S]
        if w > 0:
            score[..., S - w:] = float("inf")
        idx = score.topk(n, dim=-1).indices.sort(dim=-1).values   # [B, H, n]
        self.kept_idx = idx
        g = idx[..., None].expand(-1, -1, -1, d)
        self.keys = K.gather(2, g).contiguous()
        self.values = V.gather(2, g).contiguous()

    def stored_len(self) -> int:
        return self.keys.shape[-2] if self.keys is not None else 0

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        # called before update() of the new tokens: stored rows are all in the past; new rows at positions
        # seen .. seen + q - 1 map to kv_idx seen - n .. so the causal mask among new tokens stays right
        n = self.stored_len()
        return n + query_length, self.seen - n


class EvictionCache(CompressedKVCache):
    """Eviction baseline cache for ``model_or_config`` with ``policy`` and ``budget``."""

    def __init__(self, model_or_config, policy, budget: EvictionBudget):
        self.policy, self.budget = policy, budget
        super().__init__([EvictionLayer(policy, budget) for _ in range(geometry(model_or_config).n_layers)])
