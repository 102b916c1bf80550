"""Eviction scorers, kvpress style: one small dataclass per policy (one file each) on the :class:`Scorer` base,
which declares what the policy needs (queries, RoPE, layer or model scope, a forced recent window);
``score(K, V, obs) -> [B, H, S]`` (higher = keep), or ``score_prefill(prefill)`` for model scope (KVzip).
``budget.py`` turns a byte budget into kept tokens per (layer, row, head).

    >>> from lowrank_lib.kv import make_method
    >>> method = make_method("snapkv", budget=0.25)        # the eviction method: kept rows + positions, ragged

``SCORERS`` is the registry every KV method, test and benchmark reads: a new policy is one file and one entry.
"""
from .base import ContextScores, Observation, Scorer
from .expected import ExpectedAttention, model_rope
from .h2o import H2O
from .keydiff import KeyDiff
from .kvzip import KVzip
from .observed import ObservedAttention
from .snapkv import SnapKV
from .streamingllm import StreamingLLM

#: every scorer by name (layer scope, and the model-scope KVzip, which runs a reconstruction forward)
SCORERS: dict[str, type[Scorer]] = {"streamingllm": StreamingLLM, "h2o": H2O, "snapkv": SnapKV, "keydiff": KeyDiff,
                                    "h2o_norm": ObservedAttention, "expected_attention": ExpectedAttention,
                                    "kvzip": KVzip}

__all__ = ["ContextScores", "ExpectedAttention", "H2O", "KVzip", "KeyDiff", "Observation", "ObservedAttention",
           "SCORERS", "Scorer", "SnapKV", "StreamingLLM", "model_rope"]
