"""H2O (Zhang et al., 2023, arXiv:2306.14048): heavy hitters by accumulated attention mass + recent window."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention_mass import attention_mass


@dataclass
class H2O:
    """Score = total attention each key receives from all prefill queries of its GQA group."""

    needs_queries = True

    def score(self, K: torch.Tensor, V: torch.Tensor, obs) -> torch.Tensor:
        """K, V [B, H, S, d]; obs.query [B, Hq, S, d] -> scores [B, H, S]."""
        Qg = obs.grouped(K.shape[1])
        k_pos = torch.arange(K.shape[-2], device=K.device)
        return attention_mass(Qg, K, obs.scaling, obs.q_pos, k_pos)
