"""The composed KV cache: per (layer, KV head) the most important tokens exact, a middle tier in AttSVD's
attention-aware low-rank basis, the rest dropped, at a byte budget allocated across layers and heads.

- :mod:`.kv` the ragged tiers of one layer (``HeadTiers``) and their factor-space decode attention;
- :mod:`.plan` the allocation (which tier every token goes to) at a byte budget;
- :mod:`.build` scoring (any eviction policy, KVzip by default) + the AttSVD fit of the low-rank tier;
- :mod:`.cache` the transformers ``Cache`` and the attention routing that reads it;
- :mod:`.store` the runtime engine's store (``runtime/kv`` KVStore protocol; eager, layer-scope scorers).

With ``mid_share = 0`` the same cache is real head-wise (ragged) eviction: only the kept rows are held.
"""
from .build import ComposedConfig, Importance, build, compress, importance, make_policy
from .cache import ComposedCache, ComposedLayer, TieredRead, composed_attention
from .kv import HeadTiers, Q8, attend
from .plan import HeadPlan, TierBytes, allocate, plan_bytes
from .store import ComposedStore

__all__ = ["ComposedCache", "ComposedConfig", "ComposedStore", "ComposedLayer", "HeadPlan", "HeadTiers", "Importance", "Q8",
           "TierBytes", "TieredRead", "allocate", "attend", "build", "composed_attention", "compress", "importance",
           "make_policy", "plan_bytes"]
