"""AttSVD configuration: rank rule, window, decode mode, attention-aware switch.

One dataclass, passed explicitly. The rank rule is resolved per matrix by :meth:`AttSVDConfig.fixed_ranks`
(fixed r, ratio c with r = round((1 - c) d), or separate r_K / r_V) or, when ``tau`` is set, by the
per-matrix energy rule of Eq. (5) in :mod:`lowrank_lib.attsvd.ranks`.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

MODES = ("accumulate", "stream")


@dataclass
class AttSVDConfig:
    """Options of the AttSVD low-rank KV cache (one per cache, shared by all layers).

    Parameters
    ----------
    rank : fixed rank r for both K and V (None = use ``ratio`` or ``tau``).
    ratio : compression ratio c; r = round((1 - c) d). c = 0.5 is the "50 % cache" point.
    rank_k, rank_v : separate ranks r_K, r_V (override ``rank`` / ``ratio`` for that matrix).
    tau : energy fraction of the per-matrix rule (Eq. 5). Setting it selects the dynamic mode even when a
        rank or ratio is also set (as in the paper).
    aggregator : how per-(batch, head) energy ranks become one rank per matrix: "max" (default), "mean",
        or "pNN" (a percentile, e.g. "p90").
    rank_max : optional cap on energy-rule ranks.
    window : w, newest tokens kept exact at prefill (and the exact decode window in stream mode).
    mode : "accumulate" (generated tokens stay exact) or "stream" (aged-out chunks of ``chunk`` tokens
        are factored, unweighted, and frozen; the exact window stays within [w, w + chunk]).
    chunk : l, the stream chunk length.
    attention_aware : True = Algorithm 2 (query metric for K, attention mass for V); False = SVD on raw
        K/V, the paper's main baseline.
    eps : ridge of C_Q = Q^T Q + eps * mean-trace * I.
    mass_floor : a <- a + mass_floor * mean(a) (guards the un-weighting diag(1/sqrt a)).
    obs_window : use only the last ``obs_window`` queries for C_Q and the mass (None = all queries).
    key_mass : extension beyond the paper (default off): also row-weight the keys by the attention mass,
        i.e. factor diag(sqrt a) K C_Q^{1/2} (logit errors weighted by how much each key is attended).
    """

    rank: int | None = None
    ratio: float | None = None
    rank_k: int | None = None
    rank_v: int | None = None
    tau: float | None = None
    aggregator: str = "max"
    rank_max: int | None = None
    window: int = 32
    mode: str = "accumulate"
    chunk: int = 128
    attention_aware: bool = True
    eps: float = 1e-3
    mass_floor: float = 1e-3
    obs_window: int | None = None
    key_mass: bool = False

    def __post_init__(self):
        if self.mode not in MODES:
            raise ValueError(f"AttSVDConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.ratio is not None and not (0.0 <= self.ratio < 1.0):
            raise ValueError(f"AttSVDConfig.ratio c must be in [0, 1), got {self.ratio}")
        if self.tau is not None and not (0.0 < self.tau <= 1.0):
            raise ValueError(f"AttSVDConfig.tau must be in (0, 1], got {self.tau}")
        if self.window < 0 or self.chunk < 1:
            raise ValueError(f"AttSVDConfig needs window >= 0 and chunk >= 1, got window={self.window}, "
                             f"chunk={self.chunk}")
        agg = self.aggregator
        if not (agg in ("max", "mean") or (agg.startswith("p") and agg[1:].replace(".", "", 1).isdigit())):
            raise ValueError(f"AttSVDConfig.aggregator must be 'max', 'mean' or 'pNN', got {agg!r}")
        if self.tau is None and self.rank is None and self.ratio is None and (self.rank_k is None
                                                                               or self.rank_v is None):
            raise ValueError("AttSVDConfig needs a rank rule: rank, ratio, rank_k+rank_v, or tau")

    @property
    def dynamic(self) -> bool:
        """True when ranks come from the energy rule (``tau`` set)."""
        return self.tau is not None

    def fixed_ranks(self, head_dim: int) -> tuple[int, int]:
        """(r_K, r_V) of the fixed rule for head dimension d, each clamped to [1, d]."""
        base = self.rank if self.rank is not None else (
            round((1.0 - self.ratio) * head_dim) if self.ratio is not None else None)
        rk = self.rank_k if self.rank_k is not None else base
        rv = self.rank_v if self.rank_v is not None else base
        if rk is None or rv is None:
            raise ValueError("no fixed rank: set rank, ratio or rank_k/rank_v (or tau for the energy rule)")
        return max(1, min(int(rk), head_dim)), max(1, min(int(rv), head_dim))

    def to_dict(self) -> dict:
        return asdict(self)
