"""What every eviction scorer declares and what it observes: the written policy interface.

A scorer ranks a prefill's tokens (higher = keep). Like kvpress's ``ScorerPress``, a new policy writes only its
``score``; what it needs is DECLARED as class-level fields of :class:`Scorer`, read by the KV methods
(:mod:`lowrank_lib.kv`) and never probed with ``getattr``:

    needs_queries : the prefill's post-RoPE queries (``Observation.query``) are read
    needs_rope    : the model's RoPE (positions -> cos, sin) is read (Expected Attention un-rotates queries)
    scope         : "layer" (``score(K, V, obs)`` per layer) or "model" (``score_prefill(prefill)``: it runs a
                    forward of the model on top of the prefill, KVzip's reconstruction)
    forced_window : newest tokens always kept (None: the method's default window; 0: the score ranks them itself)
    allocation    : how its eviction method spreads the byte budget ("head": every (layer, head) the same share;
                    "global": one ranking across layers and heads, KVzip's): the registry's ``EVICTION_MODES``

Scorers see ONE sequence without padding (the KV methods fit every batch row on its own valid tokens), so
positions are plain ``0 .. S-1``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch

from ..attention_mass import attention_mass

Rope = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]   # positions [n] -> (cos, sin) [n, d]


@dataclass(eq=False)
class Observation:
    """What a layer-scope scorer observes of one layer's prefill.

    query : [B, Hq, m, d] post-RoPE queries at positions ``q_pos`` [m]; scaling : the softmax scale;
    keys : [B, H, S, d] the layer's post-RoPE keys (for :meth:`mass`); k_valid / q_valid : [B, S] / [B, m] bool
    padding masks (None: every slot is a real token); rope : the model's RoPE where the scorer declares ``needs_rope``.
    """

    query: torch.Tensor | None
    scaling: float
    q_pos: torch.Tensor
    keys: torch.Tensor | None = None
    k_valid: torch.Tensor | None = None
    q_valid: torch.Tensor | None = None
    rope: Rope | None = None
    _mass: dict = field(default_factory=dict, repr=False)

    def grouped(self, n_kv: int) -> torch.Tensor:
        """Queries as [B, H, G, m, d] (query head h * G + g reads KV head h)."""
        B, Hq, m, d = self.query.shape
        if Hq % n_kv:
            raise ValueError(f"query heads {Hq} not a multiple of KV heads {n_kv}")
        return self.query.view(B, n_kv, Hq // n_kv, m, d)

    def mass(self, last: int | None = None) -> torch.Tensor:
        """Attention each key receives, summed over the group's queries (the last ``last`` of them, or all),
        [B, H, S] fp32, causal and padding masks applied; computed once per ``last`` (H2O, normalised H2O, SnapKV
        and the composed cache's low-rank statistics share it)."""
        if last not in self._mass:
            K = self.keys
            if K is None or self.query is None:
                raise ValueError("Observation.mass needs the layer's keys and queries")
            Qg, q_pos, q_valid = self.grouped(K.shape[1]), self.q_pos, self.q_valid
            if last is not None and Qg.shape[3] > last:
                Qg, q_pos = Qg[..., -last:, :], q_pos[-last:]
                q_valid = None if q_valid is None else q_valid[:, -last:]
            k_pos = torch.arange(K.shape[-2], device=K.device)
            self._mass[last] = attention_mass(Qg, K, self.scaling, q_pos, k_pos, q_valid, self.k_valid)
        return self._mass[last]


@dataclass
class ContextScores:
    """A model-scope scorer's result, per layer: ``score`` [B, H, S]; the statistics of the queries it observed,
    ``mass`` [B, H, S] (attention received) and ``gram`` [B, H, d, d] (sum of q^T q over the group)."""

    score: list[torch.Tensor]
    mass: list[torch.Tensor]
    gram: list[torch.Tensor]
    queries: int = 0


@dataclass
class Scorer:
    """Base of every eviction policy (see the module docstring)."""

    needs_queries: ClassVar[bool] = False
    needs_rope: ClassVar[bool] = False
    scope: ClassVar[str] = "layer"
    forced_window: ClassVar[int | None] = None
    allocation: ClassVar[str] = "head"

    def score(self, K: torch.Tensor, V: torch.Tensor, obs: Observation) -> torch.Tensor:
        """K, V [B, H, S, d] of one layer -> scores [B, H, S] (layer scope)."""
        raise NotImplementedError(f"{type(self).__name__} is a {self.scope}-scope scorer without score()")

    def score_prefill(self, prefill) -> ContextScores:
        """Scores of every layer of ``prefill`` (:class:`lowrank_lib.kv.Prefill`; model scope)."""
        raise NotImplementedError(f"{type(self).__name__} is a {self.scope}-scope scorer without score_prefill()")
