"""SnapKV (Li et al., 2024, arXiv:2404.14469): attention of an observation window of the last queries."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from .base import Scorer


@dataclass
class SnapKV(Scorer):
    """Mean attention of the last ``obs_window`` queries (mean over the GQA group), average-pooled
    with ``kernel``; the window itself is kept by the layer."""

    obs_window: int = 64
    kernel: int = 5
    needs_queries: ClassVar[bool] = True

    def score(self, K: torch.Tensor, V: torch.Tensor, obs) -> torch.Tensor:
        """K, V [B, H, S, d]; obs.query [B, Hq, S, d] -> scores [B, H, S]."""
        a = obs.mass(self.obs_window) / (obs.query.shape[1] // K.shape[1])   # mean over the group
        B, H, S = a.shape
        pooled = F.avg_pool1d(a.view(B * H, 1, S), self.kernel, stride=1, padding=self.kernel // 2,
                              count_include_pad=False)
        return pooled.view(B, H, S)
