"""The tiered KV of one layer: the ONE state every KV method fits, and its attention.

A layer holds, per segment ``s = b * H + h`` (batch row b, KV head h; positions are post-RoPE, so attention
never needs them):

    exact rows     k_exact, v_exact [N_e, d]       rows e_off[s] : e_off[s + 1] are segment s's, oldest first;
                   k_exact may be BLOCKED (:meth:`TieredLayer.block_exact_k`, 16-bit rows for the fused kernel):
                   [N_e / 16, d / 2, 16, 2], block b holding rows 16b .. 16b + 15 with each dim pair of its 16 rows
                   contiguous, so a query's 16 scores are one vector product per dim pair (no transpose);
                   :meth:`TieredLayer.exact_k` reads rows back from either layout
    low-rank runs  run j = row j of ``runs`` [R, 9] (sorted by segment; segment s owns runs r_off[s] : r_off[s + 1])
                   K_j ~ A_K,j B_K,j    A_K,j [n_j, r_k,j] stored RANK-MAJOR, an [r_k,j, n_j] block of the flat a_k at
                                        a_k_off_j; B_K,j [r_k,j, d] a block of the flat b_k at b_k_off_j
                   V_j ~ A_V,j B_V,j    likewise in a_v / b_v
                   int8 factors (``quant8``): a_k / a_v int8, one scale per token row (k_scale / v_scale [sum n_j] at
                   tok_off_j, fp16, or fp32 when a scale does not fit fp16)
    appended rows  k_new, v_new [B, H, cap, d]: rows [0, n_new) are the tokens appended after the prefill, exact
    positions      pos_exact [N_e] / pos_mid [sum n_j] (int16 / int32) where the method keeps them (which tokens were
                   kept: the notebooks read them; counted in the bytes), else None

Rank-major factors let the products ``(q B_K^T) A_K`` and ``p A_V^T`` read contiguous token rows (SIMD over
tokens). ``nbytes`` is every tensor held (descriptors, positions and scales included) with the appended rows
counted as written; ``allocated_nbytes`` counts the appended capacity instead.

Attention (:func:`attend`): per segment, ONE softmax (fp32) over the exact rows, every run in factor space and
the appended rows (causal among the newest ``q_len`` of them). :func:`attend_portable` defines the result;
a fused kernel (``runtime/kernels``, ``lrk_tiers``) is chosen by :func:`select_backend` and must match it. Each
backend declares what it can do in :data:`BACKENDS`; callers read those fields.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..runtime.kernels import build as kernel_build
from ..runtime.kernels import ops as kernel_ops
from ..runtime.kv import Backend, BackendCaps, BackendChoice, select

#: columns of ``TieredLayer.runs``
SEG, N, RK, RV, AK_OFF, AV_OFF, TOK_OFF, BK_OFF, BV_OFF = range(9)


def descriptor_nbytes(segments: int, runs: int) -> int:
    """Bytes of a layer's descriptors (e_off and r_off [segments + 1], runs [runs, 9], int64): held bytes too."""
    return 8 * (2 * (segments + 1) + 9 * runs)
NEG = float("-inf")


@dataclass(eq=False)
class Run:
    """One low-rank run of one segment, as a method produces it (row-major factors, floating point)."""

    a_k: torch.Tensor                     # [n, r_k]
    b_k: torch.Tensor                     # [r_k, d]
    a_v: torch.Tensor                     # [n, r_v]
    b_v: torch.Tensor                     # [r_v, d]
    pos: torch.Tensor | None = None       # [n] positions (or None: not kept)


@dataclass(eq=False)
class Segment:
    """One (batch row, KV head) as a method produces it: exact rows (oldest first) and low-rank runs."""

    k: torch.Tensor                       # [n_e, d]
    v: torch.Tensor                       # [n_e, d]
    pos: torch.Tensor | None = None       # [n_e]
    runs: list[Run] = field(default_factory=list)


