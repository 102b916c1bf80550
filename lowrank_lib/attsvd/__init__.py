"""AttSVD: a per-prompt, attention-aware low-rank KV cache. The algorithm (Algorithm 2,
:func:`compress_prefill` -> the one low-rank KV type :class:`LowRankKV`), its rank rules, its caches
(transformers ``Cache``: rebuild or factor-space decode; the runtime engine's :class:`AttSVDStore`),
factor-space attention and per-head interpretability.

    >>> from lowrank_lib.attsvd import AttSVDCache, AttSVDConfig
    >>> from lowrank_lib.hf import capture
    >>> cache = AttSVDCache(model, AttSVDConfig(ratio=0.5, window=32, mode="accumulate"))
    >>> with capture(model, cache):
    ...     out = model.generate(ids, cache=cache, max_new_tokens=32)
    >>> cache.memory().ratio
"""
from .basis import attention_svd, compress_prefill, logit_error, output_error
from .cache import AttSVDCache, AttSVDLayer
from .config import AttSVDConfig
from .factor_space import factor_space_attention, rebuild_then_attend
from .kv import LowRankKV, Spectra

__all__ = ["AttSVDCache", "AttSVDConfig", "AttSVDLayer", "LowRankKV", "Spectra", "attention_svd", "compress_prefill",
           "factor_space_attention", "logit_error", "output_error", "rebuild_then_attend"]
