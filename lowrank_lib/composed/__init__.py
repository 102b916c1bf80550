"""The composed KV cache's math: per (layer, KV head) the most important tokens exact, a middle tier in AttSVD's
attention-aware low-rank basis, the rest dropped, at a byte budget allocated across layers and heads.

- :mod:`.plan` the allocation (which tier every token goes to) at a byte budget;
- :mod:`.build` scoring (any eviction scorer, KVzip by default) + the AttSVD fit of the low-rank tier, as the
  :class:`~lowrank_lib.kv.tiers.Segment` of every head.

The methods built on it (``composed-*`` and every eviction policy, which is the same allocation with no low-rank
tier) are :class:`lowrank_lib.kv.methods.composed.Composed` / ``Eviction``; they are served by the two generic
adapters of :mod:`lowrank_lib.kv` like every other KV method.
"""
from .build import DEFAULT_WINDOW, Importance, importance, prefill_stats, segments
from .plan import HeadPlan, TierBytes, allocate, plan_bytes

__all__ = ["DEFAULT_WINDOW", "HeadPlan", "Importance", "TierBytes", "allocate", "importance", "plan_bytes",
           "prefill_stats", "segments"]
