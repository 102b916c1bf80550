"""The composed cache and eviction as KV methods: tokens ranked by an eviction scorer, the top ones exact, the
next ones in AttSVD's attention-aware low-rank basis (``Composed``), the rest dropped, at a byte budget
allocated across layers and heads. ``Eviction`` is the same allocation with no low-rank tier: real ragged
head-wise eviction, the kept rows and their positions counted. Their math lives beside them:

- :mod:`.plan` the allocation (which tier every token goes to) at a byte budget;
- :mod:`.build` scoring (any eviction scorer, KVzip by default) + the AttSVD fit of the low-rank tier, as the
  :class:`~lowrank_lib.kv.tiers.Segment` of every head.

The scorer declares what it needs (:class:`~lowrank_lib.eviction.base.Scorer`): its queries, RoPE, or a forward
of the model (KVzip: model scope, served by either adapter's probe); its own options reach it as the method's
``scorer_options``. Scores and statistics are computed once per prefill (memoised), whatever the budgets fitted
from it. Both adapters of :mod:`lowrank_lib.kv` serve these methods like every other.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from ....eviction import SCORERS
from ....eviction.budget import MODES
from ...method import KVMethod, Prefill, RowFit
from ...tiers import TieredLayer
from .build import DEFAULT_WINDOW, Importance, importance, prefill_stats, segments
from .plan import HeadPlan, TierBytes, allocate, plan_bytes

__all__ = ["Composed", "DEFAULT_WINDOW", "Eviction", "HeadPlan", "Importance", "TierBytes", "allocate", "importance",
           "plan_bytes", "prefill_stats", "segments"]


@dataclass
class Composed(KVMethod):
    """Exact + low-rank + dropped at ``budget``.

    scorer : name in ``lowrank_lib.eviction.SCORERS``; scorer_options : that scorer's own fields (e.g. SnapKV's
    ``kernel``, KVzip's ``chunk``), handed to it at every fit. mode : allocation ("global": KVzip's non-uniform one across
    layers and heads; "layer"; "head": uniform). mid_share : fraction of the bytes for the low-rank tier.
    rank : r_K = r_V of that tier. quant8 : its factors in int8 (one fp16 scale per token row).
    key_mass, eps, mass_floor : Algorithm 2's options for that tier; obs_window : prefill queries giving its
    statistics for layer-scope scorers. window : newest tokens forced exact (None: the scorer's own rule, else 32).
    """

    scorer: str = "kvzip"
    scorer_options: dict = field(default_factory=dict)
    mode: str = "global"
    mid_share: float = 0.25
    rank: int = 4
    quant8: bool = False
    key_mass: bool = True
    eps: float = 1e-3
    mass_floor: float = 1e-3
    obs_window: int | None = 512
    kind = "composed"

    def __post_init__(self):
        super().__post_init__()
        if self.scorer not in SCORERS:
            raise ValueError(f"unknown scorer {self.scorer!r}; choose from {sorted(SCORERS)}")
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if not 0.0 <= self.mid_share < 1.0:
            raise ValueError(f"mid_share must be in [0, 1), got {self.mid_share}")
        if self.budget is None:
            raise ValueError(f"{type(self).__name__} needs a byte budget")
        cls = SCORERS[self.scorer]
        known = {f.name for f in fields(cls)}
        if set(self.scorer_options) - known:
            raise ValueError(f"scorer {self.scorer!r} has no option {sorted(set(self.scorer_options) - known)}; "
                             f"its options: {sorted(known)}")
        if self.window is None:                 # the scorer's own rule, else the default recent window
            self.window = DEFAULT_WINDOW if cls.forced_window is None else cls.forced_window
        self.scope = cls.scope
        # layer-scope scorers observe the prefill queries; the low-rank tier's statistics need them too
        self.needs_queries = cls.needs_queries or (cls.scope == "layer" and self.mid_share > 0)

    def make_scorer(self):
        """The scorer this method ranks with, its options applied."""
        return SCORERS[self.scorer](**self.scorer_options)

    def uses_quant8(self) -> bool:
        return self.quant8 and self.mid_share > 0

    def fit_row(self, prefill: Prefill) -> RowFit:
        scorer = self.make_scorer()
        imp = importance(scorer, prefill, self.window, self.obs_window, stats=self.mid_share > 0)
        segs = segments(prefill, imp, self.budget, self.mode, self.mid_share, self.rank, self.uses_quant8(),
                        self.key_mass, self.eps, self.mass_floor)
        return RowFit(segs)

    def describe(self, layers: list[TieredLayer], prefill: Prefill) -> dict:
        out = super().describe(layers, prefill)
        return out | {"scorer": self.scorer, "scorer_options": dict(self.scorer_options), "mode": self.mode, "mid_share": self.mid_share, "rank": self.rank,
                      "quant8": self.uses_quant8()}


@dataclass
class Eviction(Composed):
    """Ragged head-wise eviction at ``budget``: the scorer's top tokens exact, the rest dropped."""

    mode: str = "head"
    mid_share: float = 0.0
    kind = "eviction"

    def __post_init__(self):
        super().__post_init__()
        if self.mid_share != 0:
            raise ValueError("Eviction keeps no low-rank tier (mid_share 0): use Composed")
