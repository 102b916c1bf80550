"""KV methods: one dataclass per method (options + math), ONE registry, ONE tiered state, TWO adapters.

    >>> from lowrank_lib.kv import make_method, KVCache, MethodStore
    >>> method = make_method("composed-kvzip-q8", budget=0.25)     # 25 % of the dense KV bytes really held
    >>> cache = KVCache(method, model, tok)                        # transformers: a Cache for generate()
    >>> with cache.serving(model):
    ...     out = model.generate(ids, **cache_kw(cache), max_new_tokens=32)
    >>> eng = Engine(model, EngineConfig(max_seq_len=4096), kv=MethodStore(method, tok))   # the fast engine

- :mod:`.method`: :class:`Prefill` (what a method fits from) and :class:`KVMethod` (what every method declares);
- :mod:`.tiers`: :class:`TieredLayer`, the state every method fits (exact rows, low-rank runs, appended rows),
  and the ONE tiered attention (portable path + fused kernel backends);
- :mod:`.methods`: dense, AttSVD (accumulate / stream, raw-K/V SVD, extensions), eviction, composed;
- :mod:`.registry`: ``METHODS`` and :func:`make_method`;
- :mod:`.hf_adapter`: :class:`KVCache` (transformers ``Cache``), :func:`record` (a recorded prefill);
- :mod:`.engine_adapter`: :class:`MethodStore` (the engine's ``KVStore``).
"""
from importlib import import_module

# Names are imported on first use (PEP 562): importing one module of the package (``kv.tiers``, say) does not import
# every method, scorer and adapter with it.
_EXPORTS = {"KVMethod": "method", "Prefill": "method", "RowFit": "method", "Run": "tiers", "Segment": "tiers",
            "TieredLayer": "tiers", "EVICTION_MODES": "registry", "EXT_OBS_WINDOW": "registry", "METHODS": "registry",
            "make_method": "registry", "method_kind": "registry", "KVCache": "hf_adapter", "record": "hf_adapter",
            "MethodStore": "engine_adapter"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
