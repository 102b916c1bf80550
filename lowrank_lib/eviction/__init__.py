"""Eviction baselines at matched memory, kvpress style: one small dataclass per policy (one file each),
``score(K, V, obs) -> [B, H, S]`` (higher = keep), and one cache that evicts after prefill.

    >>> from lowrank_lib.eviction import POLICIES, EvictionBudget, EvictionCache
    >>> cache = EvictionCache(model, POLICIES["snapkv"](), EvictionBudget(tokens=512, window=32))

``POLICIES`` is the registry every test and benchmark iterates: a new policy is one file and one entry.
"""
from .cache import EvictionBudget, EvictionCache, EvictionLayer
from .expected import ExpectedAttention
from .h2o import H2O
from .keydiff import KeyDiff
from .kvzip import KVzip
from .observed import ObservedAttention
from .snapkv import SnapKV
from .streamingllm import StreamingLLM

#: policies that score one layer's (K, V, queries) after its prefill: they run in ``EvictionCache`` (and rank
#: tokens for the ragged / composed cache, :mod:`lowrank_lib.composed`)
POLICIES = {"streamingllm": StreamingLLM, "h2o": H2O, "snapkv": SnapKV, "keydiff": KeyDiff,
            "h2o_norm": ObservedAttention, "expected_attention": ExpectedAttention}
#: every scorer: POLICIES + the model-scope ones (KVzip needs a second forward of the model, so it scores a
#: recorded prefill through ``lowrank_lib.composed.importance``, not inside a cache layer)
SCORERS = {**POLICIES, "kvzip": KVzip}

__all__ = ["EvictionBudget", "EvictionCache", "EvictionLayer", "ExpectedAttention", "H2O", "KVzip", "KeyDiff",
           "ObservedAttention", "POLICIES", "SCORERS", "SnapKV", "StreamingLLM"]
