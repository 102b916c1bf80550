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

from dataclasses import dataclass, field

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


# ---------------------------------------------------------------------------------------------------- packed
@dataclass(eq=False)
class PackedRow:
    """One batch row's tiers of every KV head, packed flat (the layout :func:`attend_packed` reads).

    k_exact, v_exact [N_e, d]    every head's exact rows, head after head; head h owns rows e_off[h]:e_off[h+1]
    a_k, a_v [r, N_m] | Q8       every low-rank head's factor rows, head after head (m_off), stored RANK-MAJOR
                                 (transposed: the products q B_K^T A_K^T and p A_V read them contiguously,
                                 3-4x faster than [N_m, r] rows at r = 4 on the CPU)
    b_k, b_v [H_m, r, d]         the bases of the H_m heads that hold a low-rank tier (``mid_heads``)

    ``r`` is the largest rank of the row; a head of a smaller rank (a tier of fewer tokens than the rank) is
    zero-padded to it (zero columns of A, zero rows of B: the same products) and those padding bytes are counted
    in :attr:`nbytes`, as are the offsets and head ids. Positions stay in the heads' own tensors.
    """

    k_exact: torch.Tensor
    v_exact: torch.Tensor
    e_lo: torch.Tensor                    # [H, 1] long: first exact row of each head
    e_hi: torch.Tensor                    # [H, 1] long: one past its last
    a_k: torch.Tensor | Q8 | None = None
    a_v: torch.Tensor | Q8 | None = None
    b_k: torch.Tensor | None = None
    b_v: torch.Tensor | None = None
    m_lo: torch.Tensor | None = None      # [H_m, 1]
    m_hi: torch.Tensor | None = None
    mid_heads: torch.Tensor | None = None  # [H_m] long
    all_mid: bool = False                  # every head holds a low-rank tier (no column scatter)

    @property
    def nbytes(self) -> int:
        return _bytes(self.k_exact, self.v_exact, self.e_lo, self.e_hi, self.a_k, self.a_v, self.b_k, self.b_v,
                      self.m_lo, self.m_hi, self.mid_heads)


def _cat_rows(parts: list, r: int):
    """Concatenate [n_i, r_i] factor rows (tensors or Q8), zero-padding columns to ``r``, as [r, sum n_i]."""
    pad = lambda t: t if t.shape[1] == r else torch.nn.functional.pad(t, (0, r - t.shape[1]))
    if isinstance(parts[0], Q8):
        return Q8(torch.cat([pad(p.q) for p in parts]).T.contiguous(), torch.cat([p.scale for p in parts]))
    return torch.cat([pad(p) for p in parts]).T.contiguous()


