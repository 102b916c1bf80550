"""H2O (Zhang et al., 2023, arXiv:2306.14048): heavy hitters by accumulated attention mass + recent window."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Scorer


@dataclass
class H2O(Scorer):
    """Score = total attention each key receives from all prefill queries of its GQA group."""

    needs_queries: ClassVar[bool] = True

    def score(self, K: torch.Tensor, V: torch.Tensor, obs) -> torch.Tensor:
        """K, V [B, H, S, d]; obs: the queries [B, Hq, S, d] (their shared attention mass) -> scores [B, H, S]."""
        return obs.mass()
