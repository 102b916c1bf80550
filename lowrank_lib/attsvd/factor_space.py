"""Decode attention in factor space: AttSVD without rebuilding K/V.

AttSVD stores the prompt bulk of every (layer, KV head) as post-RoPE factors
``K_b ~ A_K B_K`` and ``V_b ~ A_V B_V`` (and, in stream mode, frozen blocks factored the same way),
plus an exact recent window. The paper (Algorithm 1, line 25) re-materialises
``K_full = [A_K B_K; Recon(D_K); T_K]`` at every decode step: O(S r d) work per step per head.
Because the keys are factored AFTER RoPE, the logits and the output can be read straight from
the factors::

    scores_bulk = (q B_K^T) A_K^T * scale         [G q, r_K] x [r_K, S_b]  -> O(S_b r_K)
    out_bulk    = (p_bulk A_V) B_V                [G q, S_b] x [S_b, r_V]  -> O(S_b r_V + r_V d)

one softmax over ALL positions (bulk, blocks, window, in position order), so the result is the
same function as rebuild-then-attend up to float round-off. The query heads of a GQA group share
one set of factors, so each group is handled as one batched matmul with ``G * q_len`` query rows.

Layout (everything batched over KV heads; ``Hq = G * Hkv``; HF's grouping: query head ``h`` reads
KV head ``h // G``)::

    q      [B, Hq, q_len, d]
    a_k    [B, Hkv, n, r_K]   b_k [B, Hkv, r_K, d]     (B may be 1 in b_* to share a basis)
    a_v    [B, Hkv, n, r_V]   b_v [B, Hkv, r_V, d]
    k_win  [B, Hkv, w, d]     v_win [B, Hkv, w, d]
    mask   bool (True = attend) or additive float, broadcastable as [B, 1 | Hq, q_len, N]
    out    [B, Hq, q_len, d]

``N = sum(n_i) + w`` and the mask's last axis is in the same position order as
``FactorKV.segments`` followed by the window (bulk, then stream blocks oldest first, then window).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

ROUTES = ("dense", "rebuild", "factor")


# --------------------------------------------------------------------------- data layout
@dataclass
class LowRankKV:
    """Factors of one contiguous run of ``n`` positions for all KV heads of a layer.

    ``K ~ a_k @ b_k`` and ``V ~ a_v @ b_v``; shapes in the module docstring. Ranks may differ
    between K and V (the energy rule gives r_K << r_V) but are shared by the heads of a layer
    (a smaller per-head rank is zero-padded by the producer).
    """

    a_k: torch.Tensor  # [B, Hkv, n, r_K]
    b_k: torch.Tensor  # [B|1, Hkv, r_K, d]
    a_v: torch.Tensor  # [B, Hkv, n, r_V]
    b_v: torch.Tensor  # [B|1, Hkv, r_V, d]

    def __post_init__(self):
        for name in ("a_k", "b_k", "a_v", "b_v"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"LowRankKV.{name} must be a 4-D tensor [B, Hkv, ., .], got {shape}")
        ak, bk, av, bv = self.a_k, self.b_k, self.a_v, self.b_v
        if ak.shape[-1] != bk.shape[-2]:
            raise ValueError(f"LowRankKV: a_k {tuple(ak.shape)} [B, Hkv, n, r_K] and b_k {tuple(bk.shape)} "
                             f"[B, Hkv, r_K, d] disagree on r_K")
        if av.shape[-1] != bv.shape[-2]:
            raise ValueError(f"LowRankKV: a_v {tuple(av.shape)} [B, Hkv, n, r_V] and b_v {tuple(bv.shape)} "
                             f"[B, Hkv, r_V, d] disagree on r_V")
        if ak.shape[-2] != av.shape[-2]:
            raise ValueError(f"LowRankKV: a_k has {ak.shape[-2]} positions but a_v has {av.shape[-2]}")
        if bk.shape[-1] != bv.shape[-1]:
            raise ValueError(f"LowRankKV: b_k head dim {bk.shape[-1]} != b_v head dim {bv.shape[-1]}")
        if not (ak.shape[1] == bk.shape[1] == av.shape[1] == bv.shape[1]):
            raise ValueError(f"LowRankKV: KV-head axes differ: a_k {tuple(ak.shape)} b_k {tuple(bk.shape)} "
                             f"a_v {tuple(av.shape)} b_v {tuple(bv.shape)}")

    @property
    def length(self) -> int:
        return self.a_k.shape[-2]

    @property
    def rank_k(self) -> int:
        return self.a_k.shape[-1]

    @property
    def rank_v(self) -> int:
        return self.a_v.shape[-1]

    @property
    def head_dim(self) -> int:
        return self.b_k.shape[-1]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Re-materialised (K, V), each [B, Hkv, n, d] (the rebuild the factor route avoids)."""
        return self.a_k @ self.b_k, self.a_v @ self.b_v

    def nbytes(self) -> int:
        """Bytes of the stored factors (what a cache holds for this run)."""
        return sum(t.numel() * t.element_size() for t in (self.a_k, self.b_k, self.a_v, self.b_v))


