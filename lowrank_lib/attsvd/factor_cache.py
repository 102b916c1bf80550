"""Factor-space decode for the AttSVD cache inside transformers' ``generate``.

The AttSVD cache (:mod:`lowrank_lib.attsvd.cache`) rebuilds ``[A_K B_K; blocks; exact]`` in
``update`` and hands dense K/V to the model's attention function. Here a layer subclass returns,
while the factor route is switched on, a :class:`~lowrank_lib.attsvd.factor_space.FactorKV` view of
its stored parts instead, and a registered attention function reads it in factor space. Prefill is
untouched (exact K/V, the AttSVD capture still delivers the queries for the attention-aware basis).

    >>> cache = FactorSpaceAttSVDCache(model, AttSVDConfig(ratio=0.5, window=32))
    >>> with decode_route(model, cache, "factor"):       # or "rebuild": the paper's path, same cache
    ...     out = model.generate(ids, past_key_values=cache, max_new_tokens=32)

``decode_route`` = the AttSVD query capture + :func:`factor_space` (the registered attention
function, explicit and undone on exit) + the cache's route. Code that builds caches itself (e.g.
``lowrank_lib.eval.kvquality.continuation_quality``) runs inside ``with factor_space(model):`` with
``FactorSpaceAttSVDCache(model, cfg, route="factor")`` caches. With route "rebuild" the layers behave
exactly like ``AttSVDLayer``. Memory accounting is the AttSVD cache's own (``cache.memory()``): the
same factors and exact parts are stored.
"""
from __future__ import annotations

from contextlib import ExitStack, contextmanager
from dataclasses import dataclass

import torch

from .cache import AttSVDCache, AttSVDLayer
from .capture import capture
from .factor_hf import base_attention, registered_attention
from .factor_space import FactorKV, LowRankKV, factor_space_attention, rebuild_then_attend

DECODE_ROUTES = ("rebuild", "factor", "factor_rebuild")


def factor_kv(layer) -> FactorKV:
    """The parts an AttSVD layer attends to, as a ``FactorKV`` (no copies).

    Reads the layer's public state: ``bulk_k`` / ``bulk_v`` (``Factors`` with ``A`` [B, H, S_b, r],
    ``B`` [B, H, r, d], or None), ``blocks`` (list of (Factors, Factors), oldest first) and the exact
    ``keys`` / ``values`` [B, H, n, d]; position order bulk, blocks, exact.
    """
    segs = []
    if getattr(layer, "bulk_k", None) is not None:
        segs.append(LowRankKV(layer.bulk_k.A, layer.bulk_k.B, layer.bulk_v.A, layer.bulk_v.B))
    for fk, fv in getattr(layer, "blocks", []):
        segs.append(LowRankKV(fk.A, fk.B, fv.A, fv.B))
    return FactorKV(segs, layer.keys, layer.values)


class FactorSpaceLayer(AttSVDLayer):
    """``AttSVDLayer`` that hands its factors to attention instead of rebuilding K/V.

    ``route``: "factor" (factor-space attention), "factor_rebuild" (the same hand-over, then
    :func:`rebuild_then_attend`: the reference inside the same plumbing) or "rebuild" (exactly the
    parent's behaviour). Before compression (prefill) every route returns the exact K/V.
    """

    def __init__(self, cfg, route: str = "factor", **kwargs):
        super().__init__(cfg, **kwargs)
        self.route = _check_route(route)

    def _full(self):
        if self.route != "rebuild" and (self.bulk_k is not None or self.blocks):
            return factor_kv(self), self.route    # the value slot names the route for the attention function
        return super()._full()


class FactorSpaceAttSVDCache(AttSVDCache):
    """The AttSVD cache with :class:`FactorSpaceLayer` layers (same options, same stored bytes).

    Decoding with route "factor" / "factor_rebuild" needs the attention function of
    :func:`factor_space` (or :func:`decode_route`, which also enables the AttSVD query capture).
    """

    def __init__(self, model_or_config, cfg, route: str = "factor"):
        super().__init__(model_or_config, cfg)
        self.layers = [FactorSpaceLayer(cfg, route) for _ in self.layers]

    @property
    def route(self) -> str:
        return self.layers[0].route

    @route.setter
    def route(self, route: str) -> None:
        _check_route(route)
        for layer in self.layers:
            layer.route = route


