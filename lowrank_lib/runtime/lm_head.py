"""The decode engine's LM head: exact, or certified (the exact greedy token from a fraction of the head's bytes).

``EngineConfig(lm_head="exact")`` (default) multiplies every row of the head. ``lm_head="certified"``
serves decode rows (up to ``LRK_MAX_ROWS`` rows of x; prefill's full logits stay exact) with
:class:`CertifiedHead`:

1. an int8 copy of the head ``W`` [V, d] (per row: ``s_i = max|w_i| / 127``, ``q_i = round(w_i / s_i)``)
   scores every row; x is quantised to int16 (``s_h = max|x| / m``, ``m`` the largest value whose
   int32 sums cannot overflow), so the approximate score ``zh_i = s_i s_h (q_i . q_h)`` is an exact
   integer dot product, rounded once;
2. a per-row bound, precomputed from the head: with ``e_i = w_i - s_i q_i`` and ``r_h = x - s_h q_h``,
   ``w_i . x - zh_i = e_i . x + s_i q_i . r_h``, so by Cauchy-Schwarz

       |logit_i - zh_i| <= (|e_i| + gamma |w_i|) |x| + s_i |q_i| |r_h| + 8u |zh_i|   (+ 2^-8 (|zh_i| + ...) in bf16)

   where ``gamma |w_i| |x|`` bounds the exact kernel's fp32 accumulation error (gamma = n u / (1 - n u),
   u = 2^-24, n = d + 2), ``8u |zh_i|`` the rounding of the score and of ``zh +- bound``, and the bf16
   term the rounding of the exact logit to the output dtype. Stored per row: ``(s_i, |e_i| + gamma |w_i|,
   s_i |q_i|)``, rounded up; at run time ``|x|`` and ``|r_h|`` are computed in float64 and rounded up;
   the sum is scaled by 1 + 2^-12 and padded by 1e-25 (the arithmetic of the bound itself, flushed
   denormals);
3. ``L = max_i (zh_i - bound_i)`` is a lower bound of the largest exact logit, so every row with
   ``zh_i + bound_i >= L`` may win, and no other can: only the 64-row blocks of the exact head holding
   such a row are multiplied, with the same kernels (and row grouping) as the exact head, so their
   logits are the exact head's bit for bit. When more than ``max_fraction`` of the blocks would be
   needed (or x is not finite), every block is multiplied (the fallback: the exact head). The argmax of the returned logits
   is therefore the exact head's argmax, ties (first index) included: every other entry holds the
   approximate score rounded DOWN to the output dtype, strictly below the largest exact logit.

What the returned logits are: exact on every row of an evaluated block, ``zh_i`` (rounded down) on the
others, ``|zh_i - logit_i| <= bound_i``. Greedy decoding (argmax) is exactly the exact head's. Sampling
(``do_sample=True``) draws from the softmax of these logits: exact on the evaluated rows (every row that
could be the argmax, and the rest of their blocks), the approximate head's score on the others. Use
``lm_head="exact"`` for sampling from the exact distribution.

Why int8 and not a low-rank copy: on SmolLM2's real head [49152, 576] a rank-384 copy (2/3 of the
bytes) still leaves every row a candidate (its rows keep 31 % of their norm as error), the int8 copy
(half the bf16 bytes, 1.1 % error) leaves 4 blocks of 768 on average. The certification itself
(:func:`certify`) takes any approximation with per-row bounds; the property tests run it with low-rank
copies of every rank. Random weights (the 1B / 7B shape benchmarks) give logits with tiny margins:
there the bound admits many rows and the fallback runs; only real heads show the saving.

Paths: the packed kernel (``lowrank_lrk::certified_head``: AVX512_VNNI, or AVX2's vpmaddwd, the same integer
sums) when the engine's GEMV backend is a packed one (``lrk_avx512`` / ``lrk_avx2``); otherwise the portable op (``lowrank_lib::certified_head``,
torch ops, the exact rows by ``torch.mm`` on their columns: the guarantee is then with respect to
aten's exact head). Both are custom ops, so a ``torch.compile``-d step calls them as one opaque call.
:meth:`CertifiedHead.report` counts calls, rows, fallbacks, candidate rows and exact rows read.
"""
from __future__ import annotations

import math

