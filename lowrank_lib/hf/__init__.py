"""transformers integration shared by the KV adapter and the evaluations.

- :mod:`.attention` is the ONE owner of transformers' attention registry (public API only);
- :mod:`.capture` records a forward's post-RoPE q/k/v.

The transformers ``Cache`` that serves every KV method is :class:`lowrank_lib.kv.hf_adapter.KVCache`.
"""
from .attention import attention_modules, current_attention, routed_attention
from .capture import capture_qkv

__all__ = ["attention_modules", "capture_qkv", "current_attention", "routed_attention"]
