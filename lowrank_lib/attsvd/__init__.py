"""AttSVD: a per-prompt, attention-aware low-rank KV cache. The algorithm (Algorithm 2,
:func:`compress_prefill` -> the low-rank type :class:`LowRankKV`), its rank rules, factor-space attention on that
type, and per-head interpretability. The KV method built on it is :class:`lowrank_lib.kv.methods.attsvd.AttSVD`
(registry names ``attsvd``, ``attsvd-stream``, ``svd``, ``attsvd-km``, ``attsvd-ext``), served by both adapters:

    >>> from lowrank_lib.kv import make_method, KVCache
    >>> cache = KVCache(make_method("attsvd", budget=0.5), model)
    >>> with cache.serving(model):
    ...     out = model.generate(ids, **cache_kw(cache), max_new_tokens=32)
    >>> cache.describe()["bytes_ratio"], cache.describe()["r_over_d"]
"""
from .basis import attention_svd, compress_prefill, logit_error, output_error
from .config import AttSVDConfig
from .factor_space import dense_attention, factor_space_attention, rebuild_then_attend
from .kv import LowRankKV, Spectra

__all__ = ["AttSVDConfig", "LowRankKV", "Spectra", "attention_svd", "compress_prefill", "dense_attention",
           "factor_space_attention", "logit_error", "output_error", "rebuild_then_attend"]