@dataclass
class FactorKV:
    """Everything one decode step attends to, in position order: factored segments, then window.

    ``segments`` = [prompt bulk, stream block 1, ..., stream block m] (any may be absent);
    ``k_win`` / ``v_win`` [B, Hkv, w, d] hold the exact tokens (None or w = 0 when there are none).
    """

    segments: list[LowRankKV] = field(default_factory=list)
    k_win: torch.Tensor | None = None
    v_win: torch.Tensor | None = None

    def __post_init__(self):
        self.segments = [s for s in self.segments if s is not None and s.length > 0]
        if (self.k_win is None) != (self.v_win is None):
            raise ValueError("FactorKV: give both k_win and v_win, or neither")
        if self.k_win is not None:
            if self.k_win.dim() != 4 or self.k_win.shape != self.v_win.shape:
                raise ValueError(f"FactorKV: k_win {tuple(self.k_win.shape)} and v_win "
                                 f"{tuple(self.v_win.shape)} must both be [B, Hkv, w, d]")
            if self.k_win.shape[-2] == 0:
                self.k_win = self.v_win = None
        dims = {s.head_dim for s in self.segments} | ({self.k_win.shape[-1]} if self.k_win is not None else set())
        heads = {s.a_k.shape[1] for s in self.segments} | ({self.k_win.shape[1]} if self.k_win is not None else set())
        if len(dims) > 1 or len(heads) > 1:
            raise ValueError(f"FactorKV: parts disagree on head_dim {sorted(dims)} or KV heads {sorted(heads)}")
        if not dims:
            raise ValueError("FactorKV: nothing to attend to (no segments and no window)")

    @property
    def window(self) -> int:
        return 0 if self.k_win is None else self.k_win.shape[-2]

    @property
    def shape(self):
        """Not a tensor: a dense attention function that asks for ``key.shape`` gets a clear error."""
        raise TypeError("a FactorKV (factored AttSVD cache layer) reached a dense attention function: run the "
                        "model inside lowrank_lib.attsvd.factor_cache.factor_space(model) or decode_route(...)")

    @property
    def length(self) -> int:
        """N, the number of positions attended to."""
        return sum(s.length for s in self.segments) + self.window

    @property
    def head_dim(self) -> int:
        return self.k_win.shape[-1] if self.k_win is not None else self.segments[0].head_dim

    @property
    def kv_heads(self) -> int:
        return self.k_win.shape[1] if self.k_win is not None else self.segments[0].a_k.shape[1]

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) [B, Hkv, N, d] rebuilt and concatenated in position order (Algorithm 1, line 25)."""
        ks, vs = [], []
        for s in self.segments:
            k, v = s.dense()
            ks.append(k)
            vs.append(v)
        if self.k_win is not None:
            ks.append(self.k_win)
            vs.append(self.v_win)
        batch = max(t.shape[0] for t in ks)
        ks = [k.expand(batch, *k.shape[1:]) for k in ks]
        vs = [v.expand(batch, *v.shape[1:]) for v in vs]
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)

    def nbytes(self) -> int:
        """Stored bytes: factors of every segment + the exact window."""
        win = 0 if self.k_win is None else 2 * self.k_win.numel() * self.k_win.element_size()
        return sum(s.nbytes() for s in self.segments) + win


# --------------------------------------------------------------------------- helpers
def _group_queries(q: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, int]:
    """[B, Hq, q_len, d] -> ([B, Hkv, G * q_len, d], G): the rows that share one KV head."""
    if q.dim() != 4:
        raise ValueError(f"query must be [B, Hq, q_len, d], got {tuple(q.shape)}")
    b, hq, ql, d = q.shape
    if hq % kv_heads:
        raise ValueError(f"query has {hq} heads, not a multiple of the {kv_heads} KV heads")
    g = hq // kv_heads
    return q.reshape(b, kv_heads, g * ql, d), g


def _apply_mask(scores: torch.Tensor, mask: torch.Tensor | None, g: int, q_len: int) -> torch.Tensor:
    """Add ``mask`` (bool keep-mask or additive float, [B|1, 1|Hq, q_len, N]) to grouped ``scores``.

    scores: [B, Hkv, G * q_len, N] -> same shape, masked positions at the dtype's minimum.
    """
    if mask is None:
        return scores
    b, hkv, _, n = scores.shape
    if mask.dim() == 2:  # [B, N] padding mask
        mask = mask[:, None, None, :]
    if mask.dim() != 4 or mask.shape[-1] != n or mask.shape[-2] not in (1, q_len) \
            or mask.shape[1] not in (1, hkv * g) or mask.shape[0] not in (1, b):
        raise ValueError(f"attention mask has shape {tuple(mask.shape)}, expected [B|1, 1|{hkv * g}, "
                         f"1|{q_len}, {n}] for B={b}, {n} attended positions")
    heads = mask.shape[1]
    m = mask.expand(mask.shape[0], heads, q_len, n)
    m = m.reshape(mask.shape[0], hkv, g * q_len, n) if heads > 1 else m.reshape(mask.shape[0], 1, 1, q_len, n)
    s = scores if heads > 1 else scores.view(b, hkv, g, q_len, n)
    if m.dtype == torch.bool:
        s = s.masked_fill(~m, torch.finfo(s.dtype).min)
    else:
        s = s + m.to(s.dtype)
    return s.view(b, hkv, g * q_len, n)


def _finish(out: torch.Tensor, b: int, hq: int, q_len: int) -> torch.Tensor:
    """[B, Hkv, G * q_len, d] -> [B, Hq, q_len, d]."""
    return out.reshape(b, hq, q_len, out.shape[-1])


# --------------------------------------------------------------------------- the three routes
def factor_space_attention(q: torch.Tensor, kv: FactorKV, mask: torch.Tensor | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """Attention read straight from the factors: no K/V is ever rebuilt.

    Parameters
    ----------
    q : [B, Hq, q_len, d] post-RoPE queries (decode: q_len = 1).
    kv : the factored segments + exact window, in position order.
    mask : bool keep-mask or additive float, [B|1, 1|Hq, q_len, N] (N = ``kv.length``), or None.
    scale : logit scale, default 1/sqrt(d).

    Returns
    -------
    out : [B, Hq, q_len, d] in ``q``'s dtype. Softmax runs in fp32.

    Cost per step per KV head (q_len = 1, G query heads per KV head): scores
    ``G (r_K d + n r_K)``, output ``G (n r_V + r_V d)`` MACs per segment, vs ``n r d`` to rebuild.
    """
    b, hq, ql, d = q.shape
    if d != kv.head_dim:
        raise ValueError(f"query head_dim {d} != cached head_dim {kv.head_dim}")
    scale = d ** -0.5 if scale is None else scale
    qg, g = _group_queries(q * scale, kv.kv_heads)                     # [B, Hkv, G q, d]
    parts = [(qg @ s.b_k.mT) @ s.a_k.mT for s in kv.segments]          # [B, Hkv, G q, n_i]
    if kv.k_win is not None:
        parts.append(qg @ kv.k_win.mT)                                 # [B, Hkv, G q, w]
    bmax = max(p.shape[0] for p in parts)
    parts = [p.expand(bmax, *p.shape[1:]) for p in parts]
    scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [B, Hkv, G q, N]
    scores = _apply_mask(scores, mask, g, ql)
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out, off = None, 0
    for s in kv.segments:
        n = s.length
        o = (p[..., off:off + n] @ s.a_v) @ s.b_v                      # [B, Hkv, G q, d]
        out = o if out is None else out + o
        off += n
    if kv.k_win is not None:
        o = p[..., off:] @ kv.v_win
        out = o if out is None else out + o
    return _finish(out, b, hq, ql)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """Plain GQA attention over exact K/V, grouped the same way (the dense-KV route).

    q [B, Hq, q_len, d], k / v [B, Hkv, N, d], mask as in :func:`factor_space_attention`
    -> [B, Hq, q_len, d].
    """
    b, hq, ql, d = q.shape
    if k.dim() != 4 or k.shape != v.shape or k.shape[-1] != d:
        raise ValueError(f"dense_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, Hkv, N, {d}]")
    scale = d ** -0.5 if scale is None else scale
    qg, g = _group_queries(q * scale, k.shape[1])
    scores = _apply_mask(qg @ k.mT, mask, g, ql)
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return _finish(p @ v, b, hq, ql)


def rebuild_then_attend(q: torch.Tensor, kv: FactorKV, mask: torch.Tensor | None = None,
                        scale: float | None = None) -> torch.Tensor:
    """The AttSVD paper's decode: rebuild ``[A_K B_K; blocks; window]`` and V, then dense attention.

    Same arguments and result as :func:`factor_space_attention`; the reference it must match.
    """
    k, v = kv.dense()
    return dense_attention(q, k, v, mask, scale)


def attend(route: str, q: torch.Tensor, kv: FactorKV, mask: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    """Dispatch by route name: "factor" or "rebuild" (both read the same ``FactorKV``)."""
    if route == "factor":
        return factor_space_attention(q, kv, mask, scale)
    if route == "rebuild":
        return rebuild_then_attend(q, kv, mask, scale)
    raise ValueError(f"route must be 'factor' or 'rebuild' for a FactorKV, got {route!r}")


# --------------------------------------------------------------------------- cost model
@dataclass(frozen=True)
class StepCost:
    """Work of one decode step for one KV head (all G query heads of its group).

    flops : multiply-adds x 2 of the matmuls (softmax and masking are O(G N), counted in ``flops``
        as 5 per score).
    bytes_read : cache bytes the step must read (factors or K/V) + the intermediate K/V a rebuild
        writes and reads back + the scores/probabilities (fp32) written and read once.
    bytes_stored : persistent cache bytes of this head (the memory the route needs between steps).
    """

    route: str
    flops: int
    bytes_read: int
    bytes_stored: int

    def to_dict(self) -> dict:
        return {"route": self.route, "flops": self.flops, "bytes_read": self.bytes_read,
                "bytes_stored": self.bytes_stored}


def step_cost(route: str, context: int, head_dim: int, rank_k: int, rank_v: int | None = None,
              window: int = 0, group: int = 1, q_len: int = 1, dtype_bytes: int = 4,
              segments: list[tuple[int, int, int]] | None = None) -> StepCost:
    """FLOPs and bytes of one decode step per KV head for ``route`` in ("dense", "rebuild", "factor").

    Parameters
    ----------
    context : N, total attended positions (bulk + blocks + window).
    rank_k, rank_v : ranks of the bulk (rank_v defaults to rank_k).
    window : w, exact positions (the rest, N - w, is factored as ONE bulk unless ``segments`` is given).
    group : G query heads per KV head; ``q_len`` query rows each.
    segments : optional explicit factored runs ``[(n_i, r_K_i, r_V_i), ...]`` (stream blocks);
        their lengths plus ``window`` must equal ``context``.

    The dense route stores the full K/V (2 N d values); rebuild and factor store the same factors.
    """
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    rank_v = rank_k if rank_v is None else rank_v
    if segments is None:
        segments = [(context - window, rank_k, rank_v)] if context > window else []
    if sum(n for n, _, _ in segments) + window != context:
        raise ValueError(f"segments {segments} + window {window} do not add up to context {context}")
    d, rows, e = head_dim, group * q_len, dtype_bytes
    softmax_flops = 5 * rows * context
    score_bytes = 2 * 4 * rows * context  # fp32 scores written + read, probabilities likewise once
    dense_mm = 2 * 2 * rows * context * d  # q K^T and p V
    if route == "dense":
        stored = 2 * context * d * e
        return StepCost(route, dense_mm + softmax_flops, stored + score_bytes, stored)
    factor_vals = sum(n * (rk + rv) + d * (rk + rv) for n, rk, rv in segments)
    stored = (factor_vals + 2 * window * d) * e
    if route == "rebuild":
        rebuild = sum(2 * n * d * (rk + rv) for n, rk, rv in segments)
        rebuilt_kv = 2 * sum(n for n, _, _ in segments) * d * e  # written once, read back by attention
        return StepCost(route, rebuild + dense_mm + softmax_flops,
                        stored + 2 * rebuilt_kv + score_bytes, stored)
    fac = sum(2 * rows * (d * rk + n * rk + n * rv + rv * d) for n, rk, rv in segments)
    win = 2 * 2 * rows * window * d
    return StepCost(route, fac + win + softmax_flops, stored + score_bytes, stored)


def cost_table(contexts: list[int], head_dim: int, ranks: list[int], window: int = 0, group: int = 1,
               dtype_bytes: int = 4) -> list[dict]:
    """Rows {context, rank, route, flops, bytes_read, bytes_stored} for every combination.

    The dense route is rank-independent and appears once per context (``rank`` = head_dim).
    """
    rows = []
    for n in contexts:
        c = step_cost("dense", n, head_dim, head_dim, window=0, group=group, dtype_bytes=dtype_bytes)
        rows.append({"context": n, "rank": head_dim, **c.to_dict()})
        for r in ranks:
            for route in ("rebuild", "factor"):
                c = step_cost(route, n, head_dim, r, window=window, group=group, dtype_bytes=dtype_bytes)
                rows.append({"context": n, "rank": r, **c.to_dict()})
    return rows


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.detach().double(), b.detach().double()
    den = b.norm()
    num = (a - b).norm()
    return float(num / den) if den > 0 else float(num)


def factor_from_dense(k: torch.Tensor, v: torch.Tensor, rank_k: int, rank_v: int | None = None) -> LowRankKV:
    """Truncated-SVD factors of exact K/V [B, Hkv, n, d] (A = U S, B = Vh), fp32 SVD.

    A convenience for tests and benchmarks (the cache's own attention-aware factors are
    issue 5's; any A, B pair works with the routes above). Full rank reproduces K/V.
    """
    rank_v = rank_k if rank_v is None else rank_v

    def one(x, r):
        u, s, vh = torch.linalg.svd(x.float(), full_matrices=False)
        return (u[..., :r] * s[..., None, :r]).to(x.dtype), vh[..., :r, :].to(x.dtype)

    a_k, b_k = one(k, rank_k)
    a_v, b_v = one(v, rank_v)
    return LowRankKV(a_k, b_k, a_v, b_v)


__all__ = ["FactorKV", "LowRankKV", "ROUTES", "StepCost", "attend", "cost_table", "dense_attention",
           "factor_from_dense", "factor_space_attention", "rebuild_then_attend", "rel_err", "step_cost"]

