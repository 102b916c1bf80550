"""Post-RoPE q/k/v of a real forward, through :func:`~lowrank_lib.hf.attention.routed_attention`.

``LlamaAttention.forward`` applies RoPE, calls the cache and only then the attention function, so the tensors
attention really reads are seen only there: :func:`capture_qkv` routes the model's attention through a function
that clones them and delegates to the attention in effect (the forward is unchanged). The KV adapters capture
their prefill queries the same way (:mod:`lowrank_lib.kv.hf_adapter`).
"""
from __future__ import annotations

import torch

from .attention import routed_attention


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
