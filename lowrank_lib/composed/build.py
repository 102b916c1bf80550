"""Build a composed (or ragged eviction) cache from a recorded prefill.

    record = record_prefill(model, ids)                         # once (exact K, V, post-RoPE queries)
    imp = importance(SCORERS["kvzip"](), model, tok, ids, record)   # scores (+ the queries' statistics)
    cache = build(record, imp, budget=0.25, config=ComposedConfig())   # tiers at 25 % of the dense bytes

or ``compress(model, tok, ids, config, budget)`` for all three. Scores come from any eviction policy
(:mod:`lowrank_lib.eviction`); the low-rank tier is Algorithm 2 of AttSVD
(:func:`~lowrank_lib.attsvd.basis.attention_svd`: keys in the query metric C_Q, values row-weighted by
the attention mass) fitted on that tier's tokens only, with the metric and the mass of the queries the
policy observed: KVzip's reconstruction queries, or the last ``obs_window`` prefill queries (the
``attsvd-ext`` statistics) for the other policies.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ..attention_mass import attention_mass
from ..attsvd.basis import attention_svd, ridge_metric
from ..eviction import SCORERS
from ..eviction.budget import index_dtype, with_window
from ..hf.record import PrefillRecord
from .cache import ComposedCache
from .kv import HeadTiers, Q8
from .plan import TierBytes, allocate, plan_bytes

DEFAULT_WINDOW = 32     # recent tokens forced exact for policies without their own rule (as EvictionBudget)


@dataclass
class ComposedConfig:
    """Options of the composed cache (one per cache).

    scorer : eviction policy name (``lowrank_lib.eviction.SCORERS``) ranking the tokens.
    mode : allocation across layers / heads ("global": KVzip's; "layer"; "head": uniform).
    mid_share : fraction of the byte budget spent on the low-rank tier (0 = pure eviction).
    rank : r_K = r_V of the low-rank tier.
    quant8 : int8 low-rank factors (one fp16 scale per token row).
    key_mass : keys also row-weighted by sqrt(mass) (attsvd-ext); eps, mass_floor : Algorithm 2's ridges.
    obs_window : prefill queries giving the low-rank statistics for layer-scope scorers.
    window : newest tokens forced exact (None: the scorer's own rule, else DEFAULT_WINDOW).
    """

    scorer: str = "kvzip"
    mode: str = "global"
    mid_share: float = 0.25
    rank: int = 4
    quant8: bool = False
    key_mass: bool = True
    eps: float = 1e-3
    mass_floor: float = 1e-3
    obs_window: int = 512
    window: int | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class Importance:
    """Per layer: ``score`` [B, H, S]; the statistics of the observing queries for the low-rank tier:
    ``mass`` [B, H, S] (attention received) and ``gram`` [B, H, d, d] (sum of q^T q over the group)."""

    score: list[torch.Tensor]
    mass: list[torch.Tensor]
    gram: list[torch.Tensor]


def make_policy(name: str, model):
    """A fresh scorer ``name`` of ``lowrank_lib.eviction.SCORERS``, bound to ``model`` when it needs it."""
    if name not in SCORERS:
        raise ValueError(f"unknown scorer {name!r}; choose from {sorted(SCORERS)}")
    p = SCORERS[name]()
    return p.bind(model) if hasattr(p, "bind") else p


def prefill_stats(record: PrefillRecord, obs_window: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(mass, gram) per layer from the last ``obs_window`` recorded prefill queries."""
    mass, gram = [], []
    for K, obs in zip(record.keys, record.obs):
        H, S = K.shape[1], K.shape[-2]
        Qg = obs.grouped(H)
        q_pos = obs.q_pos
        if obs_window is not None and Qg.shape[3] > obs_window:
            Qg, q_pos = Qg[..., -obs_window:, :], q_pos[-obs_window:]
        mass.append(attention_mass(Qg, K, obs.scaling, q_pos, torch.arange(S, device=K.device)))
        Qf = Qg.float()
        gram.append(torch.einsum("bhgmd,bhgme->bhde", Qf, Qf))
    return mass, gram


@torch.no_grad()
def importance(policy, model, tok, ids: torch.Tensor, record: PrefillRecord, window: int | None = None,
               obs_window: int | None = 512, stats: bool = True,
               scores: list[torch.Tensor] | None = None) -> Importance:
    """Scores of ``policy`` for the recorded prefill of ``ids`` (+ forced recent window) and the statistics
    of the queries the low-rank tier is fitted with.

    window : newest tokens forced exact (None: the policy's ``forced_window``, else DEFAULT_WINDOW).
    stats : False skips the statistics of a layer-scope policy (an eviction-only cache needs none; mass and
    gram are then empty). scores : per-layer raw scores already computed by the caller (shared work)."""
    mass: list[torch.Tensor] = []
    gram: list[torch.Tensor] = []
    if getattr(policy, "scope", "layer") == "model":
        cs = policy.score_context(model, tok, ids, record)
        scores, mass, gram = cs.score, cs.mass, cs.gram
    else:
        if scores is None:
            scores = [policy.score(K, V, obs) for K, V, obs in zip(record.keys, record.values, record.obs)]
        if stats:
            mass, gram = prefill_stats(record, obs_window)
    w = window if window is not None else getattr(policy, "forced_window", None)
    w = DEFAULT_WINDOW if w is None else w
    return Importance([with_window(s, w) for s in scores], mass, gram)


def _head(K, V, plan, mass, gram, cfg: ComposedConfig, idt) -> HeadTiers:
    """K, V [S, d] of one (row, head); mass [S]; gram [d, d] -> HeadTiers."""
    e, m = plan.exact, plan.mid
    ht = HeadTiers(K[e].clone(), V[e].clone(), e.to(idt))
    if len(m) == 0 or plan.rank_k == 0:
        return ht
    C = ridge_metric(gram.double(), cfg.eps)[None, None]
    lr = attention_svd(K[m][None, None], V[m][None, None], plan.rank_k, plan.rank_v, C_Q=C,
                       mass=mass[m][None, None], mass_floor=cfg.mass_floor, key_mass=cfg.key_mass)
    a_k, b_k, a_v, b_v = (t[0, 0].to(K.dtype) for t in lr.runs[0])
    if cfg.quant8:
        a_k, a_v = Q8.quantize(a_k), Q8.quantize(a_v)
    ht.a_k, ht.b_k, ht.a_v, ht.b_v, ht.pos_mid = a_k, b_k, a_v, b_v, m.to(idt)
    return ht


@torch.no_grad()
def build(record: PrefillRecord, imp: Importance, budget: float, config: ComposedConfig) -> ComposedCache:
    """The composed cache of ``record`` at ``budget`` (a fraction of the dense prefill bytes)."""
    K0 = record.keys[0]
    B, H, S, d = K0.shape
    L = len(record.keys)
    elt = K0.element_size()
    cost = TierBytes(d, elt, S, config.rank if config.mid_share > 0 else 0, config.quant8)
    dense = 2 * L * B * H * S * d * elt
    if config.mid_share > 0 and not imp.mass:
        raise ValueError("build: a low-rank tier needs the queries' statistics: importance(..., stats=True)")
    plans = allocate(imp.score, budget * dense, cost, config.mid_share, config.mode)
    idt = index_dtype(S)
    cache = ComposedCache(L, {"config": config.to_dict(), "budget": budget, "plan_bytes": plan_bytes(plans, cost)})
    for li, (K, V, layer_plan) in enumerate(zip(record.keys, record.values, plans)):
        mass, gram = (imp.mass[li], imp.gram[li]) if imp.mass else (K.new_zeros(B, H, S), K.new_zeros(B, H, d, d))
        heads = [[_head(K[b, h], V[b, h], layer_plan[b][h], mass[b, h], gram[b, h], config, idt)
                  for h in range(H)] for b in range(B)]
        cache.layers[li].load_tiers(heads, S, K)
    return cache


def compress(model, tok, ids: torch.Tensor, config: ComposedConfig, budget: float,
             record: PrefillRecord | None = None) -> ComposedCache:
    """Record the prefill of ``ids`` (unless given), score it with ``config.scorer`` and build the cache."""
    from ..hf.record import record_prefill

    record = record if record is not None else record_prefill(model, ids)
    imp = importance(make_policy(config.scorer, model), model, tok, ids, record, config.window, config.obs_window)
    return build(record, imp, budget, config)