def _check_route(route: str) -> str:
    if route not in DECODE_ROUTES:
        raise ValueError(f"route must be one of {DECODE_ROUTES}, got {route!r}")
    return route


def _causal_mask(q_len: int, n: int, device) -> torch.Tensor:
    """Bottom-right aligned causal keep-mask [1, 1, q_len, n] (the newest q_len keys are the queries)."""
    return torch.ones(q_len, n, dtype=torch.bool, device=device).tril(n - q_len)[None, None]


@dataclass
class RouteStats:
    """Which path each attention call took inside :func:`factor_space` (one count per layer call)."""

    factor_calls: int = 0           # read a FactorKV in factor space
    factor_rebuild_calls: int = 0   # read a FactorKV by rebuild_then_attend
    dense_calls: int = 0            # dense K/V (prefill, uncompressed layers): the model's own attention


def _make_attention(inner, stats: RouteStats):
    def factor_space_decode(module, query, key, value, attention_mask, scaling=None, **kwargs):
        """query [B, Hq, q, d]; key a FactorKV (value = its route) or dense K -> ([B, q, Hq, d], None)."""
        if not isinstance(key, FactorKV):
            stats.dense_calls += 1
            return inner(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        if value == "factor":
            stats.factor_calls += 1
            read = factor_space_attention
        else:
            stats.factor_rebuild_calls += 1
            read = rebuild_then_attend
        mask = attention_mask
        if mask is None and query.shape[-2] > 1:
            mask = _causal_mask(query.shape[-2], key.length, query.device)
        elif mask is not None and mask.shape[-1] != key.length:
            raise ValueError(f"factor-space attention (layer {module.layer_idx}): mask covers {mask.shape[-1]} "
                             f"positions, the cache holds {key.length}")
        out = read(query, key, mask, scaling)
        return out.transpose(1, 2).contiguous(), None

    return factor_space_decode


@contextmanager
def factor_space(model):
    """Inside the block, attention reads a FactorSpaceLayer's factors directly; yields :class:`RouteStats`.

    Registers one attention function (and the current mask function under the same name) that
    delegates every dense call to the model's current attention (sdpa, eager, or the AttSVD capture
    when entered inside :func:`~lowrank_lib.attsvd.capture.capture`). Restored on exit.
    """
    stats = RouteStats()
    _, inner = base_attention(model)
    with registered_attention(model, _make_attention(inner, stats), prefix="attsvd_factor"):
        yield stats


@contextmanager
def decode_route(model, cache: AttSVDCache, route: str = "factor"):
    """Run ``model`` with ``cache`` decoding by ``route`` inside the block; yields :class:`RouteStats`.

    route : "rebuild" (the AttSVD cache's own path: rebuild K/V, then the model's attention; works
        with a plain ``AttSVDCache``), "factor" or "factor_rebuild" (need a FactorSpaceAttSVDCache).
    The AttSVD query capture is active for every route (attention-aware basis at prefill). On exit
    the model's attention implementation, the registries and the cache's route are restored.
    """
    _check_route(route)
    is_fs = isinstance(cache, FactorSpaceAttSVDCache)
    if route != "rebuild" and not is_fs:
        raise TypeError(f"route {route!r} needs a FactorSpaceAttSVDCache (FactorSpaceLayer layers), "
                        f"got {type(cache).__name__} with {type(cache.layers[0]).__name__} layers")
    old = cache.route if is_fs else None
    with ExitStack() as stack:
        stack.enter_context(capture(model, cache))
        stats = stack.enter_context(factor_space(model)) if route != "rebuild" else RouteStats()
        if is_fs:
            cache.route = route
        try:
            yield stats
        finally:
            if is_fs:
                cache.route = old
