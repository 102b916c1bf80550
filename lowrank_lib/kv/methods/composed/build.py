"""Score a prefill and build the composed tiers (exact + AttSVD low-rank + dropped) at a byte budget.

    imp = importance(SCORERS["kvzip"](), prefill, window=0)            # scores (+ the queries' statistics)
    segs = segments(prefill, imp, budget=0.25, mid_share=0.25, rank=8)  # per layer, per KV head

``prefill`` is ONE unpadded sequence (:class:`lowrank_lib.kv.Prefill`, batch 1: the KV methods fit row by row).
Scores come from any eviction scorer (:mod:`lowrank_lib.eviction`); the low-rank tier is Algorithm 2 of AttSVD
(:func:`~lowrank_lib.attsvd.basis.attention_svd`: keys in the query metric C_Q, values row-weighted by the
attention mass) fitted on that tier's tokens only, with the metric and the mass of the queries the scorer
observed: KVzip's reconstruction queries, or the last ``obs_window`` prefill queries (the ``attsvd-ext``
statistics) for the other scorers. With ``mid_share = 0`` this is real head-wise (ragged) eviction: only the
kept rows and their positions are held.

Budget-independent work (scores, statistics) is memoised in ``prefill.memo``, so several budgets (or several
methods sharing a scorer) fitted from one prefill score it once.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ....attsvd.basis import attention_svd, ridge_metric
from ....eviction.base import Scorer
from ....eviction.budget import index_dtype, with_window
from ...tiers import Run, Segment, descriptor_nbytes
from .plan import HeadPlan, TierBytes, allocate

DEFAULT_WINDOW = 32     # recent tokens forced exact for scorers without their own rule


@dataclass
class Importance:
    """Per layer: ``score`` [1, H, S] (the forced window at +inf); the statistics of the observing queries for
    the low-rank tier: ``mass`` [1, H, S] (attention received) and ``gram`` [1, H, d, d] (sum of q^T q over the
    group), empty when not asked for."""

    score: list[torch.Tensor]
    mass: list[torch.Tensor]
    gram: list[torch.Tensor]


def _raw(scorer: Scorer, prefill) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor]]:
    """(scores, mass, gram) of ``scorer``: a model-scope scorer gives its queries' statistics, a layer-scope one
    only scores (memoised by the scorer's options)."""
    key = ("scores", repr(scorer))
    if key not in prefill.memo:
        if scorer.scope == "model":
            cs = scorer.score_prefill(prefill)
            prefill.memo[key] = (cs.score, cs.mass, cs.gram)
        else:
            prefill.memo[key] = ([scorer.score(K, V, prefill.observation(i))
                                  for i, (K, V) in enumerate(zip(prefill.keys, prefill.values))], [], [])
    return prefill.memo[key]


def prefill_stats(prefill, obs_window: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(mass, gram) per layer from the last ``obs_window`` prefill queries (memoised)."""
    key = ("stats", obs_window)
    if key not in prefill.memo:
        mass, gram = [], []
        for i, K in enumerate(prefill.keys):
            obs = prefill.observation(i)
            Qg = obs.grouped(K.shape[1])
            if obs_window is not None and Qg.shape[3] > obs_window:
                Qg = Qg[..., -obs_window:, :]
            mass.append(obs.mass(obs_window))
            Qf = Qg.float()
            gram.append(torch.einsum("bhgmd,bhgme->bhde", Qf, Qf))
        prefill.memo[key] = (mass, gram)
    return prefill.memo[key]


@torch.no_grad()
def importance(scorer: Scorer, prefill, window: int | None = None, obs_window: int | None = 512,
               stats: bool = True) -> Importance:
    """Scores of ``scorer`` for ``prefill`` (+ the forced recent window) and the statistics of the queries the
    low-rank tier is fitted with.

    window : newest tokens forced exact (None: the scorer's ``forced_window``, else :data:`DEFAULT_WINDOW`).
    stats : False skips the statistics of a layer-scope scorer (an eviction-only cache needs none)."""
    scores, mass, gram = _raw(scorer, prefill)
    if scorer.scope != "model" and stats:
        mass, gram = prefill_stats(prefill, obs_window)
    w = window if window is not None else scorer.forced_window
    w = DEFAULT_WINDOW if w is None else w
    return Importance([with_window(s, w) for s in scores], mass, gram)


def _segment(K, V, plan: HeadPlan, mass, gram, eps: float, mass_floor: float, key_mass: bool, idt) -> Segment:
    """K, V [S, d] of one head; mass [S]; gram [d, d] -> its Segment (exact rows, at most one low-rank run)."""
    e, m = plan.exact, plan.mid
    seg = Segment(K[e].clone(), V[e].clone(), e.to(idt))
    if len(m) == 0 or plan.rank_k == 0:
        return seg
    C = ridge_metric(gram.double(), eps)[None, None]
    lr = attention_svd(K[m][None, None], V[m][None, None], plan.rank_k, plan.rank_v, C_Q=C,
                       mass=mass[m][None, None], mass_floor=mass_floor, key_mass=key_mass)
    a_k, b_k, a_v, b_v = (t[0, 0].to(K.dtype) for t in lr.runs[0])
    seg.runs.append(Run(a_k, b_k, a_v, b_v, m.to(idt)))
    return seg


@torch.no_grad()
def segments(prefill, imp: Importance, budget: float, mode: str = "global", mid_share: float = 0.25, rank: int = 4,
             quant8: bool = False, key_mass: bool = True, eps: float = 1e-3,
             mass_floor: float = 1e-3) -> list[list[Segment]]:
    """Per layer, per KV head: the Segment of ``prefill`` at ``budget`` (a fraction of its dense KV bytes).

    mode : allocation across layers and heads ("global": KVzip's; "layer"; "head": uniform); mid_share : fraction
    of the bytes for the low-rank tier (0: pure eviction); rank : r_K = r_V of that tier; quant8 : its factors are
    held in int8 (the byte costs the allocation uses; the layer quantises them); key_mass, eps, mass_floor :
    Algorithm 2's options for that tier."""
    K0 = prefill.keys[0]
    B, H, S, d = K0.shape
    if B != 1:
        raise ValueError("composed.segments builds one unpadded sequence (batch 1); the KV methods fit row by row")
    L = len(prefill.keys)
    elt = K0.element_size()
    cost = TierBytes(d, elt, S, rank if mid_share > 0 else 0, quant8)
    if mid_share > 0 and not imp.mass:
        raise ValueError("composed.segments: a low-rank tier needs the queries' statistics: importance(..., stats=True)")
    # the budget counts every byte held, the layout's descriptors too (this row's share, at most one run per head)
    desc = L * descriptor_nbytes(H, H if cost.rank > 0 else 0)
    plans = allocate(imp.score, max(0.0, budget * 2 * L * B * H * S * d * elt - desc), cost, mid_share, mode)
    idt = index_dtype(S)
    out = []
    for li, (K, V, layer_plan) in enumerate(zip(prefill.keys, prefill.values, plans)):
        mass, gram = (imp.mass[li], imp.gram[li]) if imp.mass else (K.new_zeros(B, H, S), K.new_zeros(B, H, d, d))
        out.append([_segment(K[0, h], V[0, h], layer_plan[0][h], mass[0, h], gram[0, h], eps, mass_floor, key_mass,
                             idt) for h in range(H)])
    return out