import torch

from .packing import ProjectionGroup

LM_HEADS = ("exact", "certified")
#: fraction of the head's blocks above which the whole exact head runs instead
MAX_FRACTION = 0.25
#: rows of the exact head per kernel block (``lrk.cpp`` BW)
BLOCK = 64
_U = 2.0 ** -24
_STATS = ("calls", "rows", "fallback_calls", "candidate_rows", "exact_rows")


def make_lm_head(mode: str, exact: ProjectionGroup, max_fraction: float = MAX_FRACTION):
    """The engine's head for ``EngineConfig.lm_head``: the exact group itself, or a :class:`CertifiedHead` over it."""
    if mode not in LM_HEADS:
        raise ValueError(f"lm_head={mode!r}: use one of {LM_HEADS}")
    return exact if mode == "exact" else CertifiedHead(exact, max_fraction)


def head_report(head) -> dict:
    """``Engine.report()["lm_head"]``: the mode, and for a certified head its paths and bytes."""
    return head.report() if isinstance(head, CertifiedHead) else {"mode": "exact"}


def _round_up_f32(t: torch.Tensor) -> torch.Tensor:
    """float64 (>= 0) -> the smallest float32 >= each value."""
    f = t.float()
    return torch.where(f.double() >= t, f, torch.nextafter(f, torch.full_like(f, math.inf)))


