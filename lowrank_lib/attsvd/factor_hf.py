"""transformers plumbing for factor-space attention: explicit, reversible attention registration.

transformers calls ``cache.update(k, v, layer_idx)`` and THEN the attention function named by
``config._attn_implementation`` (see prior-art.md). A cache never sees the queries, so attention
that reads factors must be an attention function. Everything here registers a function (and its
mask function, otherwise transformers silently drops the mask) under a name, switches the model
to it inside a ``with`` block, and restores the model and the registries on exit.
"""
from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

_names = itertools.count()


def _registries():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    return AttentionInterface, AttentionMaskInterface, ALL_ATTENTION_FUNCTIONS, ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask


def base_attention(model) -> tuple[str, Callable]:
    """(name, function) of the attention the model runs now; "eager" maps to transformers' eager."""
    _, _, fns, _, _ = _registries()
    name = model.config._attn_implementation or "sdpa"
    if name == "eager":
        import importlib

        mod = importlib.import_module(type(model).__module__)
        return name, mod.eager_attention_forward
    return name, fns[name]


@contextmanager
def registered_attention(model, fn: Callable, mask_fn: Callable | None = None,
                         prefix: str = "lowrank") -> Iterator[str]:
    """Run ``model`` with attention function ``fn`` inside the block; yields the registered name.

    ``fn(module, query, key, value, attention_mask, scaling=..., dropout=..., **kw) -> (out, weights)``
    with transformers' layout: query [B, Hq, q, d] post-RoPE, key/value as the cache returned them,
    out [B, q, Hq, d]. ``mask_fn`` defaults to the mask function of the model's current attention
    (sdpa's boolean mask for sdpa). On exit the model's implementation and both registries are
    restored, also when the block raises.
    """
    attn_if, mask_if, _, masks, sdpa_mask = _registries()
    old = model.config._attn_implementation or "sdpa"
    name = f"{prefix}_{next(_names)}"
    mask_fn = mask_fn if mask_fn is not None else masks.get(old, sdpa_mask) if old != "eager" else masks["eager"]
    attn_if.register(name, fn)
    mask_if.register(name, mask_fn)
    try:
        model.set_attn_implementation(name)
        yield name
    finally:
        model.set_attn_implementation(old)
        attn_if._global_mapping.pop(name, None)
        mask_if._global_mapping.pop(name, None)


@torch.no_grad()
def capture_qkv(model, input_ids: torch.Tensor, layers: list[int] | None = None,
                attention_mask: torch.Tensor | None = None) -> dict[int, tuple[torch.Tensor, ...]]:
    """Post-RoPE (q, k, v) of a real forward, per layer: q [B, Hq, T, d], k / v [B, Hkv, T, d].

    The forward runs unchanged (the captured function delegates to the model's own attention);
    the tensors are the ones attention actually reads, cloned.
    """
    _, inner = base_attention(model)
    keep = None if layers is None else set(layers)
    out: dict[int, tuple[torch.Tensor, ...]] = {}

    def fn(module, query, key, value, attention_mask, **kw):
        idx = module.layer_idx
        if keep is None or idx in keep:
            out[idx] = (query.detach().clone(), key.detach().clone(), value.detach().clone())
        return inner(module, query, key, value, attention_mask, **kw)

    with registered_attention(model, fn, prefix="lowrank_capture"):
        model(input_ids, attention_mask=attention_mask, use_cache=False)
    return out
