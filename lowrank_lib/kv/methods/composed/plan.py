"""Which tier every prefill token goes to, at a byte budget: the composed cache's allocation.

Tokens are ranked by an importance score (any eviction policy's, KVzip's by default). The budget is
split between an exact tier and a low-rank tier (``mid_share`` of the bytes for the latter):

1. exact tier: the top tokens by score that fit ``(1 - mid_share) * budget`` at the bytes of an exact token
   (key + value rows + position), allocated across layers and heads as the eviction allocation ``mode``
   says (``"global"``: KVzip's non-uniform ranking of all layers and heads together);
2. low-rank tier: the next tokens in the same ranking, as many as fit the rest of the budget at the bytes
   of a factored token (``r_K + r_V`` factor entries + position) plus, per head that has any, its basis
   ``(r_K + r_V) d`` (bisection: the bytes grow with the number of tokens);
3. everything else is dropped.

When the low-rank tier would hold every remaining token with bytes to spare, the spare bytes turn low-rank
tokens back into exact ones (the most important first) until the budget is spent.

So each (layer, KV head) gets its own split (n_exact, n_mid) from the scores, and the whole budget is
spent where the scores are. A budget that holds every token exactly keeps every token exactly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ....eviction.budget import index_dtype, keep_counts, token_bytes


@dataclass
class HeadPlan:
    """One (layer, batch row, KV head): exact and low-rank positions (sorted long) and the low-rank ranks."""

    exact: torch.Tensor
    mid: torch.Tensor
    rank_k: int = 0
    rank_v: int = 0


@dataclass
class TierBytes:
    """Per-token and per-head byte costs of the tiers (``elt``: element size of K/V and of the factors)."""

    head_dim: int
    elt: int
    S: int
    rank: int = 0
    quant8: bool = False

    @property
    def idx(self) -> int:
        return torch.empty(0, dtype=index_dtype(self.S)).element_size()

    @property
    def exact(self) -> int:
        return token_bytes(self.head_dim, self.elt, self.S)

    def mid_token(self, rank_k: int | None = None, rank_v: int | None = None) -> int:
        rk = self.rank if rank_k is None else rank_k
        rv = self.rank if rank_v is None else rank_v
        if self.quant8:
            return rk + rv + 2 * 2 + self.idx          # int8 entries + one fp16 scale per row of a_k and a_v
        return (rk + rv) * self.elt + self.idx

    def basis(self, rank_k: int | None = None, rank_v: int | None = None) -> int:
        rk = self.rank if rank_k is None else rank_k
        rv = self.rank if rank_v is None else rank_v
        return (rk + rv) * self.head_dim * self.elt

    def mid_bytes(self, counts: torch.Tensor) -> int:
        """Bytes of the low-rank tiers of heads holding ``counts`` low-rank tokens each (rank min(rank, n), the
        same rule as :func:`allocate`'s plans; a head with none holds no basis)."""
        r = counts.clamp(max=min(self.rank, self.head_dim))
        per_entry = 1 if self.quant8 else self.elt
        scales = 2 * 2 if self.quant8 else 0
        tok = 2 * r * per_entry + scales + self.idx
        return int((counts * tok + 2 * r * self.head_dim * self.elt).sum())

    def head(self, n_exact: int, n_mid: int, rank_k: int | None = None, rank_v: int | None = None) -> int:
        """Bytes one head holds with ``n_exact`` exact and ``n_mid`` low-rank tokens."""
        if n_mid == 0:
            return n_exact * self.exact
        return n_exact * self.exact + n_mid * self.mid_token(rank_k, rank_v) + self.basis(rank_k, rank_v)


def _mask_taken(scores: list[torch.Tensor], counts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Scores with each head's top ``counts`` tokens replaced by -inf (they are taken)."""
    out = []
    for s, c in zip(scores, counts):
        s = s.float().clone()
        B, H, S = s.shape
        rank = (s + torch.arange(S, device=s.device) * 1e-12).argsort(-1, descending=True).argsort(-1)
        s[rank < c[..., None]] = float("-inf")
        out.append(s)
    return out


def _top(score: torch.Tensor, n: int) -> torch.Tensor:
    S = score.shape[-1]
    return (score.float() + torch.arange(S, device=score.device) * 1e-12).topk(n).indices


def allocate(scores: list[torch.Tensor], budget_bytes: float, cost: TierBytes, mid_share: float = 0.25,
             mode: str = "global") -> list[list[list[HeadPlan]]]:
    """The tier of every token of every (layer, row, head) at ``budget_bytes`` (see the module docstring).

    scores : per layer [B, H, S] (higher = more important; +inf = must stay exact). Returns per layer
    ``[b][h]`` HeadPlan. Bytes held are at most ``budget_bytes`` (:func:`plan_bytes`), except that tokens
    scored +inf are always kept exact.
    """
    L = len(scores)
    B, H, S = scores[0].shape
    total = L * B * H * S
    if not 0.0 <= mid_share < 1.0:
        raise ValueError(f"mid_share must be in [0, 1), got {mid_share}")
    forced = sum(int(torch.isinf(s).logical_and(s > 0).sum()) for s in scores)
    if budget_bytes >= total * cost.exact or cost.rank == 0:
        mid_share = 0.0
    n_e = max(forced, min(total, int((1 - mid_share) * budget_bytes // cost.exact)))
    ce = keep_counts(scores, n_e, mode)
    mid_budget = budget_bytes - n_e * cost.exact
    cm = [torch.zeros_like(c) for c in ce]
    if mid_share > 0 and mid_budget > 0:
        rest = _mask_taken(scores, ce)
        avail = total - n_e

        def bytes_of(n: int) -> tuple[float, list[torch.Tensor]]:
            c = keep_counts(rest, n, mode)
            return sum(cost.mid_bytes(x) for x in c), c

        lo, hi = 0, avail
        while lo < hi:                         # largest n whose bytes fit (bytes grow with n)
            mid = (lo + hi + 1) // 2
            if bytes_of(mid)[0] <= mid_budget:
                lo = mid
            else:
                hi = mid - 1
        cm = bytes_of(lo)[1]
        cm = [c.masked_fill(c <= 0, 0) for c in cm]
        rest_sel = rest
        if lo == avail:                        # every token is kept: spend the slack on more exact tokens
            def all_kept(n: int) -> tuple[float, list[torch.Tensor]]:
                c = keep_counts(scores, n, mode)
                return sum(int(x.sum()) * cost.exact + cost.mid_bytes(S - x) for x in c), c

            lo2, hi2 = n_e, total
            while lo2 < hi2:
                m2 = (lo2 + hi2 + 1) // 2
                if all_kept(m2)[0] <= budget_bytes:
                    lo2 = m2
                else:
                    hi2 = m2 - 1
            if lo2 > n_e:
                ce = all_kept(lo2)[1]
                cm = [S - c for c in ce]
                rest_sel = _mask_taken(scores, ce)
    else:
        rest_sel = None
    plans = []
    for li, s in enumerate(scores):
        layer = []
        for b in range(B):
            row = []
            for h in range(H):
                e = _top(s[b, h], int(ce[li][b, h]))
                nm = int(cm[li][b, h])
                m = _top(rest_sel[li][b, h], nm) if nm else e.new_zeros(0)
                r = min(cost.rank, nm, cost.head_dim) if nm else 0
                row.append(HeadPlan(e.sort().values, m.sort().values, r, r))
            layer.append(row)
        plans.append(layer)
    return plans


def plan_bytes(plans: list[list[list[HeadPlan]]], cost: TierBytes) -> int:
    """Bytes the tiers of ``plans`` hold (exact rows, positions, low-rank factors and bases: the tiered layer's
    bytes less its segment descriptors)."""
    return sum(cost.head(len(p.exact), len(p.mid), p.rank_k, p.rank_v) for layer in plans for row in layer for p in row)
