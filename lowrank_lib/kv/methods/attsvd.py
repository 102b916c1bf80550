"""AttSVD as a KV method: the prompt bulk in a per-prompt, attention-aware low-rank basis (Algorithm 2), the
newest ``window`` tokens exact; every token is kept.

Modes (the paper's): ``accumulate`` (generated tokens stay exact) and ``stream`` (every ``chunk`` tokens that age
out of the exact window are factored, unweighted, into a frozen block: the exact part stays within
[w, w + chunk]). Variants in the registry: the paper's algorithm, raw-K/V SVD (``attention_aware=False``, the
paper's main baseline), and our extensions ``key_mass`` (keys also mass-weighted) and ``obs_window`` (statistics
from the last queries only).

Budget -> rank: r_K = r_V = the largest r whose stored bytes (Eq. 6 of the paper: the bulk's factors
(r_K + r_V)(S - w) + their bases (r_K + r_V) d, plus the exact window 2 w d) fit ``budget`` of the dense bytes
(at least 1). ``describe`` reports the r/d and the paper's compression ratio c = 1 - r/d beside the budget. An
explicit ``rank`` (r/d studies, full-rank exactness) or the energy rule ``tau`` (ranks from each spectrum) replace
the budget; the bytes are then an outcome.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...attsvd.basis import compress_prefill, trunc_svd
from ...attsvd.config import MODES, AttSVDConfig
from ...attsvd.ranks import aggregate, energy_rank
from ..method import KVMethod, Prefill, RowFit
from ..tiers import Run, Segment, TieredLayer, descriptor_nbytes


def stored_tokens(S: int, d: int, rank_k: int, rank_v: int, window: int) -> float:
    """Dense-token equivalent of AttSVD's stored entries for a prefill of S tokens (Eq. 6, per head)."""
    w = min(window, S)
    nb = S - w
    factor = (rank_k + rank_v) * (nb + d) if nb > 0 else 0
    return (factor + 2 * w * d) / (2 * d)


def rank_for_budget(budget: float, S: int, d: int, window: int, overhead: float = 0.0) -> int:
    """The largest r in [1, d] whose stored bytes (Eq. 6, plus ``overhead`` token-equivalents per head: the layout's
    descriptors) are at most ``budget`` of the dense bytes (else 1)."""
    return max([r for r in range(1, d + 1) if stored_tokens(S, d, r, r, window) + overhead <= budget * S] or [1])


