"""Normalised observed attention (H2O, Zhang et al., 2023, arXiv:2306.14048, in the form kvpress's
``ObservedAttentionPress`` measures best): the attention each key receives from the prefill queries,
divided by the number of queries that can see it, and no forced recent window.

Plain H2O (:class:`~lowrank_lib.eviction.h2o.H2O`) sums the attention a key receives; under the causal
mask key ``i`` is seen by ``S - i`` queries, so early keys collect mass just by being early and the
recent ones are kept only by the forced window. Dividing by the number of observers turns the sum into
the mean attention per observing query, which compares early and late keys fairly (peers.md: it halves
H2O's KL on SmolLM2 at 52 % of the KV).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Scorer


@dataclass
class ObservedAttention(Scorer):
    """Score = mean over the GQA group of (attention received) / (number of prefill queries that see the key)."""

    needs_queries: ClassVar[bool] = True
    forced_window: ClassVar[int | None] = 0   # no recent window: the normalised score ranks recent keys itself

    def score(self, K: torch.Tensor, V: torch.Tensor, obs) -> torch.Tensor:
        """K, V [B, H, S, d]; obs.query [B, Hq, m, d] at positions obs.q_pos -> scores [B, H, S]."""
        return self.normalise(obs.mass(), obs, obs.query.shape[1] // K.shape[1])

    @staticmethod
    def normalise(mass: torch.Tensor, obs, group: int) -> torch.Tensor:
        """H2O's summed mass [B, H, S] (over the ``group`` query heads of each KV head) -> this policy's score:
        the mean over the group, divided by the number of queries that see each key (the causal count, or
        the valid ones of a padded batch)."""
        S = mass.shape[-1]
        k_pos = torch.arange(S, device=mass.device)
        vis = (obs.q_pos[:, None] >= k_pos[None, :]).to(mass.dtype)                 # [m, S]
        if obs.q_valid is not None:
            seen = torch.einsum("bm,ms->bs", obs.q_valid.to(mass.dtype), vis)[:, None]  # [B, 1, S]
        else:
            seen = vis.sum(0)                                                           # [S]
        return mass / group / seen.clamp_min(1)