def _gamma(d: int) -> float:
    n = 2 * -(-d // 2) + 2
    return n * _U / (1 - n * _U)


@torch.no_grad()
def quantize_head(W: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """W [V, d] (the head at the engine dtype) -> (Q int8 [V, d], meta float32 [V, 3] = (s, a, b)).

    ``s_i = max|w_i| / 127`` (1 for a zero row), ``q_i = round(w_i / s_i)``, ``a_i = |w_i - s_i q_i| + gamma |w_i|``,
    ``b_i = s_i |q_i|``, both rounded up to float32; computed in float64, ``chunk`` rows at a time."""
    V, d = W.shape
    if not bool(torch.isfinite(W).all()):
        raise ValueError("the certified head needs a finite head: the LM head holds inf / NaN weights")
    Q = torch.empty(V, d, dtype=torch.int8)
    meta = torch.empty(V, 3, dtype=torch.float32)
    g = _gamma(d)
    for i in range(0, V, chunk):
        w = W[i:i + chunk].double()
        s = (w.abs().amax(1) / 127).float()
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = (w / s.double()[:, None]).round().clamp(-127, 127)
        e = w - s.double()[:, None] * q
        Q[i:i + chunk] = q.to(torch.int8)
        meta[i:i + chunk, 0] = s
        meta[i:i + chunk, 1] = _round_up_f32(e.norm(dim=1) * (1 + 1e-12) + g * w.norm(dim=1) * (1 + 1e-12))
        meta[i:i + chunk, 2] = _round_up_f32(s.double() * q.norm(dim=1) * (1 + 1e-12))
    return Q, meta


def quantize_rows(x: torch.Tensor, d_packed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [N, d] -> (q_h float64 [N, d] integers, s_h float32 [N], |x| and |x - s_h q_h| float32 [N] rounded up).

    ``|q_h| <= m = min(32767, (2^31 - 1) // (127 d_packed))``: the int32 sums of 127 * m products cannot overflow."""
    m = min(32767, (2 ** 31 - 1) // (127 * d_packed))
    xf = x.double()
    mx = xf.abs().amax(1)
    s = (mx / m).float()
    s = torch.where(mx > 0, s, torch.ones_like(s))
    q = (xf / s.double()[:, None]).round().clamp(-m, m)
    r = xf - s.double()[:, None] * q
    return q, s, _round_up_f32(xf.norm(dim=1) * (1 + 1e-12)), _round_up_f32(r.norm(dim=1) * (1 + 1e-12))


def bounds(sums: torch.Tensor, meta: torch.Tensor, s_h: torch.Tensor, hn: torch.Tensor, rn: torch.Tensor,
           bf16_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer sums [N, V] -> (approximate scores zh, bounds) float32 [N, V] (see the module docstring)."""
    zh = sums.float() * (meta[:, 0][None] * s_h[:, None])
    az = zh.abs()
    d = meta[:, 1][None] * hn[:, None] + meta[:, 2][None] * rn[:, None] + 8 * _U * az
    rho = 2.0 ** -8 if bf16_out else 0.0
    return zh, (d + rho * (az + d)) * (1 + 2.0 ** -12) + 1e-25


def round_down(z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float32 -> ``dtype`` rounded towards -inf (the largest representable value <= z)."""
    if dtype == torch.float32:
        return z
    if dtype != torch.bfloat16:
        raise ValueError(f"round_down: float32 or bfloat16, got {dtype}")
    b = z.view(torch.int32)
    t = (b >> 16).to(torch.int16)
    bump = ((b & 0xFFFF) != 0) & (b < 0)            # a negative value truncated towards zero: one step down
    return (t + bump.to(torch.int16)).view(torch.bfloat16)


def certify(zh: torch.Tensor, bound: torch.Tensor, exact_blocks, out_dtype: torch.dtype,
            max_fraction: float = MAX_FRACTION, block: int = BLOCK) -> tuple[torch.Tensor, dict]:
    """The certification, for ANY approximation with per-row bounds |logit - zh| <= bound.

    zh, bound: float32 [N, V]; ``exact_blocks(blocks: list[int] | None) -> {block: logits [N, width]}``
    computes the exact head on those blocks (None: every block, the fallback). Returns (logits [N, V]
    at ``out_dtype``: exact on the evaluated blocks, zh rounded down elsewhere; the counts)."""
    N, V = zh.shape
    nblk = -(-V // block)
    L = (zh - bound).amax(1, keepdim=True)
    cand = (zh + bound) >= L
    sel = sorted(set((cand.nonzero()[:, 1] // block).tolist()))
    fallback = len(sel) > max_fraction * nblk
    y = round_down(zh, out_dtype).clone()
    todo = list(range(nblk)) if fallback else sel
    got = exact_blocks(None if fallback else sel)
    for b in todo:
        y[:, b * block:(b + 1) * block] = got[b]
    exact_rows = sum(min(block, V - b * block) for b in todo)
    return y, {"fallback": fallback, "candidates": int(cand.sum()), "exact_rows": exact_rows}


@torch.library.custom_op("lowrank_lib::certified_head", mutates_args=("stats",))
def certified_head_portable(x: torch.Tensor, Q: torch.Tensor, meta: torch.Tensor, Wt: torch.Tensor,
                            max_fraction: float, stats: torch.Tensor) -> torch.Tensor:
    """The portable certified head: x [N, d], Q int8 [V, d], meta [V, 3], Wt [d, V] (the exact head's
    ``x @ Wt`` operand) -> logits [N, V] at x's dtype; ``stats`` int64 [5] updated in place."""
    N, d = x.shape
    V = Q.shape[0]
    if not bool(torch.isfinite(x).all()):          # no bound holds: the exact head
        stats += torch.tensor([1, N, 1, 0, V], dtype=stats.dtype)
        return torch.mm(x, Wt)
    q, s_h, hn, rn = quantize_rows(x, 2 * -(-d // 2))
    sums = torch.cat([q @ Q[i:i + 8192].double().t() for i in range(0, V, 8192)], 1)   # exact integers
    zh, bd = bounds(sums, meta, s_h, hn, rn, x.dtype == torch.bfloat16)

    def exact_blocks(blocks):
        if blocks is None:
            y = torch.mm(x, Wt)
            return {b: y[:, b * BLOCK:(b + 1) * BLOCK] for b in range(-(-V // BLOCK))}
        return {b: torch.mm(x, Wt[:, b * BLOCK:(b + 1) * BLOCK]) for b in blocks}

    y, c = certify(zh, bd, exact_blocks, x.dtype, max_fraction)
    stats += torch.tensor([1, N, int(c["fallback"]), c["candidates"], c["exact_rows"]], dtype=stats.dtype)
    return y


@certified_head_portable.register_fake
def _(x, Q, meta, Wt, max_fraction, stats):
    return x.new_empty(x.shape[0], Q.shape[0])


class CertifiedHead:
    """The certified LM head over the engine's exact head (a one-member dense :class:`ProjectionGroup`).

    Keeps the exact group (prefill and batches above ``LRK_MAX_ROWS`` rows run it; its stored weights
    are the exact rows the certification reads) and adds the int8 copy + per-row bounds. Quacks like a
    ProjectionGroup for the engine: ``__call__(x) -> [logits]``, ``nbytes``, ``stored_nbytes``.
    """

    def __init__(self, exact: ProjectionGroup, max_fraction: float = MAX_FRACTION):
        from .kernels.build import load

        if len(exact.members) != 1 or exact.members[0].lowrank or not exact.pack:
            raise ValueError("the certified head needs a dense, packed one-matrix head (nn.Linear lm_head)")
        if exact.S_bias is not None:
            raise ValueError("the certified head does not serve a head with a bias")
        self.exact, self.max_fraction = exact, float(max_fraction)
        W = exact.S                                                   # [V, d] at the engine dtype
        self.V, self.d = W.shape
        self.dtype = W.dtype
        Q, self.meta = quantize_head(W.cpu())
        # the kernel scores with AVX512_VNNI where the CPU has it, else AVX2 (vpmaddwd): same integers
        self.kernel = exact.gemv.packed and (load().has("avx512_vnni") or load().has("avx2", "fma"))
        if exact.gemv.packed and not self.kernel:
            raise RuntimeError("the certified head's kernel needs AVX512_VNNI or AVX2 beside the packed GEMV kernel")
        if self.kernel:
            from .kernels.ops import pack

            self.Q = pack(Q)
        else:
            self.Q = Q.to(W.device)
            self.meta = self.meta.to(W.device)
        vnni = load().has("avx512f", "avx512bw", "avx512vl", "avx512_vnni") if self.kernel else False
        self.path = (f"{exact.gemv.name}: int8 approximate head ({'vpdpwssd' if vnni else 'vpmaddwd, AVX2'}) + exact "
                     "packed blocks" if self.kernel else "portable: torch ops (exact rows by torch.mm on their columns)")
        self.stats = torch.zeros(len(_STATS), dtype=torch.long, device="cpu" if self.kernel else W.device)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [N, d] -> [logits [N, V]]: certified for N <= LRK_MAX_ROWS (decode), exact otherwise."""
        from .kernels.gemv import LRK_MAX_ROWS

        if x.dim() != 2 or x.shape[0] > LRK_MAX_ROWS:
            return self.exact(x)
        if self.kernel:
            from .kernels.ops import certified_head

            return [certified_head(x, self.Q, self.meta, self.exact.S_p.P, self.V, self.max_fraction, self.stats)]
        return [certified_head_portable(x, self.Q, self.meta, self.exact.S_t, self.max_fraction, self.stats)]

    # ------------------------------------------------------------------ accounting
    @property
    def approx_nbytes(self) -> int:
        """Bytes every certified call reads: the int8 copy and the per-row (s, a, b)."""
        return self.V * self.d + self.meta.numel() * 4

    @property
    def nbytes(self) -> int:
        """Weight bytes per decode token: the int8 copy and bounds, plus the exact rows read per call on
        average so far (the counters; before any call, none)."""
        calls = int(self.stats[0])
        per_call = int(self.stats[4]) / calls if calls else 0.0
        return self.approx_nbytes + round(per_call * self.d * self.dtype.itemsize)

    @property
    def stored_nbytes(self) -> int:
        return self.exact.stored_nbytes + self.Q.numel() + self.meta.numel() * 4

    def reset_stats(self) -> None:
        self.stats.zero_()

    def report(self) -> dict:
        """The paths run so far: calls, rows, fallbacks, candidate and exact rows, the fraction of the head's
        bytes read per call (approximate copy + exact rows, over the exact head's bytes)."""
        s = dict(zip(_STATS, (int(v) for v in self.stats)))
        head_bytes = self.V * self.d * self.dtype.itemsize
        calls = s["calls"]
        return {"mode": "certified", "path": self.path, "max_fraction": self.max_fraction, **s,
                "certified_calls": calls - s["fallback_calls"],
                "candidates_per_row": s["candidate_rows"] / s["rows"] if s["rows"] else None,
                "exact_rows_per_call": s["exact_rows"] / calls if calls else None,
                "head_bytes": head_bytes, "approx_bytes": self.approx_nbytes,
                "head_bytes_fraction": self.nbytes / head_bytes if calls else None}