def quantize_rows(x: torch.Tensor, scale_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, r] -> (int8 [n, r], scale [n]) with x ~ q * scale: scale = max|row| / 127 (a zero row: the smallest
    fp16 normal; a rank-0 run has only zero rows), rounded to nearest, clamped to [-127, 127]."""
    amax = x.abs().amax(-1).float() if x.shape[-1] else x.new_zeros(x.shape[0], dtype=torch.float32)   # rank 0: no columns
    scale = (amax / 127.0).clamp_min(torch.finfo(torch.float16).tiny).to(scale_dtype)
    q = torch.round(x.float() / scale.float()[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def bucket_size(n: int, steps: int = 8) -> int:
    """``n`` rounded up to the next of ``2^k (1 + j / steps)`` (at most 1 / steps more than n, and at least
    ``steps``; 0 stays 0)."""
    if n <= steps:
        return min(n, 1) * steps
    base = 1 << (n.bit_length() - 1)                      # 2^k <= n
    step = base // steps
    return -(-n // step) * step


def scale_dtype_for(runs: list[Run]) -> torch.dtype:
    """fp16 scales unless some row's scale would overflow fp16 (then fp32 for the layer)."""
    amax = max((float(t.abs().max()) for r in runs for t in (r.a_k, r.a_v) if t.numel()), default=0.0)
    return torch.float16 if amax / 127.0 < 6e4 else torch.float32


