"""The composed cache as a transformers ``Cache``, and the attention that reads it.

A :class:`ComposedLayer` holds one layer's tiers (:class:`~lowrank_lib.composed.kv.HeadTiers` per row and
KV head: exact, low-rank, dropped) built once from a recorded prefill
(:func:`lowrank_lib.composed.build.compress`), and the tokens appended after it (exact, [B, H, t, d]).
``update`` hands attention a :class:`TieredRead`; the function routed by :func:`composed_attention` reads
it with :func:`~lowrank_lib.composed.kv.attend` (exact tokens, the low-rank tier in factor space and the
appended rows under one softmax). Every other call (a dense cache, a prefill) goes to the attention in
effect. Eviction-only plans (no low-rank tier) are the ragged head-wise eviction cache.

    >>> cache = compress(model, tok, ids, ComposedConfig(...), budget=0.25)
    >>> with composed_attention(model):
    ...     logits = model(next_ids, **cache_kw(cache)).logits

Positions: ``get_seq_length`` is the logical length (prefill + appended), so RoPE continues from the full
prompt; the mask transformers builds covers only the appended rows (``get_mask_sizes``).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..hf.attention import routed_attention
from ..hf.cache import CompressedKVCache, MemoryReport, PrefillCompressedLayer
from .kv import HeadTiers, attend, tiers_nbytes


@dataclass
class TieredRead:
    """What a composed layer hands attention: its tiers and the appended rows."""

    heads: list[list[HeadTiers]]
    k_new: torch.Tensor
    v_new: torch.Tensor

    @property
    def shape(self):
        raise TypeError("a composed cache layer reached a dense attention function: run the model inside "
                        "lowrank_lib.composed.composed_attention(model)")


class ComposedLayer(PrefillCompressedLayer):
    """One layer: tiers of the prefill + exact appended rows (``keys`` / ``values`` [B, H, t, d])."""

    def __init__(self, **kwargs):
        super().__init__()
        self.heads: list[list[HeadTiers]] | None = None
        self.prefill_len = 0

    def load_tiers(self, heads: list[list[HeadTiers]], S: int, like: torch.Tensor) -> None:
        """Hold ``heads`` for a prefill of ``S`` tokens; ``like`` [B, H, ., d] gives dtype and device."""
        if self.is_initialized:
            raise RuntimeError("ComposedLayer.load_tiers: the layer already holds tokens")
        B, H, _, d = like.shape
        empty = like.new_zeros(B, H, 0, d)
        self.lazy_initialization(empty, empty.clone())
        self.heads, self.seen, self.prefill_len = heads, S, S

    def compress(self, obs) -> None:
        raise RuntimeError("a ComposedLayer is built from a recorded prefill (lowrank_lib.composed.build.compress), "
                           "not by a live prefill")

    def read(self) -> tuple[TieredRead, TieredRead]:
        r = TieredRead(self.heads, self.keys, self.values)
        return r, r

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        n = self.keys.shape[-2]                    # appended rows held before this update
        return n + query_length, self.seen - n

    @property
    def nbytes(self) -> int:
        return tiers_nbytes(self.heads or []) + super().nbytes


class ComposedCache(CompressedKVCache):
    """One :class:`ComposedLayer` per layer; ``memory()`` counts the bytes of the tensors held."""

    def __init__(self, n_layers: int, info: dict | None = None):
        super().__init__([ComposedLayer() for _ in range(n_layers)])
        self.info = info or {}

    def memory(self) -> MemoryReport:
        rep = super().memory()
        for l in self.layers:
            rk = [h.rank_k for row in l.heads for h in row]
            rv = [h.rank_v for row in l.heads for h in row]
            rep.rank_k.append(max(rk))
            rep.rank_v.append(max(rv))
            rep.head_rank_k.append([float(r) for r in rk])
            rep.head_rank_v.append([float(r) for r in rv])
        return rep

    def tier_counts(self) -> dict:
        """Tokens per tier summed over layers, rows and heads (exact, low-rank) and the prefill total."""
        e = sum(h.n_exact for l in self.layers for row in l.heads for h in row)
        m = sum(h.n_mid for l in self.layers for row in l.heads for h in row)
        l0 = self.layers[0]
        B, H = len(l0.heads), len(l0.heads[0])
        return {"exact": e, "mid": m, "total": len(self.layers) * B * H * l0.prefill_len}


def _make(inner):
    def composed_attention_fn(module, query, key, value, attention_mask, scaling=None, **kwargs):
        """query [B, Hq, q, d]; key a TieredRead (value: the same) or dense K -> ([B, q, Hq, d], None)."""
        if not isinstance(key, TieredRead):
            return inner(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        t = key.k_new.shape[-2]
        m = attention_mask
        if m is not None and m.dim() == 4 and m.shape[-1] != t:
            raise ValueError(f"composed attention (layer {module.layer_idx}): mask covers {m.shape[-1]} positions, "
                             f"{t} appended rows are held")
        if m is not None and m.dim() != 4:
            m = None
        out = attend(query, key.heads, key.k_new, key.v_new, scaling, m)
        return out.transpose(1, 2).contiguous(), None

    return composed_attention_fn


@contextmanager
def composed_attention(model):
    """Inside the block ``model``'s attention reads composed layers (every other call is unchanged)."""
    with routed_attention(model, _make):
        yield
