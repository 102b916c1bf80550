"""transformers integration shared by the KV caches (AttSVD, eviction) and evaluation.

- :mod:`.attention` is the ONE owner of transformers' attention registry (public API only).
- :mod:`.capture` hands a prefill's post-RoPE queries to a cache (``capture``) or records q/k/v.
- :mod:`.cache` the compress-once-after-prefill ``Cache`` layer and cache, the capture record.
- :mod:`.record` one recorded prefill replayed into many caches.
"""
from .attention import attention_modules, current_attention, routed_attention
from .cache import CompressedKVCache, MemoryReport, Observation, PrefillCompressedLayer
from .capture import capture, capture_qkv
from .record import PrefillRecord, dense_from, record_prefill, replay

__all__ = ["CompressedKVCache", "MemoryReport", "Observation", "PrefillCompressedLayer", "PrefillRecord",
           "attention_modules", "capture", "capture_qkv", "current_attention", "dense_from", "record_prefill",
           "replay", "routed_attention"]