@dataclass
class AttSVD(KVMethod):
    """AttSVD (see the module docstring); options as :class:`~lowrank_lib.attsvd.config.AttSVDConfig` names them.
    ``budget`` sizes the rank; an explicit ``rank`` or ``tau`` sizes it instead (``budget`` is then None: the bytes
    are an outcome, reported by ``describe()["budget"]`` as for every method)."""

    budget: float | None = None
    window: int | None = 32
    mode: str = "accumulate"
    chunk: int = 128
    attention_aware: bool = True
    key_mass: bool = False
    obs_window: int | None = None
    rank: int | None = None
    tau: float | None = None
    aggregator: str = "max"
    rank_max: int | None = None
    eps: float = 1e-3
    mass_floor: float = 1e-3
    kind = "lowrank"

    def __post_init__(self):
        super().__post_init__()
        if self.window is None:
            self.window = 32
        if self.mode not in MODES:
            raise ValueError(f"AttSVD mode must be one of {MODES}, got {self.mode!r}")
        if self.budget is None and self.rank is None and self.tau is None:
            raise ValueError("AttSVD needs a budget, an explicit rank or the energy rule's tau")
        if self.rank is not None or self.tau is not None:
            self.budget = None                          # the rank (or the energy rule) decides the bytes held
        self.needs_queries = self.attention_aware
        self.capturable = self.mode == "accumulate"      # stream mode reshapes its state every chunk tokens

    def config(self, S: int, d: int, overhead: float = 0.0) -> AttSVDConfig:
        """The AttSVD options for a prompt of S tokens and head dim d (the rank from the budget, see above;
        ``overhead``: descriptor bytes per head in tokens, counted against the budget)."""
        r = self.rank if self.rank is not None else (
            rank_for_budget(self.budget, S, d, self.window, overhead) if self.budget is not None else 1)
        return AttSVDConfig(rank=min(r, d), tau=self.tau, aggregator=self.aggregator, rank_max=self.rank_max,
                            window=self.window, mode=self.mode, chunk=self.chunk, attention_aware=self.attention_aware,
                            eps=self.eps, mass_floor=self.mass_floor, obs_window=self.obs_window,
                            key_mass=self.key_mass)

    def fit_row(self, prefill: Prefill) -> RowFit:
        K0 = prefill.keys[0]
        H, d = K0.shape[1], prefill.head_dim
        # the budget counts every byte held: this row's share of the layout's descriptors (one run per head)
        cfg = self.config(prefill.length, d, descriptor_nbytes(H, H) / (H * 2 * d * K0.element_size()))
        segs, info = [], []
        for i, (K, V) in enumerate(zip(prefill.keys, prefill.values)):
            Q = prefill.queries[i] if self.attention_aware else None
            kv = compress_prefill(K, V, Q, cfg, None, prefill.scaling)
            segs.append([Segment(kv.k_exact[0, h], kv.v_exact[0, h], None,
                                 [Run(a_k[0, h], b_k[0, h], a_v[0, h], b_v[0, h]) for a_k, b_k, a_v, b_v in kv.runs])
                         for h in range(K.shape[1])])
            sp = kv.info
            info.append({"rank": cfg.rank, "rank_k": kv.rank_k, "rank_v": kv.rank_v, "bulk": kv.length - kv.window,
                         "weighted": None if sp is None else sp.weighted,
                         "head_rank_k": None if sp is None or sp.head_rank_k is None else sp.head_rank_k[0].tolist(),
                         "head_rank_v": None if sp is None or sp.head_rank_v is None else sp.head_rank_v[0].tolist()})
        return RowFit(segs, info)

    # ------------------------------------------------------------------ stream mode
    def _chunk_rank(self, chunks: list[torch.Tensor], rank: int) -> int:
        """Rank of a stream block: the row's configured rank, or the energy rule over its heads' spectra."""
        if self.tau is None:
            return rank
        sv = torch.stack([torch.linalg.svdvals(c.float()) for c in chunks])
        return aggregate(energy_rank(sv, self.tau), self.aggregator, self.rank_max)

    def append(self, layer: TieredLayer, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor | None = None) -> None:
        """Accumulate: exact. Stream: then factor every ``chunk`` rows that aged out of the exact window of a
        row (all its heads together, ranks shared, plain truncated SVD) into a frozen run."""
        layer.append(k, v, slot)
        if self.mode != "stream":
            return
        w, c = self.window, self.chunk
        e, _ = layer.segment_counts()
        if all(n + layer.n_new - w < c for n in e):
            return
        segs = layer.to_segments()                        # exact rows + appended rows, oldest first
        for row, info in zip(segs, layer.info):
            while row[0].k.shape[0] - w >= c:
                ck, cv = [s.k[:c] for s in row], [s.v[:c] for s in row]
                rk, rv = self._chunk_rank(ck, info["rank"]), self._chunk_rank(cv, info["rank"])
                for s, kk, vv in zip(row, ck, cv):
                    (ak, bk), (av, bv) = trunc_svd(kk, rk), trunc_svd(vv, rv)
                    s.runs.append(Run(ak.to(kk.dtype), bk.to(kk.dtype), av.to(vv.dtype), bv.to(vv.dtype)))
                    s.k, s.v = s.k[c:], s.v[c:]
        new = TieredLayer.build(segs, layer.quant8, layer.dtype, layer.k_exact.device)
        new.info = layer.info
        layer.replace_with(new)

    def describe(self, layers: list[TieredLayer], prefill: Prefill) -> dict:
        out = super().describe(layers, prefill)
        d = prefill.head_dim
        rk = [i["rank_k"] for l in layers for i in l.info]
        rv = [i["rank_v"] for l in layers for i in l.info]
        r = sum(rk + rv) / max(1, len(rk + rv))
        return out | {"rank_k": rk, "rank_v": rv, "r_over_d": r / d, "compression_ratio": 1 - r / d,
                      "mode": self.mode, "window": self.window}