@dataclass(eq=False)
class TieredLayer:
    """One layer's tiered KV (see the module docstring for the layout)."""

    B: int
    H: int
    d: int
    k_exact: torch.Tensor                 # [N_e, d], or blocked [N_e / 16, d / 2, 16, 2] (block_exact_k)
    v_exact: torch.Tensor                 # [N_e, d]
    e_off: torch.Tensor                   # [B * H + 1] int64
    runs: torch.Tensor                    # [R, 9] int64
    r_off: torch.Tensor                   # [B * H + 1] int64
    a_k: torch.Tensor                     # flat rank-major factor blocks (dtype, or int8)
    a_v: torch.Tensor
    b_k: torch.Tensor                     # flat basis blocks
    b_v: torch.Tensor
    k_scale: torch.Tensor | None = None   # [sum n_j] (int8 factors)
    v_scale: torch.Tensor | None = None
    pos_exact: torch.Tensor | None = None
    pos_mid: torch.Tensor | None = None
    k_new: torch.Tensor | None = None     # [B, H, cap, d]
    v_new: torch.Tensor | None = None
    n_new: int = 0                        # appended rows written (host count)
    pad_nbytes: int = 0                   # bytes of bucket padding past the fitted extents (allocated, not held)
    info: list[dict] = field(default_factory=list)   # per batch row: what the method reports of its fit (not held)
    #: host copies of the descriptors (the portable path slices with them; the kernel reads the device ones)
    host_e_off: list[int] = field(default_factory=list)
    host_runs: list[list[int]] = field(default_factory=list)
    host_r_off: list[int] = field(default_factory=list)

    # ------------------------------------------------------------------ construction
    @staticmethod
    def build(segments: list[list[Segment]], quant8: bool = False, dtype: torch.dtype | None = None,
              device=None) -> "TieredLayer":
        """Pack ``segments`` [B][H] into one layer (``quant8``: int8 factors, one scale per token row)."""
        B, H = len(segments), len(segments[0])
        first = segments[0][0].k
        d = first.shape[-1]
        dtype = dtype or first.dtype
        device = device or first.device
        segs = [s for row in segments for s in row]
        if any(len(row) != H for row in segments):
            raise ValueError("TieredLayer.build: every batch row needs the same number of KV heads")
        ne = [s.k.shape[0] for s in segs]
        e_off = [0]
        for n in ne:
            e_off.append(e_off[-1] + n)
        k_exact = torch.cat([s.k.to(dtype) for s in segs]) if e_off[-1] else torch.zeros(0, d, dtype=dtype, device=device)
        v_exact = torch.cat([s.v.to(dtype) for s in segs]) if e_off[-1] else torch.zeros(0, d, dtype=dtype, device=device)
        all_runs = [(i, r) for i, s in enumerate(segs) for r in s.runs]
        sdt = scale_dtype_for([r for _, r in all_runs]) if quant8 else None
        desc, r_off = [], [0] * (len(segs) + 1)
        ak, av, bk, bv, ks, vs, pm = [], [], [], [], [], [], []
        o_ak = o_av = o_tok = o_bk = o_bv = 0
        for i, r in all_runs:
            n, rk, rv = r.a_k.shape[0], r.b_k.shape[0], r.b_v.shape[0]
            if r.a_k.shape[1] != rk or r.a_v.shape[1] != rv or r.a_v.shape[0] != n:
                raise ValueError(f"TieredLayer.build: run of segment {i}: a_k {tuple(r.a_k.shape)}, b_k "
                                 f"{tuple(r.b_k.shape)}, a_v {tuple(r.a_v.shape)}, b_v {tuple(r.b_v.shape)} disagree")
            desc.append([i, n, rk, rv, o_ak, o_av, o_tok, o_bk, o_bv])
            r_off[i + 1] += 1
            if quant8:
                qk, sk = quantize_rows(r.a_k, sdt)
                qv, sv = quantize_rows(r.a_v, sdt)
                ak.append(qk.T.reshape(-1))
                av.append(qv.T.reshape(-1))
                ks.append(sk)
                vs.append(sv)
            else:
                ak.append(r.a_k.to(dtype).T.reshape(-1))
                av.append(r.a_v.to(dtype).T.reshape(-1))
            bk.append(r.b_k.to(dtype).reshape(-1))
            bv.append(r.b_v.to(dtype).reshape(-1))
            if r.pos is not None:
                pm.append(r.pos)
            o_ak, o_av, o_tok, o_bk, o_bv = o_ak + rk * n, o_av + rv * n, o_tok + n, o_bk + rk * d, o_bv + rv * d
        for i in range(len(segs)):
            r_off[i + 1] += r_off[i]
        fdt = torch.int8 if quant8 else dtype
        cat = lambda ts, dt: torch.cat(ts) if ts else torch.zeros(0, dtype=dt, device=device)
        pe = [s.pos for s in segs]
        if all(p is None for p in pe):
            pos_exact = None
        elif any(p is None for p in pe):
            raise ValueError("TieredLayer.build: give exact positions for every segment or for none")
        else:
            pos_exact = cat(pe, pe[0].dtype)
        if pm and len(pm) != len(all_runs):
            raise ValueError("TieredLayer.build: give run positions for every run or for none")
        long = lambda xs: torch.tensor(xs, dtype=torch.long, device=device)
        return TieredLayer(
            B, H, d, k_exact, v_exact, long(e_off), long(desc).view(-1, 9), long(r_off), cat(ak, fdt), cat(av, fdt),
            cat(bk, dtype), cat(bv, dtype), cat(ks, sdt) if quant8 else None, cat(vs, sdt) if quant8 else None,
            pos_exact, cat(pm, pm[0].dtype) if pm else None, host_e_off=e_off, host_runs=desc, host_r_off=r_off)

    # ------------------------------------------------------------------ sizes
    @property
    def quant8(self) -> bool:
        return self.a_k.dtype == torch.int8

    @property
    def dtype(self) -> torch.dtype:
        return self.k_exact.dtype

    def _stored(self) -> list[torch.Tensor]:
        return [t for t in (self.k_exact, self.v_exact, self.e_off, self.runs, self.r_off, self.a_k, self.a_v,
                            self.b_k, self.b_v, self.k_scale, self.v_scale, self.pos_exact, self.pos_mid)
                if t is not None]

    @property
    def tier_nbytes(self) -> int:
        """Bytes of the fitted tiers: every tensor (descriptors, scales, positions included), no appended rows and
        no bucket padding (:meth:`pad_to_buckets`)."""
        return sum(t.numel() * t.element_size() for t in self._stored()) - self.pad_nbytes

    def appended_nbytes(self, n: int) -> int:
        """Bytes of ``n`` appended rows (every row and head, K and V)."""
        return 2 * self.B * self.H * n * self.d * self.k_exact.element_size()

    @property
    def nbytes(self) -> int:
        """Bytes held: the tiers + the appended rows written."""
        return self.tier_nbytes + self.appended_nbytes(self.n_new)

    @property
    def allocated_nbytes(self) -> int:
        """:attr:`nbytes` with the appended rows' whole capacity instead of the rows written."""
        cap = 0 if self.k_new is None else self.k_new.shape[2]
        return self.tier_nbytes + self.pad_nbytes + self.appended_nbytes(cap)

    def counts(self) -> dict:
        """Tokens per tier summed over segments (exact, low-rank) and the appended rows."""
        return {"exact": self.host_e_off[-1], "mid": sum(r[N] for r in self.host_runs),
                "appended": self.n_new * self.B * self.H}

    def segment_counts(self) -> tuple[list[int], list[int]]:
        """Per segment: exact rows, low-rank rows."""
        S = self.B * self.H
        e = [self.host_e_off[s + 1] - self.host_e_off[s] for s in range(S)]
        m = [sum(r[N] for r in self.host_runs[self.host_r_off[s]:self.host_r_off[s + 1]]) for s in range(S)]
        return e, m

    def ranks(self) -> list[tuple[int, int]]:
        """(r_k, r_v) of every run, in run order."""
        return [(r[RK], r[RV]) for r in self.host_runs]

    def shape_key(self, layout: bool = False) -> tuple:
        """Every shape the attention reads (a compiled step specialises on them); ``layout``: the host descriptors
        too (a reader that slices with host ints bakes them into a capture: a new layout must re-capture)."""
        key = (self.B, self.H, self.d, tuple(self.k_exact.shape), tuple(self.runs.shape), tuple(self.a_k.shape),
               tuple(self.a_v.shape), tuple(self.b_k.shape), tuple(self.b_v.shape),
               None if self.k_new is None else tuple(self.k_new.shape), str(self.a_k.dtype))
        return key + (tuple(self.host_e_off), tuple(map(tuple, self.host_runs))) if layout else key

    def pad_to_buckets(self, bucket=None) -> None:
        """Round every stored buffer's length up to ``bucket(n)`` (default :func:`bucket_size`) with zeros past the
        fitted extents, which no descriptor references: requests whose layers round alike share one compiled /
        captured step under a reader of device-side descriptors (the fused kernel). The padding is allocated, not
        held (:attr:`pad_nbytes`)."""
        bucket = bucket or bucket_size
        grow = lambda t, n: torch.cat([t, t.new_zeros((n - t.shape[0], *t.shape[1:]))]) if n > t.shape[0] else t
        added = 0
        for name in ("k_exact", "v_exact", "runs", "a_k", "a_v", "b_k", "b_v", "k_scale", "v_scale"):
            t = getattr(self, name)
            if t is None:
                continue
            g = grow(t, bucket(t.shape[0]))
            added += (g.numel() - t.numel()) * t.element_size()
            setattr(self, name, g)
        self.pad_nbytes += added

    # ------------------------------------------------------------------ the exact K layout
    @property
    def k_blocked(self) -> bool:
        """Whether ``k_exact`` is blocked (:meth:`block_exact_k`)."""
        return self.k_exact.dim() == 4

    def block_exact_k(self) -> bool:
        """Store the exact keys blocked for the fused kernel: [N_e / 16, d / 2, 16, 2], block b = rows 16b .. 16b + 15,
        the pair of dims (2j, 2j + 1) of its 16 rows one 64-byte vector. The kernel's scores of 16 rows for a query
        are then d / 2 vector dot products against the query's pairs, where rows need d / 32 per row plus a
        transpose-add per 16 rows; on the AMD EPYC (Zen 4) host the scores loop was the larger half of the tier
        kernel's time (kernels/tiers.cpp, blk_scores). 16-bit rows only (an fp32 row has no pairs to pack); the rows
        are padded with zeros to a multiple of 16 (allocated, not held). Returns whether the keys are blocked."""
        if self.k_blocked:
            return True
        if self.k_exact.element_size() != 2 or self.d % 2:
            return False
        n, d = self.k_exact.shape
        nb = -(-n // 16)
        k = self.k_exact
        if nb * 16 > n:
            k = torch.cat([k, k.new_zeros(nb * 16 - n, d)])
            self.pad_nbytes += (nb * 16 - n) * d * k.element_size()
        self.k_exact = k.view(nb, 16, d // 2, 2).transpose(1, 2).contiguous()
        return True

    def exact_k(self, lo: int = 0, hi: int | None = None) -> torch.Tensor:
        """Exact key rows [lo, hi) as [hi - lo, d] from either layout (a copy when blocked)."""
        if not self.k_blocked:
            return self.k_exact[lo:hi]
        hi = 16 * self.k_exact.shape[0] if hi is None else hi
        if hi <= lo:
            return self.k_exact.new_zeros(0, self.d)
        b0, b1 = lo // 16, -(-hi // 16)
        rows = self.k_exact[b0:b1].transpose(1, 2).reshape(-1, self.d)
        return rows[lo - 16 * b0:hi - 16 * b0]

    # ------------------------------------------------------------------ reading one segment
    def run_factors(self, j: int, dtype: torch.dtype | None = None):
        """Run j as float factors (A_K [n, r_k], B_K [r_k, d], A_V [n, r_v], B_V [r_v, d]), int8 dequantised."""
        seg, n, rk, rv, oak, oav, otok, obk, obv = self.host_runs[j]
        dtype = dtype or self.dtype
        a_k = self.a_k[oak:oak + rk * n].view(rk, n).T
        a_v = self.a_v[oav:oav + rv * n].view(rv, n).T
        if self.quant8:
            a_k = a_k.to(dtype) * self.k_scale[otok:otok + n].to(dtype)[:, None]
            a_v = a_v.to(dtype) * self.v_scale[otok:otok + n].to(dtype)[:, None]
        return a_k, self.b_k[obk:obk + rk * self.d].view(rk, self.d), a_v, self.b_v[obv:obv + rv * self.d].view(rv, self.d)

    def segment(self, s: int) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """(exact K [n_e, d], exact V, run indices) of segment ``s``."""
        lo, hi = self.host_e_off[s], self.host_e_off[s + 1]
        return self.exact_k(lo, hi), self.v_exact[lo:hi], list(range(self.host_r_off[s], self.host_r_off[s + 1]))

    def dense(self, s: int, n_new: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every row segment ``s`` holds, rebuilt (exact, then runs, then the first ``n_new`` appended rows, default
        all written) [n, d]."""
        n_new = self.n_new if n_new is None else n_new
        k, v, js = self.segment(s)
        ks, vs = [k], [v]
        for j in js:
            a_k, b_k, a_v, b_v = self.run_factors(j)
            ks.append(a_k @ b_k)
            vs.append(a_v @ b_v)
        if n_new:
            b, h = divmod(s, self.H)
            ks.append(self.k_new[b, h, :n_new])
            vs.append(self.v_new[b, h, :n_new])
        return torch.cat(ks), torch.cat(vs)

    def to_segments(self) -> list[list[Segment]]:
        """The layer as segments again: exact rows followed by the appended rows (oldest first), runs with float
        factors (int8 dequantised), positions as held. A method that reshapes its state (AttSVD's stream mode)
        edits these and :meth:`replace_with` a new build."""
        if self.n_new and self.pos_exact is not None:
            raise ValueError("TieredLayer.to_segments: the appended rows have no stored positions to fold in")
        out = []
        for b in range(self.B):
            row = []
            for h in range(self.H):
                s = b * self.H + h
                k, v, js = self.segment(s)
                if self.n_new:
                    k, v = torch.cat([k, self.k_new[b, h, :self.n_new]]), torch.cat([v, self.v_new[b, h, :self.n_new]])
                lo, hi = self.host_e_off[s], self.host_e_off[s + 1]
                pos = None if self.pos_exact is None else self.pos_exact[lo:hi]
                runs = []
                for j in js:
                    n, otok = self.host_runs[j][N], self.host_runs[j][TOK_OFF]
                    runs.append(Run(*self.run_factors(j), None if self.pos_mid is None else self.pos_mid[otok:otok + n]))
                row.append(Segment(k, v, pos, runs))
            out.append(row)
        return out

    #: the buffers the attention streams every decode step (what :meth:`place` moves)
    STREAMED = ("k_exact", "v_exact", "a_k", "a_v", "b_k", "b_v", "k_scale", "v_scale", "k_new", "v_new")

    def place(self, zeros) -> None:
        """Move every buffer the attention streams (:attr:`STREAMED`) into tensors from ``zeros(shape, dtype)``, the
        same values in other memory: the engine's store gives the kernels' huge-page arena
        (``runtime.kernels.ops.arena_zeros``), as the dense store's K/V and the packed weights are. torch's
        allocator backs a large tensor with 4 KB pages, and a stream through them misses the TLB and restarts the
        hardware prefetch at every page: the fused kernel over one SmolLM2 layout (3k tokens, budget 0.5, 30 layers,
        1 thread) took 5.23 ms from 4 KB pages and 3.83 ms from the arena."""
        for name in self.STREAMED:
            t = getattr(self, name)
            if t is not None and t.numel():
                z = zeros(tuple(t.shape), t.dtype)
                z.copy_(t)
                setattr(self, name, z)

    def replace_with(self, other: "TieredLayer") -> None:
        """Become ``other`` in place (adapters hold this object), its appended rows included."""
        self.__dict__.update(other.__dict__)

    # ------------------------------------------------------------------ appended rows
    def reserve(self, cap: int) -> None:
        """Preallocate room for ``cap`` appended rows (static buffers: the engine's decode; keeps rows written)."""
        old_k, old_v = self.k_new, self.v_new
        z = lambda: torch.zeros(self.B, self.H, cap, self.d, dtype=self.dtype, device=self.k_exact.device)
        self.k_new, self.v_new = z(), z()
        if old_k is not None and self.n_new:
            self.k_new[:, :, :self.n_new] = old_k[:, :, :self.n_new]
            self.v_new[:, :, :self.n_new] = old_v[:, :, :self.n_new]

    def append(self, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor | None = None) -> None:
        """k, v [B, H, t, d] -> appended rows n_new .. n_new + t (grown by doubling when full). ``slot``: the
        device index [t] of the rows in the reserved buffers (a captured decode step writes at device-side slots);
        the host count is then not advanced (it would be baked into the capture): the caller's position counter is
        the count, passed to :func:`attend` as a device ``n_new``."""
        t = k.shape[-2]
        cap = 0 if self.k_new is None else self.k_new.shape[2]
        if slot is not None:
            self.k_new.index_copy_(2, slot, k)
            self.v_new.index_copy_(2, slot, v)
            return
        if self.n_new + t > cap:
            self.reserve(max(2 * cap, self.n_new + t, 16))
        rows = torch.arange(self.n_new, self.n_new + t, device=self.k_new.device)
        self.k_new.index_copy_(2, rows, k)                # the one kind of write, eager or captured
        self.v_new.index_copy_(2, rows, v)
        self.n_new += t


# ---------------------------------------------------------------------------------------------------- attention
def _causal(q_len: int, t: int, device) -> torch.Tensor | None:
    """Keep-mask [q_len, t] of the appended rows for the newest ``q_len`` of them as queries (None: q_len 1)."""
    if q_len == 1 or t == 0:
        return None
    return torch.ones(q_len, t, dtype=torch.bool, device=device).tril(t - q_len)


def attend_portable(layer: TieredLayer, q: torch.Tensor, scale: float | None = None,
                    n_new: int | None = None) -> torch.Tensor:
    """Attention of ``q`` [B, Hq, q_len, d] over every tier of ``layer`` and its first ``n_new`` appended rows
    (default: all written; the queries are the newest q_len of them, causal; a [1] device tensor: every allocated
    slot is read and those at or past it are masked, for captured decode steps) -> [B, Hq, q_len, d] in q's dtype.

    Per segment: scores [exact | each run in factor space | appended], one fp32 (float64 for float64) softmax, probabilities in q's
    dtype for the value products (the reference every fused kernel is checked against)."""
    B, Hq, ql, d = q.shape
    H = layer.H
    G = Hq // H
    scale = d ** -0.5 if scale is None else scale
    if isinstance(n_new, torch.Tensor):              # device count (a captured step): every slot, masked
        t = 0 if layer.k_new is None else layer.k_new.shape[2]
        m = (torch.arange(t, device=q.device) < n_new)[None, :] if t else None
        if ql != 1:
            raise ValueError("tiered attention with a device-side n_new serves one query row (decode)")
    else:
        t = layer.n_new if n_new is None else n_new
        m = _causal(ql, t, q.device)
        if m is not None:
            m = m.repeat(G, 1)                                           # rows g * q_len + j
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32        # softmax precision
    out = torch.empty_like(q)
    for b in range(B):
        for h in range(H):
            s = b * H + h
            ke, ve, js = layer.segment(s)
            qh = q[b, h * G:(h + 1) * G].reshape(G * ql, d) * scale     # [G q, d]
            parts, facs = [], []
            if ke.shape[0]:
                parts.append(qh @ ke.T)
            for j in js:
                seg, n, rk, rv, oak, oav, otok, obk, obv = layer.host_runs[j]
                b_k = layer.b_k[obk:obk + rk * d].view(rk, d)
                a_k = layer.a_k[oak:oak + rk * n].view(rk, n)            # rank-major
                qb = qh @ b_k.T                                          # [G q, r_k]
                if layer.quant8:
                    parts.append((qb @ a_k.to(qb.dtype)) * layer.k_scale[otok:otok + n].to(qb.dtype))
                else:
                    parts.append(qb @ a_k)
                facs.append((j, n))
            if t:
                sn = qh @ layer.k_new[b, h, :t].T                       # [G q, t]
                if m is not None:
                    sn = sn.masked_fill(~m, NEG)
                parts.append(sn)
            if not parts:
                raise ValueError(f"tiered attention: segment {s} (row {b}, KV head {h}) holds no token")
            p = torch.softmax(torch.cat(parts, -1) if len(parts) > 1 else parts[0], -1, dtype=sdt).to(q.dtype)
            o, off = None, 0
            if ke.shape[0]:
                o = p[:, :ke.shape[0]] @ ve
                off = ke.shape[0]
            for j, n in facs:
                seg, n, rk, rv, oak, oav, otok, obk, obv = layer.host_runs[j]
                pm = p[:, off:off + n]
                a_v = layer.a_v[oav:oav + rv * n].view(rv, n)
                if layer.quant8:
                    pa = (pm * layer.v_scale[otok:otok + n].to(pm.dtype)) @ a_v.to(pm.dtype).T
                else:
                    pa = pm @ a_v.T                                      # [G q, r_v]
                om = pa @ layer.b_v[obv:obv + rv * d].view(rv, d)
                o = om if o is None else o + om
                off += n
            if t:
                on = p[:, off:] @ layer.v_new[b, h, :t]
                o = on if o is None else o + on
            out[b, h * G:(h + 1) * G] = o.view(G, ql, d)
    return out


def attend_rebuild(layer: TieredLayer, q: torch.Tensor, scale: float | None = None,
                   n_new: int | None = None) -> torch.Tensor:
    """The paper's decode path (Algorithm 1, line 25): rebuild every segment's rows (exact, ``A B`` of each run,
    appended) and attend densely; the same function as :func:`attend_portable` up to round-off, O(n r d) per step.
    Host counts only (eager)."""
    B, Hq, ql, d = q.shape
    H, G = layer.H, Hq // layer.H
    scale = d ** -0.5 if scale is None else scale
    t = layer.n_new if n_new is None else n_new
    if isinstance(t, torch.Tensor):
        raise ValueError("the rebuild path reads host counts (eager decode only)")
    m = _causal(ql, t, q.device)
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.empty_like(q)
    for b in range(B):
        for h in range(H):
            K, V = layer.dense(b * H + h, t)
            s = (q[b, h * G:(h + 1) * G] * scale) @ K.T                         # [G, q, n]
            if m is not None:
                s[..., K.shape[0] - t:] = s[..., K.shape[0] - t:].masked_fill(~m, NEG)
            out[b, h * G:(h + 1) * G] = torch.softmax(s, -1, dtype=sdt).to(q.dtype) @ V
    return out


def attend_lrk_tiers(layer: TieredLayer, q: torch.Tensor, scale: float | None = None,
                   n_new: int | torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel (``runtime/kernels/tiers.cpp``, ``lowrank_lrk::tier_attend``): decode, q [B, Hq, 1, d] ->
    [B, Hq, 1, d]. Every segment's exact rows, runs in factor space (int8 factors dequantised in registers) and
    appended rows under one online fp32 softmax per query head, all heads of the layer in one call, each K/V row
    read once for its G query heads. ``n_new``: appended rows to read (default: all written); a [1] int64 tensor
    is read by the kernel at run time, so a compiled / captured step replays for every step (a host int is baked
    into a compiled graph)."""
    if not torch.compiler.is_compiling():
        lib = kernel_build.load()                    # loads (or builds) the library once
        if not lib.available:
            raise RuntimeError(f"tiered attention 'lrk_tiers' cannot run: {lib.reason}")
    B, Hq, ql, d = q.shape
    if ql != 1:
        raise ValueError(f"the fused tier attention serves one query row (decode), got q_len {ql}: "
                         f"use backend='portable'")
    scale = d ** -0.5 if scale is None else scale
    if not isinstance(n_new, torch.Tensor):
        n_new = torch.tensor([layer.n_new if n_new is None else n_new], dtype=torch.long)
    o = kernel_ops.tier_attend(q.reshape(B, layer.H, Hq // layer.H, d), layer.k_exact, layer.v_exact, layer.e_off,
                               layer.runs, layer.r_off, layer.a_k, layer.a_v, layer.b_k, layer.b_v, layer.k_scale,
                               layer.v_scale, layer.k_new, layer.v_new, n_new, scale)
    return o.view(B, Hq, 1, d)


#: the tiered attentions over a TieredLayer (a new one is one entry, its capabilities declared):
#: ``portable`` the reference; ``rebuild`` the paper's rebuild-then-attend (host counts: eager only); ``lrk_tiers``
#: our fused CPU kernel (decode only; reads the layout, e_off / runs / r_off and the appended count, from device
#: tensors at run time, so one compiled / captured step serves every layout whose buffers share a bucket; the others
#: slice with host ints, which a compiled step bakes in: their captures are keyed by the layout)
BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("portable", attend_portable, BackendCaps(), "the portable per-segment path (kv.tiers.attend_portable)"),
    Backend("rebuild", attend_rebuild, BackendCaps(capturable=False),
            "the paper's rebuild-then-attend (kv.tiers.attend_rebuild)"),
    Backend("lrk_tiers", attend_lrk_tiers, BackendCaps(
        devices=("cpu",), dtypes=(torch.float32, torch.bfloat16), isa="avx2", native=True, reads_device_layout=True,
        decode_only=True, head_dims=tuple(range(16, 129, 16)), in_fused_layer=True),
        "our fused tier attention (runtime/kernels/tiers.cpp, AVX-512 or AVX2 + FMA: exact rows, runs in factor "
        "space, appended rows, one softmax)"),
)}
#: ``"auto"``: the first of these that can run
AUTO_ORDER = ("lrk_tiers", "portable")


def reads_device_layout(backend: str) -> bool:
    """Whether the tiered attention ``backend`` reads its layout from device tensors (its declared capability)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown tiered attention {backend!r}; choose from {tuple(BACKENDS)}")
    return BACKENDS[backend].caps.reads_device_layout


def lrk_tiers_unavailable(device, head_dim: int, dtype: torch.dtype, kernels: str = "auto") -> str | None:
    """Why the fused kernel ``lrk_tiers`` cannot run (None: it can): ``kernels`` not ``"portable"``, a CPU device,
    fp32 / bf16, head_dim a multiple of 16 up to 128, the kernel library loaded (built on first use) and the ISA
    its capabilities declare (AVX2 + FMA, or the dtype's AVX-512 subset: AVX512F/BW/VL, + AVX512_BF16 for bf16)."""
    return BACKENDS["lrk_tiers"].caps.unavailable(device, dtype, kernels, head_dim=head_dim)


def select_backend(requested: str, device: torch.device, head_dim: int, dtype: torch.dtype, kernels: str = "auto",
                   q_len: int = 1) -> BackendChoice:
    """The tiered attention of :data:`BACKENDS` to run, and why (``runtime.backend.select``): ``"auto"`` takes the
    first of :data:`AUTO_ORDER` whose declared capabilities allow it (the device, dtype, head dim, ``q_len`` query
    rows, ``kernels`` = ``EngineConfig.kernels``: ``"portable"`` rules out every native backend, ``"lrk"`` requires
    the native one where it serves the device); a backend requested by name runs or raises, saying why."""
    return select(BACKENDS, AUTO_ORDER, requested, device, head_dim, dtype, kernels, q_len, "tiered attention")


def attend(layer: TieredLayer, q: torch.Tensor, scale: float | None = None, n_new: int | torch.Tensor | None = None,
           backend: str | Backend = "portable") -> torch.Tensor:
    """The tiered attention -> [B, Hq, q_len, d]: ``backend`` an entry of :data:`BACKENDS` (an adapter resolves it
    once), its name, or ``"auto"`` (:func:`select_backend`'s choice for these queries)."""
    if isinstance(backend, str):
        name = select_backend(backend, q.device, q.shape[-1], q.dtype, q_len=q.shape[2]).name \
            if backend == "auto" else backend
        if name not in BACKENDS:
            raise ValueError(f"unknown tiered attention {name!r}; choose from {('auto', *BACKENDS)}")
        backend = BACKENDS[name]
    return backend.fn(layer, q, scale, n_new)