def _offsets(counts: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    off = torch.tensor([0, *counts], device=device).cumsum(0)
    return off[:-1, None].clone(), off[1:, None].clone()          # two storages, each counted


def _rows_view(packed, lo: int, hi: int, r: int):
    """Rows lo:hi, ranks :r of rank-major factors, as an [n, r] view."""
    if isinstance(packed, Q8):
        return Q8(packed.q[:r, lo:hi].T, packed.scale[lo:hi])
    return packed[:r, lo:hi].T


def pack_row(row: list[HeadTiers]) -> PackedRow:
    """Pack one row's heads into a :class:`PackedRow`; each head's tensors become views of the packed ones
    (the ragged reference :func:`attend` still reads them; nothing is held twice)."""
    dev = row[0].k_exact.device
    ke, ve = torch.cat([h.k_exact for h in row]), torch.cat([h.v_exact for h in row])
    e_lo, e_hi = _offsets([h.n_exact for h in row], dev)
    pr = PackedRow(ke, ve, e_lo, e_hi)
    mids = [i for i, h in enumerate(row) if h.n_mid]
    if mids:
        hs = [row[i] for i in mids]
        r = max(max(h.rank_k, h.rank_v) for h in hs)
        padb = lambda b: b if b.shape[0] == r else torch.nn.functional.pad(b, (0, 0, 0, r - b.shape[0]))
        pr.a_k, pr.a_v = _cat_rows([h.a_k for h in hs], r), _cat_rows([h.a_v for h in hs], r)
        pr.b_k, pr.b_v = torch.stack([padb(h.b_k) for h in hs]), torch.stack([padb(h.b_v) for h in hs])
        pr.m_lo, pr.m_hi = _offsets([h.n_mid for h in hs], dev)
        pr.mid_heads = torch.tensor(mids, device=dev)
        pr.all_mid = len(mids) == len(row)
    lo = [int(x) for x in e_lo[:, 0]]
    for h, o in zip(row, lo):
        h.k_exact, h.v_exact = ke[o:o + h.n_exact], ve[o:o + h.n_exact]
    if mids:
        for j, (h, o) in enumerate(zip(hs, (int(x) for x in pr.m_lo[:, 0]))):
            n, rk, rv = h.n_mid, h.rank_k, h.rank_v
            h.a_k, h.a_v = _rows_view(pr.a_k, o, o + n, rk), _rows_view(pr.a_v, o, o + n, rv)
            h.b_k, h.b_v = pr.b_k[j, :rk], pr.b_v[j, :rv]
    return pr


@dataclass(eq=False)
class PackedLayer:
    """One layer's tiers packed per batch row (:func:`pack`), with the ragged heads (views of the same storage)."""

    heads: list[list[HeadTiers]]
    rows: list[PackedRow]
    #: some head holds no token in its tiers (then attention needs appended rows); set from ``heads``
    empty_head: bool = field(init=False)
    #: the most tokens (exact + low-rank) one row holds (host int); set from ``heads``
    max_row_tokens: int = field(init=False)

    def __post_init__(self):
        self.empty_head = any(h.n_exact + h.n_mid == 0 for row in self.heads for h in row)
        self.max_row_tokens = max(sum(h.n_exact + h.n_mid for h in row) for row in self.heads)

    @property
    def nbytes(self) -> int:
        """Bytes the layer holds: the packed tensors (padding, offsets and head ids included) + the positions."""
        pos = sum(_bytes(h.pos_exact, h.pos_mid) for row in self.heads for h in row)
        return sum(r.nbytes for r in self.rows) + pos


def pack(heads: list[list[HeadTiers]]) -> PackedLayer:
    """The packed layout of one layer's ragged tiers (built once, after the prefill)."""
    return PackedLayer(heads, [pack_row(row) for row in heads])


_NEG = float("-inf")
_AR: dict = {}


def _arange(n: int, device) -> torch.Tensor:
    """A shared [1, >= n] arange (grown, never shrunk), sliced to n: no per-step allocation of the index."""
    a = _AR.get(device)
    if a is None or a.shape[1] < n:
        a = _AR[device] = torch.arange(max(n, 2 * (0 if a is None else a.shape[1]), 4096), device=device)[None]
    return a[:, :n]


def _own(lo: torch.Tensor, hi: torch.Tensor, n: int) -> torch.Tensor:
    """[H, 1, n] bool: row n belongs to head h (contiguous segments lo[h] <= n < hi[h])."""
    ar = _arange(n, lo.device)
    return ((ar >= lo) & (ar < hi))[:, None]


def _attend_row(qr: torch.Tensor, pr: PackedRow, kn: torch.Tensor | None, vn: torch.Tensor | None,
                m: torch.Tensor | None, G: int, ql: int) -> torch.Tensor:
    """qr [H, M, d] (scaled; M = G * ql, rows g * ql + j) over one packed row -> [H, M, d]."""
    H, M, d = qr.shape
    qf = qr.reshape(H * M, d)
    parts = []
    ne = pr.k_exact.shape[0]
    if ne:
        se = (qf @ pr.k_exact.T).view(H, M, ne)                      # every head against every exact row
        parts.append(se.masked_fill_(~_own(pr.e_lo, pr.e_hi, ne), _NEG))
    nm = 0 if pr.a_k is None else pr.a_k.shape[1]
    if nm:
        Hm = pr.b_k.shape[0]
        qm = qr if pr.all_mid else qr.index_select(0, pr.mid_heads)
        qb = torch.bmm(qm, pr.b_k.transpose(1, 2)).view(Hm * M, -1)  # [H_m M, r]: q B_K^T
        a_k = pr.a_k
        if isinstance(a_k, Q8):
            sm = (qb @ a_k.q.to(qb.dtype)) * a_k.scale.to(qb.dtype)
        else:
            sm = qb @ a_k                                             # rank-major A_K: [r, N_m]
        sm = sm.view(Hm, M, nm).masked_fill_(~_own(pr.m_lo, pr.m_hi, nm), _NEG)
        if not pr.all_mid:
            sm = qr.new_full((H, M, nm), _NEG).index_copy_(0, pr.mid_heads, sm)
        parts.append(sm)
    t = 0 if kn is None else kn.shape[-2]
    if t:
        sn = torch.bmm(qr, kn.transpose(1, 2))                       # [H, M, t]
        if m is not None:
            sn4 = sn.view(H, G, ql, t)
            sn = (sn4.masked_fill(~m, _NEG) if m.dtype == torch.bool else sn4 + m.to(sn.dtype)).view(H, M, t)
        parts.append(sn)
    if not parts:
        raise ValueError("composed attention: a row holds no token")
    s = torch.cat(parts, -1) if len(parts) > 1 else parts[0]
    p = torch.softmax(s, -1, dtype=torch.float32).to(qr.dtype)      # [H, M, N]; a head with no token: NaN
    o = None
    if ne:
        o = (p[..., :ne].reshape(H * M, ne) @ pr.v_exact).view(H, M, d)
    if nm:
        pm = p[..., ne:ne + nm]
        pm = pm if pr.all_mid else pm.index_select(0, pr.mid_heads)
        pm = pm.reshape(-1, nm)
        a_v = pr.a_v
        pa = (pm * a_v.scale.to(pm.dtype)) @ a_v.q.to(pm.dtype).T if isinstance(a_v, Q8) else pm @ a_v.T
        om = torch.bmm(pa.view(pr.b_v.shape[0], M, -1), pr.b_v)      # [H_m, M, d]: (p A_V) B_V
        if pr.all_mid:
            o = om if o is None else o + om
        else:
            o = (qr.new_zeros(H, M, d) if o is None else o).index_add_(0, pr.mid_heads, om)
    if t:
        on = torch.bmm(p[..., ne + nm:], vn)
        o = on if o is None else o + on
    return o


def attend_packed(q: torch.Tensor, layer: PackedLayer, k_new: torch.Tensor | None, v_new: torch.Tensor | None,
                  scale: float | None = None, new_mask: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`attend` over the packed layout: per batch row, every head at once (one GEMM against all exact rows,
    the low-rank products batched over heads, one softmax), a head's rows masked for the others' queries.

    Exact (the same sums as the ragged :func:`attend`, in another order); the price is H x the score and
    value products of the exact and low-rank rows (each head's queries meet every head's rows and are masked),
    against one Python-level group of small ops per head. Same arguments and result as :func:`attend`.
    """
    B, Hq, ql, d = q.shape
    H = layer.rows[0].e_lo.shape[0]
    G = Hq // H
    scale = d ** -0.5 if scale is None else scale
    t = 0 if k_new is None else k_new.shape[-2]
    if t == 0 and layer.empty_head:
        raise ValueError("composed attention: a head holds no token")
    outs = []
    for b, pr in enumerate(layer.rows):
        m = None if new_mask is None else new_mask[min(b, new_mask.shape[0] - 1), 0]
        m = _new_mask(ql, t, m, q.device)
        qr = (q[b] * scale).view(H, G * ql, d)
        o = _attend_row(qr, pr, k_new[b] if t else None, v_new[b] if t else None, m, G, ql)
        outs.append(o.view(Hq, ql, d))
    return torch.stack(outs) if B > 1 else outs[0][None]


#: held tokens per head (exact + low-rank, the row's mean) up to which :func:`attend_layer` reads the packed
#: layout with every head at once; above it the per-head loop's H-fold saving in products outweighs its Python
#: cost (crossover measured on SmolLM2's shapes, d = 64, 3 KV heads x 3 queries, 1-2 CPU threads: ~300-700).
PACKED_MAX_PER_HEAD = 512

ATTEND_MODES = ("auto", "packed", "ragged")


def attend_layer(q: torch.Tensor, layer: PackedLayer, k_new, v_new, scale: float | None = None,
                 new_mask: torch.Tensor | None = None, mode: str = "auto") -> torch.Tensor:
    """The decode attention of one packed layer: ``"packed"`` (:func:`attend_packed`), ``"ragged"`` (the per-head
    reference :func:`attend` over the same storage) or ``"auto"`` (packed while the layer holds at most
    :data:`PACKED_MAX_PER_HEAD` tokens per head, the row's mean, else ragged). All three are exact."""
    if mode == "auto":
        H = layer.rows[0].e_lo.shape[0]
        mode = "packed" if layer.max_row_tokens <= PACKED_MAX_PER_HEAD * H else "ragged"
    if mode == "packed":
        return attend_packed(q, layer, k_new, v_new, scale, new_mask)
    if mode == "ragged":
        return attend(q, layer.heads, k_new, v_new, scale, new_mask)
    raise ValueError(f"unknown composed attention mode {mode!r}; choose from {ATTEND_MODES}")
