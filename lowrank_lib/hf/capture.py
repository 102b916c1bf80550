"""Post-RoPE queries for a cache, through :func:`~lowrank_lib.hf.attention.routed_attention`.

``LlamaAttention.forward`` applies RoPE, calls ``cache.update`` and only then the attention function, so a
cache never sees the queries. :func:`capture` routes the model's attention through a function that runs
the attention in effect and then hands the queries of a pending prefill to the cache layer
(``CompressedKVCache.observe``). The mask is the model's own (sdpa or eager), so left padding stays right.

    >>> with capture(model, cache):
    ...     model(ids, cache=cache)              # prefill: exact, then compressed with Q
    ...     model.generate(ids, cache=cache)     # works too
"""
from __future__ import annotations

from contextlib import contextmanager

import torch

from .attention import routed_attention
from .cache import CompressedKVCache, Observation


def valid_from_mask(mask: torch.Tensor | None, q_len: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(k_valid [B, kv], q_valid [B, q]) bool from a 4-D attention mask (bool or additive float), or Nones."""
    if mask is None or mask.dim() != 4:
        return None, None
    row = mask[:, 0, -1, :]                          # the last query is a real token (left padding)
    k_valid = row if row.dtype == torch.bool else row == 0
    if bool(k_valid.all()):
        return None, None
    return k_valid, k_valid[:, -q_len:]


@contextmanager
def capture(model, cache: CompressedKVCache):
    """Route ``model``'s post-RoPE prefill queries to ``cache`` for the duration of the block.

    Nested captures of different caches: the innermost runs first; an outer cache observes only its
    own pending layers (those whose prefill is in flight).
    """
    def make(inner):
        def capture_attention(module, query, key, value, attention_mask, **kwargs):
            """The attention in effect, then the post-RoPE queries [B, Hq, q, d] go to the cache."""
            out = inner(module, query, key, value, attention_mask, **kwargs)
            layer = cache.layers[module.layer_idx]
            if getattr(layer, "pending", False):
                q_len = query.shape[-2]
                seen = layer.get_seq_length()
                k_valid, q_valid = valid_from_mask(attention_mask, q_len)
                q_pos = torch.arange(seen - q_len, seen, device=query.device)
                scaling = kwargs.get("scaling") or getattr(module, "scaling", query.shape[-1] ** -0.5)
                cache.observe(module.layer_idx, Observation(query.detach(), float(scaling), q_pos, k_valid, q_valid))
            return out

        return capture_attention

    with routed_attention(model, make):
        yield cache


@torch.no_grad()
def capture_qkv(model, input_ids: torch.Tensor, layers: list[int] | None = None,
                attention_mask: torch.Tensor | None = None) -> dict[int, tuple[torch.Tensor, ...]]:
    """Post-RoPE (q, k, v) of a real forward, per layer: q [B, Hq, T, d], k / v [B, Hkv, T, d].

    The forward runs unchanged (the routed function delegates to the model's own attention);
    the tensors are the ones attention actually reads, cloned.
    """
    keep = None if layers is None else set(layers)
    out: dict[int, tuple[torch.Tensor, ...]] = {}

    def make(inner):
        def record(module, query, key, value, attention_mask, **kw):
            idx = module.layer_idx
            if keep is None or idx in keep:
                out[idx] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
            return inner(module, query, key, value, attention_mask, **kw)

        return record

    with routed_attention(model, make):
        model(input_ids, attention_mask=attention_mask, use_cache=False)
    return out
