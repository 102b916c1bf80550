"""StreamingLLM (Xiao et al., 2023, arXiv:2309.17453): attention sinks + recent window."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .base import Scorer


@dataclass
class StreamingLLM(Scorer):
    """Keep the first ``sinks`` tokens and the most recent ones (score = position, sinks = +inf)."""

    sinks: int = 4

    def score(self, K: torch.Tensor, V: torch.Tensor, obs=None) -> torch.Tensor:
        """K, V [B, H, S, d] -> scores [B, H, S]."""
        B, H, S, _ = K.shape
        s = torch.arange(S, device=K.device, dtype=torch.float32).expand(B, H, S).clone()
        s[..., :self.sinks] = float("inf")
        return s
