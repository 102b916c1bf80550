"""The tiered KV of one layer: per (batch row, KV head) an exact tier, a low-rank tier and nothing else.

    exact tier   k_exact, v_exact [n_e, d]                 the most important tokens, exact
    low-rank     a_k [n_m, r_K]  b_k [r_K, d]              K_mid ~ a_k @ b_k (post-RoPE, like AttSVD)
                 a_v [n_m, r_V]  b_v [r_V, d]              V_mid ~ a_v @ b_v
                 (a_* optionally int8 with one fp16 scale per token row: :class:`Q8`)
    positions    pos_exact [n_e], pos_mid [n_m]            int16 / int32 (the smallest that holds S)
    dropped      everything else: not stored

Counts and ranks differ per (row, head): the storage is ragged (one small tensor set per head), so the
bytes held are exactly the bytes of the tensors above (:attr:`HeadTiers.nbytes`, positions included).
Tokens appended after the prefill (decode / continuation) are held exactly per layer, [B, H, t, d].

:func:`attend` is the decode attention: exact rows, the low-rank tier read in factor space
(``(q B_K^T) A_K^T`` and ``(p A_V) B_V``, AttSVD's factor-space attention) and the appended rows, under ONE
softmax per query row. Compressed tiers are all in the past of every query (no mask); the appended rows
take a bottom-right aligned causal mask. Batch rows are attended one by one (ragged).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attsvd.kv import LowRankKV


@dataclass
class Q8:
    """int8 rows with one scale each: ``x ~ q * scale[:, None]`` (q [n, r] int8, scale [n] fp16)."""

    q: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def quantize(x: torch.Tensor) -> "Q8":
        amax = x.abs().amax(-1).float()
        scale = (amax / 127.0).clamp_min(torch.finfo(torch.float16).tiny)
        dt = torch.float16 if float(scale.max()) < 6e4 else torch.float32
        scale = scale.to(dt)
        q = torch.round(x.float() / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
        return Q8(q, scale)

    def dequant(self, dtype=torch.float32) -> torch.Tensor:
        return self.q.to(dtype) * self.scale.to(dtype)[:, None]

    @property
    def shape(self):
        return self.q.shape

    @property
    def nbytes(self) -> int:
        return _bytes(self.q, self.scale)


def _bytes(*ts) -> int:
    out = 0
    for t in ts:
        if isinstance(t, Q8):
            out += t.nbytes
        elif t is not None:
            out += t.numel() * t.element_size()
    return out


@dataclass(eq=False)
class HeadTiers:
    """One (batch row, KV head): exact tier, low-rank tier (or none), kept positions."""

    k_exact: torch.Tensor                 # [n_e, d]
    v_exact: torch.Tensor
    pos_exact: torch.Tensor               # [n_e] int16 / int32
    a_k: torch.Tensor | Q8 | None = None  # [n_m, r_K]
    b_k: torch.Tensor | None = None       # [r_K, d]
    a_v: torch.Tensor | Q8 | None = None
    b_v: torch.Tensor | None = None
    pos_mid: torch.Tensor | None = None   # [n_m]

    @property
    def n_exact(self) -> int:
        return self.k_exact.shape[0]

    @property
    def n_mid(self) -> int:
        return 0 if self.a_k is None else self.a_k.shape[0]

    @property
    def rank_k(self) -> int:
        return 0 if self.b_k is None else self.b_k.shape[0]

    @property
    def rank_v(self) -> int:
        return 0 if self.b_v is None else self.b_v.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of every tensor this head holds (positions included)."""
        return _bytes(self.k_exact, self.v_exact, self.pos_exact, self.a_k, self.b_k, self.a_v, self.b_v, self.pos_mid)

    def mid_factors(self, dtype=None) -> tuple[torch.Tensor, ...] | None:
        """(a_k, b_k, a_v, b_v) as float tensors (int8 rows dequantised), or None."""
        if self.a_k is None:
            return None
        dtype = dtype or self.b_k.dtype
        deq = lambda a: a.dequant(dtype) if isinstance(a, Q8) else a
        return deq(self.a_k), self.b_k, deq(self.a_v), self.b_v

    def lowrank(self) -> LowRankKV:
        """This head as the library's low-rank type (B = H = 1): the low-rank run, then the exact rows."""
        f = self.mid_factors()
        runs = [] if f is None else [tuple(t[None, None] for t in f)]
        return LowRankKV(runs, self.k_exact[None, None], self.v_exact[None, None])

    def dense(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(K, V [n, d], positions [n] long) of every kept token, sorted by position (rebuilt low-rank rows)."""
        k, v, p = self.k_exact, self.v_exact, self.pos_exact.long()
        f = self.mid_factors(self.k_exact.dtype)
        if f is not None:
            k = torch.cat([k, f[0] @ f[1]])
            v = torch.cat([v, f[2] @ f[3]])
            p = torch.cat([p, self.pos_mid.long()])
        order = p.argsort()
        return k[order], v[order], p[order]


def tiers_nbytes(heads: list[list[HeadTiers]]) -> int:
    return sum(h.nbytes for row in heads for h in row)


def _new_mask(q_len: int, n_new: int, mask: torch.Tensor | None, device) -> torch.Tensor | None:
    """Keep-mask [q_len, n_new] of the appended rows (the last q_len of them are the queries themselves)."""
    if n_new == 0:
        return None
    if mask is not None:
        return mask
    if q_len == 1:
        return None
    return torch.ones(q_len, n_new, dtype=torch.bool, device=device).tril(n_new - q_len)


def attend(q: torch.Tensor, heads: list[list[HeadTiers]], k_new: torch.Tensor | None, v_new: torch.Tensor | None,
           scale: float | None = None, new_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of ``q`` [B, Hq, q_len, d] over the tiers + the appended rows k_new / v_new [B, H, t, d].

    new_mask : optional keep-mask (bool) or additive mask, [B|1, 1, q_len, t], over the appended rows
    (default: causal, the queries being the newest q_len of them). Returns [B, Hq, q_len, d] (q's dtype);
    softmax in fp32.
    """
    B, Hq, ql, d = q.shape
    H = len(heads[0])
    G = Hq // H
    scale = d ** -0.5 if scale is None else scale
    t = 0 if k_new is None else k_new.shape[-2]
    out = torch.empty_like(q)
    for b in range(B):
        m = None if new_mask is None else new_mask[min(b, new_mask.shape[0] - 1), 0]
        m = _new_mask(ql, t, m, q.device)
        if m is not None:
            m = m.repeat(G, 1)                                            # rows g * q_len + j
        for h, ht in enumerate(heads[b]):
            qh = q[b, h * G:(h + 1) * G].reshape(G * ql, d) * scale      # [G q, d]
            parts = []
            if ht.n_exact:
                parts.append(qh @ ht.k_exact.T)
            if ht.n_mid:
                qb = qh @ ht.b_k.T                                        # [G q, r_K]
                a_k = ht.a_k
                parts.append((qb @ a_k.q.T.to(qb.dtype)) * a_k.scale.to(qb.dtype) if isinstance(a_k, Q8)
                             else qb @ a_k.T)
            if t:
                sn = qh @ k_new[b, h].T                                   # [G q, t]
                if m is not None:
                    sn = sn.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else sn + m.to(sn.dtype)
                parts.append(sn)
            if not parts:
                raise ValueError(f"composed attention: head {h} of row {b} holds no token")
            p = torch.softmax(torch.cat(parts, -1) if len(parts) > 1 else parts[0], -1, dtype=torch.float32)
            p = p.to(q.dtype)
            o, off = None, 0
            if ht.n_exact:
                o = p[:, :ht.n_exact] @ ht.v_exact
                off = ht.n_exact
            if ht.n_mid:
                pm = p[:, off:off + ht.n_mid]
                a_v = ht.a_v
                pa = (pm * a_v.scale.to(pm.dtype)) @ a_v.q.to(pm.dtype) if isinstance(a_v, Q8) else pm @ a_v
                om = pa @ ht.b_v
                o = om if o is None else o + om
                off += ht.n_mid
            if t:
                on = p[:, off:] @ v_new[b, h]
                o = on if o is None else o + on
            out[b, h * G:(h + 1) * G] = o.view(G, ql, d)
    return out
