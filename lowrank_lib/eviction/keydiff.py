"""KeyDiff (Park et al., 2025, arXiv:2504.15364): keep keys most different from the mean key direction."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .base import Scorer


@dataclass
class KeyDiff(Scorer):
    """Score = -cos(k_i, mean of the normalised keys); attention-free."""

    def score(self, K: torch.Tensor, V: torch.Tensor, obs=None) -> torch.Tensor:
        """K, V [B, H, S, d] -> scores [B, H, S]."""
        kn = F.normalize(K.float(), dim=-1)
        anchor = F.normalize(kn.mean(dim=-2, keepdim=True), dim=-1)
        return -(kn * anchor).sum(-1)
