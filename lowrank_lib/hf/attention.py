"""The ONE owner of transformers' attention registry: route one model's attention calls, reversibly.

A transformers attention module looks its function up by name, ``config._attn_implementation``, in
the process-wide ``ALL_ATTENTION_FUNCTIONS`` mapping, and the mask is built by the mask function
registered under the same name. :func:`routed_attention` overrides THAT name in that mapping for the
duration of a ``with`` block through the mapping's public ``MutableMapping`` interface
(``__setitem__`` / ``__delitem__``: transformers' documented local override of an existing function).
So:

- the model keeps its implementation name and its own mask function (sdpa's boolean mask, eager's
  additive one): nothing is registered under a new name, no mask function is needed, and
  neither ``AttentionInterface``'s nor ``AttentionMaskInterface``'s global mapping is touched;
- the override dispatches by attention module: modules of ``model`` call the routed function, every
  other module in the process calls the function that was in effect before (unchanged behaviour);
- on exit the previous entry is restored (or removed when there was none), also when the block raises.

Overrides nest (capture + factor-space attention, say): each one receives the function in effect when
it was entered as ``inner`` and delegates to it. Exit them in reverse order of entry (``with`` does).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterator

from torch import nn
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

AttentionFn = Callable[..., tuple]


def attention_modules(model) -> list[nn.Module]:
    """The attention modules of ``model`` (those with ``q_proj`` and ``layer_idx``)."""
    mods = [m for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "q_proj")]
    if not mods:
        raise ValueError(f"no attention modules (with q_proj and layer_idx) found in {type(model).__name__}")
    return mods


def implementation(model) -> str:
    """The attention implementation ``model`` runs (``sdpa`` when unset); refused when it has no mask function."""
    name = model.config._attn_implementation or "sdpa"
    if name not in ALL_MASK_ATTENTION_FUNCTIONS:
        raise ValueError(f"attention implementation {name!r} of {type(model).__name__} has no mask function in "
                         f"transformers' AttentionMaskInterface; use 'sdpa' or 'eager'")
    return name


def _own_eager(module) -> AttentionFn:
    """The eager attention function of the modeling file that defines ``module``."""
    fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if fn is None:
        raise ValueError(f"no eager_attention_forward next to {type(module).__name__}")
    return fn


def current_attention(model) -> AttentionFn:
    """The function ``model``'s attention modules call now (an outer override included), as
    ``fn(module, query, key, value, attention_mask, **kwargs) -> (out [B, q, Hq, d], weights)``."""
    name = implementation(model)
    fn = ALL_ATTENTION_FUNCTIONS.get(name)
    return fn if fn is not None else _own_eager(attention_modules(model)[0])


@contextmanager
def routed_attention(model, make: Callable[[AttentionFn], AttentionFn]) -> Iterator[str]:
    """Inside the block, ``model``'s attention calls go to ``make(inner)``; yields the overridden name.

    ``inner`` is the function that was in effect (the model's sdpa / eager attention, or an outer
    override): the routed function usually runs it and adds something (capture), or handles some calls
    itself and delegates the rest (factor-space attention). Other models are unaffected.
    """
    name = implementation(model)
    inner = current_attention(model)
    fn = make(inner)
    ours = {id(m) for m in attention_modules(model)}
    before = ALL_ATTENTION_FUNCTIONS.get(name)         # the entry in effect: a local override or the global one
    had_local = before is not None and before is not AttentionInterface().get(name)   # a fresh instance sees globals only

    def dispatch(module, *args, **kwargs):
        if id(module) in ours:
            return fn(module, *args, **kwargs)
        return (before or _own_eager(module))(module, *args, **kwargs)

    ALL_ATTENTION_FUNCTIONS[name] = dispatch
    try:
        yield name
    finally:
        if had_local:
            ALL_ATTENTION_FUNCTIONS[name] = before
        else:
            del ALL_ATTENTION_FUNCTIONS[name]
