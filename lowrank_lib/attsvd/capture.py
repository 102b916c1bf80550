"""Post-RoPE queries for the cache: a registered attention function + its mask function.

``LlamaAttention.forward`` applies RoPE, calls ``cache.update`` and only then the attention function, so a
cache never sees the queries. :func:`capture` registers (explicitly, and removes on exit) an attention
function that runs the model's own attention implementation and then hands the queries of a pending
prefill to the cache layer (``CompressedKVCache.observe``), and registers the matching mask function
under the same name (without it transformers silently drops the mask: wrong outputs with left padding).

    >>> with capture(model, cache):
    ...     model(ids, past_key_values=cache)            # prefill: exact, then factorized with Q
    ...     model.generate(ids, past_key_values=cache)   # works too
"""
from __future__ import annotations

import sys
from contextlib import contextmanager

import torch
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from .cache import CompressedKVCache, Observation

PREFIX = "attsvd_capture_"
# id(attention module) -> the cache whose layers receive that module's queries (filled only inside capture())
_ROUTES: dict[int, CompressedKVCache] = {}
_REFCOUNT: dict[str, int] = {}


def _valid_from_mask(mask: torch.Tensor | None, q_len: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(k_valid [B, kv], q_valid [B, q]) bool from a 4-D attention mask (bool or additive float), or Nones."""
    if mask is None or mask.dim() != 4:
        return None, None
    row = mask[:, 0, -1, :]                          # the last query is a real token (left padding)
    k_valid = row if row.dtype == torch.bool else row == 0
    if bool(k_valid.all()):
        return None, None
    return k_valid, k_valid[:, -q_len:]


def _inner_attention(base: str, module):
    """The attention function ``base`` names: the registry's, or the model file's own eager function."""
    if base in ALL_ATTENTION_FUNCTIONS:
        return ALL_ATTENTION_FUNCTIONS[base]
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"capture: no attention function {base!r} for {type(module).__name__}")
    return fn


def _make_attention(base: str):
    def attsvd_capture_attention(module, query, key, value, attention_mask, **kwargs):
        """The model's own ``base`` attention, then the post-RoPE queries [B, Hq, q, d] go to the cache."""
        out = _inner_attention(base, module)(module, query, key, value, attention_mask, **kwargs)
        cache = _ROUTES.get(id(module))
        if cache is not None:
            layer = cache.layers[module.layer_idx]
            if getattr(layer, "pending", False):
                q_len = query.shape[-2]
                seen = layer.get_seq_length()
                k_valid, q_valid = _valid_from_mask(attention_mask, q_len)
                q_pos = torch.arange(seen - q_len, seen, device=query.device)
                scaling = kwargs.get("scaling") or getattr(module, "scaling", query.shape[-1] ** -0.5)
                cache.observe(module.layer_idx, Observation(query.detach(), float(scaling), q_pos,
                                                            k_valid, q_valid))
        return out

    return attsvd_capture_attention


def _attention_modules(model) -> list[torch.nn.Module]:
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    if not mods:
        raise ValueError(f"capture: no attention modules (with q_proj and layer_idx) found in {type(model).__name__}")
    return mods


@contextmanager
def capture(model, cache: CompressedKVCache):
    """Route ``model``'s post-RoPE prefill queries to ``cache`` for the duration of the block.

    Registers ``attsvd_capture_<base>`` in ``AttentionInterface`` and ``AttentionMaskInterface`` (base = the
    model's current implementation: sdpa or eager), switches the model to it, and restores both on exit.
    """
    cfg = model.config
    base = cfg._attn_implementation or "sdpa"
    if base.startswith(PREFIX):           # nested: reuse the outer registration, route to this cache
        name, base = base, base[len(PREFIX):]
    else:
        name = PREFIX + base
    if base not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"capture: attention implementation {base!r} has no mask function; use 'sdpa' or 'eager'")
    if _REFCOUNT.get(name, 0) == 0:
        AttentionInterface.register(name, _make_attention(base))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])
    _REFCOUNT[name] = _REFCOUNT.get(name, 0) + 1
    mods = _attention_modules(model)
    previous = {id(m): _ROUTES.get(id(m)) for m in mods}
    for m in mods:
        _ROUTES[id(m)] = cache
    old_impl = cfg._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield cache
    finally:
        model.set_attn_implementation(old_impl)
        for m in mods:
            if previous[id(m)] is None:
                _ROUTES.pop(id(m), None)
            else:
                _ROUTES[id(m)] = previous[id(m)]
        _REFCOUNT[name] -= 1
        if _REFCOUNT[name] == 0:
            AttentionInterface._global_mapping.pop(name, None)
            AttentionMaskInterface._global_mapping.pop(name, None)
