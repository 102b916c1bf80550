"""Factor-space decode for the AttSVD cache inside transformers' ``generate``.

The AttSVD cache (:mod:`lowrank_lib.attsvd.cache`) rebuilds K/V from its ``LowRankKV`` in ``update``
and hands dense K/V to the model's attention function. Here a layer subclass hands the ``LowRankKV``
itself to attention (in both the key and the value slot: attention reads keys and values from it), and
an attention function routed by :func:`factor_space` reads it in factor space. Prefill is untouched
(exact K/V; the AttSVD capture still delivers the queries for the attention-aware basis).

    >>> cache = FactorSpaceAttSVDCache(model, AttSVDConfig(ratio=0.5, window=32))
    >>> with decode_route(model, cache, "factor"):       # or "rebuild": the paper's path, same cache
    ...     out = model.generate(ids, cache=cache, max_new_tokens=32)

``decode_route`` = the AttSVD query capture + :func:`factor_space` + the cache's route. Code that builds
caches itself (e.g. ``lowrank_lib.eval.kvquality.continuation_quality``) runs inside
``with factor_space(model):`` with ``FactorSpaceAttSVDCache(model, cfg, route="factor")`` caches. With
route "rebuild" the layers behave exactly like ``AttSVDLayer``. Memory accounting is the AttSVD cache's
own (``cache.memory()``): the same factors and exact rows are stored.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from ..hf.attention import routed_attention
from ..hf.capture import capture
from .cache import AttSVDCache, AttSVDLayer
from .factor_space import READS
from .kv import LowRankKV

#: decode routes of :func:`decode_route`: the cache's own rebuild, factor space, or the factors handed to
#: attention and rebuilt there (the reference inside the same plumbing)
DECODE_ROUTES = ("rebuild", "factor", "factor_rebuild")
LAYER_ROUTES = ("rebuild", "factor")


class FactorSpaceLayer(AttSVDLayer):
    """``AttSVDLayer`` that hands its ``LowRankKV`` to attention instead of rebuilding K/V.

    ``route``: "factor" (hand the factors over; read by the function :func:`factor_space` routes) or
    "rebuild" (exactly the parent's behaviour). Before compression (prefill) every route returns the
    exact K/V, and so does a layer with nothing factored yet.
    """

    def __init__(self, cfg, route: str = "factor", **kwargs):
        super().__init__(cfg, **kwargs)
        self.route = _check(route, LAYER_ROUTES)

    def read(self):
        if self.route == "factor" and self.kv.runs:
            return self.kv, self.kv
        return super().read()


class FactorSpaceAttSVDCache(AttSVDCache):
    """The AttSVD cache with :class:`FactorSpaceLayer` layers (same options, same stored bytes).

    Decoding with route "factor" needs the attention function of :func:`factor_space` (or
    :func:`decode_route`, which also enables the AttSVD query capture). ``route="factor_rebuild"`` is
    accepted as "factor" (the layers hand the factors over either way; the reading is the attention's).
    """

    def __init__(self, model_or_config, cfg, route: str = "factor"):
        super().__init__(model_or_config, cfg)
        self.layers = [FactorSpaceLayer(cfg, _layer_route(route)) for _ in self.layers]

    @property
    def route(self) -> str:
        return self.layers[0].route

    @route.setter
    def route(self, route: str) -> None:
        for layer in self.layers:
            layer.route = _layer_route(route)


def _check(route: str, allowed: tuple) -> str:
    if route not in allowed:
        raise ValueError(f"route must be one of {allowed}, got {route!r}")
    return route


def _layer_route(route: str) -> str:
    return "rebuild" if _check(route, DECODE_ROUTES) == "rebuild" else "factor"


def _causal_mask(q_len: int, n: int, device) -> torch.Tensor:
    """Bottom-right aligned causal keep-mask [1, 1, q_len, n] (the newest q_len keys are the queries)."""
    return torch.ones(q_len, n, dtype=torch.bool, device=device).tril(n - q_len)[None, None]


@dataclass
class RouteStats:
    """Which path each attention call took inside :func:`factor_space` (one count per layer call)."""

    factor_calls: int = 0           # read a LowRankKV in factor space
    factor_rebuild_calls: int = 0   # read a LowRankKV by rebuild_then_attend
    dense_calls: int = 0            # dense K/V (prefill, uncompressed layers): the attention in effect


def _make_attention(inner, stats: RouteStats, read: str):
    fn = READS[read]

    def factor_space_attention_fn(module, query, key, value, attention_mask, scaling=None, **kwargs):
        """query [B, Hq, q, d]; key a LowRankKV (value: the same) or dense K -> ([B, q, Hq, d], None)."""
        if not isinstance(key, LowRankKV):
            stats.dense_calls += 1
            return inner(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if read == "factor":
            stats.factor_calls += 1
        else:
            stats.factor_rebuild_calls += 1
        mask = attention_mask
        if mask is None and query.shape[-2] > 1:
            mask = _causal_mask(query.shape[-2], key.length, query.device)
        elif mask is not None and mask.shape[-1] != key.length:
            raise ValueError(f"factor-space attention (layer {module.layer_idx}): mask covers {mask.shape[-1]} "
                             f"positions, the cache holds {key.length}")
        out = fn(query, key, mask, scaling)
        return out.transpose(1, 2).contiguous(), None

    return factor_space_attention_fn


@contextmanager
def factor_space(model, read: str = "factor"):
    """Inside the block, attention reads a FactorSpaceLayer's factors; yields :class:`RouteStats`.

    read : "factor" (factor space) or "rebuild" (rebuild the factors handed over, then dense attention).
    Routes ``model``'s attention (:func:`~lowrank_lib.hf.attention.routed_attention`) through a function
    that delegates every dense call to the attention in effect (sdpa, eager, or the AttSVD capture when
    entered inside :func:`~lowrank_lib.hf.capture.capture`). Restored on exit.
    """
    stats = RouteStats()
    _check(read, tuple(READS))
    with routed_attention(model, lambda inner: _make_attention(inner, stats, read)):
        yield stats


@contextmanager
def decode_route(model, cache: AttSVDCache, route: str = "factor"):
    """Run ``model`` with ``cache`` decoding by ``route`` inside the block; yields :class:`RouteStats`.

    route : "rebuild" (the AttSVD cache's own path: rebuild K/V, then the model's attention; works
        with a plain ``AttSVDCache``), "factor" or "factor_rebuild" (need a FactorSpaceAttSVDCache).
    The AttSVD query capture is active for every route (attention-aware basis at prefill). On exit
    the model's attention and the cache's route are restored.
    """
    _check(route, DECODE_ROUTES)
    is_fs = isinstance(cache, FactorSpaceAttSVDCache)
    if route != "rebuild" and not is_fs:
        raise TypeError(f"route {route!r} needs a FactorSpaceAttSVDCache (FactorSpaceLayer layers), "
                        f"got {type(cache).__name__} with {type(cache.layers[0]).__name__} layers")
    old = cache.route if is_fs else None
    with ExitStack() as stack:
        stack.enter_context(capture(model, cache))
        if route == "rebuild":
            stats = RouteStats()
        else:
            stats = stack.enter_context(factor_space(model, "factor" if route == "factor" else "rebuild"))
        if is_fs:
            cache.route = route
        try:
            yield stats
        finally:
            if is_fs:
                cache.route = old


__all__ = ["DECODE_ROUTES", "FactorSpaceAttSVDCache", "FactorSpaceLayer", "RouteStats", "decode_route",
           "factor_space"]
