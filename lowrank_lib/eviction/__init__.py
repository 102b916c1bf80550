"""Eviction baselines at matched memory, kvpress style: one small dataclass per policy (one file each),
``score(K, V, obs) -> [B, H, S]`` (higher = keep), and one cache that evicts after prefill.

    >>> from lowrank_lib.eviction import POLICIES, EvictionBudget, EvictionCache
    >>> cache = EvictionCache(model, POLICIES["snapkv"](), EvictionBudget(tokens=512, window=32))

``POLICIES`` is the registry every test and benchmark iterates: a new policy is one file and one entry.
"""
from .cache import EvictionBudget, EvictionCache, EvictionLayer
from .h2o import H2O
from .keydiff import KeyDiff
from .snapkv import SnapKV
from .streamingllm import StreamingLLM

POLICIES = {"streamingllm": StreamingLLM, "h2o": H2O, "snapkv": SnapKV, "keydiff": KeyDiff}

__all__ = ["EvictionBudget", "EvictionCache", "EvictionLayer", "H2O", "KeyDiff", "POLICIES", "SnapKV",
           "StreamingLLM"]
