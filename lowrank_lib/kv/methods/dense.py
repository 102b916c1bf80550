"""The dense KV method: every prompt token held exactly (the reference every other method is measured against)."""
from __future__ import annotations

from dataclasses import dataclass

from ..method import KVMethod, Prefill, RowFit
from ..tiers import Segment


@dataclass
class Dense(KVMethod):
    """Every token exact (budget 1 by definition: the bytes of the dense cache, plus the segment offsets)."""

    kind = "dense"

    def __post_init__(self):
        super().__post_init__()
        self.budget, self.window = 1.0, 0

    def fit_row(self, prefill: Prefill) -> RowFit:
        return RowFit([[Segment(K[0, h], V[0, h]) for h in range(K.shape[1])]
                       for K, V in zip(prefill.keys, prefill.values)])
