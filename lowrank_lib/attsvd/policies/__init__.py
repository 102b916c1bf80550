"""Eviction baselines at matched memory: one small dataclass per policy (``score(K, V, obs)``)."""
from .base import EvictionBudget, EvictionCache, EvictionLayer
from .h2o import H2O
from .keydiff import KeyDiff
from .snapkv import SnapKV
from .streamingllm import StreamingLLM

POLICIES = {"streamingllm": StreamingLLM, "h2o": H2O, "snapkv": SnapKV, "keydiff": KeyDiff}

__all__ = ["EvictionBudget", "EvictionCache", "EvictionLayer", "H2O", "KeyDiff", "SnapKV", "StreamingLLM",
           "POLICIES"]
