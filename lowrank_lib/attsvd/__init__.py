"""AttSVD: a per-prompt, attention-aware low-rank KV cache (transformers ``Cache``), its rank rules,
eviction baselines at matched memory, and per-head interpretability.

    >>> from lowrank_lib.attsvd import AttSVDCache, AttSVDConfig, capture
    >>> cache = AttSVDCache(model, AttSVDConfig(ratio=0.5, window=32, mode="accumulate"))
    >>> with capture(model, cache):
    ...     out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
    >>> cache.memory().ratio
"""
from .basis import Factors, attention_svd, logit_error, output_error
from .cache import AttSVDCache, AttSVDLayer, CompressedKVCache, MemoryReport, Observation, rebuild_kv
from .capture import capture
from .config import AttSVDConfig
from .methods import METHODS, MethodSpec, attsvd_stored_tokens
from .policies import H2O, EvictionBudget, EvictionCache, KeyDiff, SnapKV, StreamingLLM

__all__ = ["AttSVDCache", "AttSVDConfig", "AttSVDLayer", "CompressedKVCache", "EvictionBudget", "EvictionCache",
           "Factors", "H2O", "KeyDiff", "METHODS", "MemoryReport", "MethodSpec", "Observation", "SnapKV",
           "StreamingLLM", "attention_svd", "attsvd_stored_tokens", "capture", "logit_error", "output_error",
           "rebuild_kv"]
