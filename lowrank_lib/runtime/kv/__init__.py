"""KV storage behind the decode engine: the :class:`KVStore` protocol and the runtime's own stores.

``Engine(model, config, kv=store)``; without ``kv`` the engine builds ``make_store(config.kv)``:
:class:`DenseKV` (``"dense"``) or :class:`RebuildKV` (``"rebuild"``). Other packages plug their stores
in through this protocol (every KV method, through :class:`lowrank_lib.kv.engine_adapter.MethodStore`);
nothing in ``runtime/`` imports them.
"""
from ..backend import Backend, BackendCaps, select
from .base import (BackendChoice, CacheFullError, Cursor, KVSpec, KVStore, StepContext, additive_mask,
                   slot_mask)
from .dense import DenseKV, DenseStep
from .rebuild import RebuildKV

STORES = {"dense": DenseKV, "rebuild": RebuildKV}


def make_store(name: str) -> KVStore:
    """The runtime store named by ``EngineConfig.kv``."""
    if name not in STORES:
        raise ValueError(f"kv={name!r}: use one of {tuple(STORES)} or pass a KVStore as Engine(..., kv=store)")
    return STORES[name]()


__all__ = ["Backend", "BackendCaps", "BackendChoice", "CacheFullError", "Cursor", "DenseKV", "DenseStep", "KVSpec",
           "KVStore", "RebuildKV", "STORES", "StepContext", "additive_mask", "make_store", "select", "slot_mask"]
