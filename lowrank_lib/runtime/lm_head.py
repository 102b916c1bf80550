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

The group-wise copies (``lm_head="certified_q8"`` / ``"certified_q4"``, :class:`QuantCertifiedHead`, modes and
(bits, group) in :data:`QUANT_HEADS`): the copy is ``quant.quantize(W, bits, group)`` (fp16 scale per row and group),
scored by ONE ``qgemv`` over every row (``quant.qmatmul``'s bits on the portable path), x quantised by
``quant.quantize_activations`` (int16 per group). With w^ the dequantized row, x^ = xs * xq the dequantized x,
e_i = w_i - w^_i, r = x - x^ and t_ij = isum_ij * scale_ij * xs_j (the real group terms, sum_j t_ij = w^_i . x^):

    w_i . x - zh_i = e_i . x + w^_i . r + (w^_i . x^ - zh_i)
    |w^_i . x^ - zh_i| <= gamma_{G+2} sum_j |t_ij| <= gamma_{G+2} |w^_i| |x^| <= gamma_{G+2} |w^_i| (|x| + |r|)

(the score's float steps: float32(isum) exact below 2^24 and rounded once above, scale * xs once, the product once,
G - 1 additions in any order; |t_ij| <= |w^_ij| |x^_j| per group by Cauchy-Schwarz, then over groups), so

    |logit_i - zh_i| <= (|e_i| + gamma_d |w_i|) |x| + |w^_i| (|r| + gamma_{G+2} (|x| + |r|)) + 8u |zh_i|  (+ bf16 term)

the same form as above (:func:`row_bounds`): per row ``(a_i, b_i) = (|e_i| + gamma_d |w_i|, |w^_i|)``
(:func:`quantize_head_q`, float64, rounded up), per x ``(|x|, |r| + gamma_{G+2} (|x| + |r|))``
(:func:`quantize_x`, float64 from the very codes and scales qgemv uses, rounded up); the 1e-25 pad also covers
underflow in the score's steps (at most 3G subnormal roundings of 2^-126 each). Candidates, exact blocks (``gemv``
on views of the selected 64-row blocks of the exact packed head: the exact head's kernel, so its bits), fallback and
counters as above (:func:`certify`). A head whose group scale overflows fp16 (max |w| > 65504 qmax) is refused.

Measured on SmolLM2-135M's real head [49152, 576] (bf16 engine, the 20 fidelity prompts x 64 greedy tokens = 1280
decode calls; deterministic counts; bf16 head 56.6 MB): today's per-row int8 copy reads 28.9 MB + 3.95 exact blocks
per token (4.5 candidate rows, no fallback) = 29.19 MB (51.6 %); ``certified_q8`` (int8, group 32) 30.47 MB + 1.27
blocks (1.34 candidates, no fallback) = 30.57 MB (54.0 %): fewer blocks, more bytes (the fp16 group scales);
``certified_q4`` (int4, group 32: 16.3 MB) falls back on EVERY call (46128 of 49152 rows are candidates: the int4
error |e_i| is ~10 % of |w_i|, and |e_i| |x| ~ 10 logit units against a median top-2 margin of 2.2), so it reads
72.9 MB (129 %); group 64 alike (48539 candidates). Greedy tokens equal the exact head's on all 1280 (by
construction). So no sound Cauchy-Schwarz head over int4 pays on this head: per-group Cauchy-Schwarz bounds still
leave 43151 candidates, while the true |e_i . x| would leave 3.8 (an oracle, not a bound). Taking the hidden states' top k
principal directions out of the error term (computed exactly, the rest bounded) still leaves a median of 2443
candidates for int4 (k = 128), 141 for int5 (k = 64): README, `peer_cpu_19`'s section.

The approximate heads (``lm_head="q8"`` / ``"q4"``, :class:`QuantHead`, :data:`APPROX_HEADS`): the decode logits
ARE the group-wise quantized head's (``qgemv``), prefill's stay exact; they change the logits and the greedy tokens.
On the same 20 prompts x 64 tokens against the exact head: ``q8`` (int8, group 64, 29.2 MB, 51.6 %) 11 of 20
prompts identical, 84.6 % of tokens equal, first divergence at token 51.5 on average; ``q4`` (int4, group 32, 15.9
MB, 28.1 %) 1 of 20 identical, 16.6 % of tokens, first divergence at 7.7. For the random-weight 1B / 7B shapes
(no margins: every certified head falls back), these are the heads that read fewer bytes; their effect on a real
model's tokens is the measurement above.

Paths: the packed kernel (``lowrank_lrk::certified_head``: AVX512_VNNI, or AVX2's vpmaddwd, the same integer
sums) when the engine's GEMV backend is a packed one (``lrk_avx512`` / ``lrk_avx2``); otherwise the portable op (``lowrank_lib::certified_head``,
torch ops, the exact rows by ``torch.mm`` on their columns: the guarantee is then with respect to
aten's exact head). Both are custom ops, so a ``torch.compile``-d step calls them as one opaque call.
:meth:`CertifiedHead.report` counts calls, rows, fallbacks, candidate rows and exact rows read.
"""
from __future__ import annotations

import math

import torch

from .. import quant
from .packing import ProjectionGroup

#: the group-wise copies of the head (mode -> (bits, group)): ``quant.quantize``'s codes, scored by ``qgemv``
QUANT_HEADS = {"certified_q8": (8, 32), "certified_q4": (4, 32)}
#: the approximate heads (mode -> (bits, group)): the decode logits ARE the quantized head's (``qgemv``)
APPROX_HEADS = {"q8": (8, 64), "q4": (4, 32)}
LM_HEADS = ("exact", "certified", *QUANT_HEADS, *APPROX_HEADS)
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
    if mode in APPROX_HEADS:
        return QuantHead(exact, *APPROX_HEADS[mode], mode=mode)
    if mode in QUANT_HEADS:
        return QuantCertifiedHead(exact, *QUANT_HEADS[mode], max_fraction=max_fraction, mode=mode)
    return exact if mode == "exact" else CertifiedHead(exact, max_fraction)


def head_report(head) -> dict:
    """``Engine.report()["lm_head"]``: the mode, and for a certified head its paths and bytes."""
    return head.report() if isinstance(head, (CertifiedHead, QuantHead)) else {"mode": "exact"}


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
    return zh, row_bounds(zh, meta[:, 1], meta[:, 2], hn, rn, bf16_out)


def row_bounds(zh: torch.Tensor, a: torch.Tensor, b: torch.Tensor, hn: torch.Tensor, rn: torch.Tensor,
               bf16_out: bool) -> torch.Tensor:
    """``(a_i hn + b_i rn + 8u |zh_i| + rho (|zh_i| + ...)) (1 + 2^-12) + 1e-25`` float32 [N, V]: the bound of both
    copies (per row a [V], b [V]; per row of x hn [N], rn [N]; rho = 2^-8 for a bf16 output, else 0)."""
    az = zh.abs()
    d = a[None] * hn[:, None] + b[None] * rn[:, None] + 8 * _U * az
    rho = 2.0 ** -8 if bf16_out else 0.0
    return (d + rho * (az + d)) * (1 + 2.0 ** -12) + 1e-25


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


def _check_exact(exact: ProjectionGroup) -> None:
    if len(exact.members) != 1 or exact.members[0].lowrank or not exact.pack:
        raise ValueError("the certified head needs a dense, packed one-matrix head (nn.Linear lm_head)")
    if exact.S_bias is not None:
        raise ValueError("the certified head does not serve a head with a bias")


class CertifiedHead:
    """The certified LM head over the engine's exact head (a one-member dense :class:`ProjectionGroup`).

    Keeps the exact group (prefill and batches above ``LRK_MAX_ROWS`` rows run it; its stored weights
    are the exact rows the certification reads) and adds the int8 copy + per-row bounds. Quacks like a
    ProjectionGroup for the engine: ``__call__(x) -> [logits]``, ``nbytes``, ``stored_nbytes``.
    """

    mode = "certified"

    def __init__(self, exact: ProjectionGroup, max_fraction: float = MAX_FRACTION):
        from .kernels.build import load

        _check_exact(exact)
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
        return {"mode": self.mode, "path": self.path, "max_fraction": self.max_fraction, **s,
                "certified_calls": calls - s["fallback_calls"],
                "candidates_per_row": s["candidate_rows"] / s["rows"] if s["rows"] else None,
                "exact_rows_per_call": s["exact_rows"] / calls if calls else None,
                "head_bytes": head_bytes, "approx_bytes": self.approx_nbytes,
                "head_bytes_fraction": self.nbytes / head_bytes if calls else None}


# ------------------------------------------------------------------ the group-wise copy (int8 / int4, qgemv)
@torch.no_grad()
def quantize_head_q(W: torch.Tensor, bits: int, group: int, chunk: int = 8192) -> tuple[quant.QuantizedTensor,
                                                                                        torch.Tensor]:
    """W [V, d] -> (``quant.quantize(W, bits, group)``, meta float32 [V, 2] = (a, b)).

    ``a_i = |w_i - w^_i| + gamma_d |w_i|``, ``b_i = |w^_i|`` (w^ the dequantized row), in float64, rounded up."""
    if not bool(torch.isfinite(W).all()):
        raise ValueError("the certified head needs a finite head: the LM head holds inf / NaN weights")
    V, d = W.shape
    qt = quant.quantize(W, bits, group)
    Wh = qt.dequantize(torch.float32)
    meta = torch.empty(V, 2, dtype=torch.float32)
    g = _gamma(d)
    for i in range(0, V, chunk):
        w, wh = W[i:i + chunk].double(), Wh[i:i + chunk].double()
        meta[i:i + chunk, 0] = _round_up_f32((w - wh).norm(dim=1) * (1 + 1e-12) + g * w.norm(dim=1) * (1 + 1e-12))
        meta[i:i + chunk, 1] = _round_up_f32(wh.norm(dim=1) * (1 + 1e-12))
    return qt, meta


def quantize_x(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, d] -> (hn, rn) float32 [N] rounded up: ``hn >= |x|``, ``rn >= |r| + gamma_{G+2} (|x| + |r|)`` with
    ``r = x - x^`` the residual of ``quant.quantize_activations`` (the codes and scales ``qgemv`` multiplies) and G
    the number of groups (the score's fp32 steps, see the module docstring)."""
    N, d = x.shape
    xq, xs = quant.quantize_activations(x, group)
    G = xs.shape[1]
    xh = (xq.double().view(N, G, group) * xs.double()[..., None]).view(N, G * group)[:, :d]
    xn = x.double().norm(dim=1) * (1 + 1e-12)
    r = (x.double() - xh).norm(dim=1) * (1 + 1e-12)
    n = G + 2
    gs = n * _U / (1 - n * _U)
    return _round_up_f32(xn), _round_up_f32((r + gs * (xn + r)) * (1 + 1e-12))


def _packed_blocks(P: torch.Tensor, V: int, blocks: list[int]) -> tuple[list[torch.Tensor], list[int]]:
    """Views of the 64-row blocks ``blocks`` of a packed [V, d] matrix (``lrk.cpp``: each block one contiguous
    stream; the last one rounded up to 16 rows) as packed matrices of their own, and their widths."""
    rows = (V // BLOCK) * BLOCK + -(-(V % BLOCK) // 16) * 16
    K = P.numel() // rows
    views, widths = [], []
    for b in blocks:
        w = min(BLOCK, V - b * BLOCK)
        views.append(P[b * BLOCK * K:(b * BLOCK + -(-w // 16) * 16) * K])
        widths.append(w)
    return views, widths


@torch.library.custom_op("lowrank_lib::certified_head_q", mutates_args=("stats",))
def certified_head_q(x: torch.Tensor, Q: torch.Tensor, Qs: torch.Tensor, meta: torch.Tensor, E: torch.Tensor,
                     bits: int, group: int, kernel: bool, max_fraction: float, stats: torch.Tensor) -> torch.Tensor:
    """The certified head over a group-wise copy: x [N, d]; meta [V, 2] (a, b); ``kernel``: Q the ``ops.qpack`` blob
    of the copy, E the exact head packed (``ops.pack``), ``qgemv`` scores and ``gemv`` on the selected blocks' views
    (the exact head's kernel and bits); else Q / Qs the copy's codes / fp16 scales, ``quant.qmatmul`` scores and E
    = W^T [d, V] (``torch.mm`` on the selected columns). -> logits [N, V] at x's dtype; ``stats`` int64 [5]."""
    N, d = x.shape
    V = meta.shape[0]
    if kernel:
        from .kernels import ops

        def head(blocks):
            if blocks is None:
                return ops.gemv(x, [E], [V], [d], [0])
            views, widths = _packed_blocks(E, V, blocks)
            return ops.gemv(x, views, widths, [d] * len(views), [0] * len(views))
    else:
        def head(blocks):
            if blocks is None:
                return torch.mm(x, E)
            return torch.cat([torch.mm(x, E[:, b * BLOCK:(b + 1) * BLOCK]) for b in blocks], 1)
    if not bool(torch.isfinite(x).all()):          # no bound holds: the exact head
        stats += torch.tensor([1, N, 1, 0, V], dtype=stats.dtype)
        return head(None)
    x32 = x.float().contiguous()
    if kernel:
        zh = ops.qgemv(x32, [Q], [V], [d], [0], bits, group)
    else:
        zh = quant.qmatmul(x32, quant.QuantizedTensor(Q, Qs, bits, group, (V, d)))
    hn, rn = quantize_x(x, group)
    bd = row_bounds(zh, meta[:, 0], meta[:, 1], hn.to(zh.device), rn.to(zh.device), x.dtype == torch.bfloat16)

    def exact_blocks(blocks):
        y = head(blocks)
        if blocks is None:
            return {b: y[:, b * BLOCK:(b + 1) * BLOCK] for b in range(-(-V // BLOCK))}
        out, o = {}, 0
        for b in blocks:
            w = min(BLOCK, V - b * BLOCK)
            out[b], o = y[:, o:o + w], o + w
        return out

    y, c = certify(zh, bd, exact_blocks, x.dtype, max_fraction)
    stats += torch.tensor([1, N, int(c["fallback"]), c["candidates"], c["exact_rows"]], dtype=stats.dtype)
    return y


@certified_head_q.register_fake
def _(x, Q, Qs, meta, E, bits, group, kernel, max_fraction, stats):
    return x.new_empty(x.shape[0], meta.shape[0])


class QuantCertifiedHead(CertifiedHead):
    """The certified head over a group-wise int8 / int4 copy of the head (``quant.quantize``, scored by ``qgemv``
    with the packed kernels, by ``quant.qmatmul`` on the portable path; the same bits). Same interface and counters
    as :class:`CertifiedHead`; ``mode`` is the ``EngineConfig.lm_head`` name (:data:`QUANT_HEADS`)."""

    def __init__(self, exact: ProjectionGroup, bits: int, group: int, max_fraction: float = MAX_FRACTION,
                 mode: str = "certified_q4"):
        _check_exact(exact)
        self.exact, self.max_fraction, self.mode = exact, float(max_fraction), mode
        self.bits, self.group = bits, group
        W = exact.S
        self.V, self.d = W.shape
        self.dtype = W.dtype
        qt, meta = quantize_head_q(W.cpu(), bits, group)
        self.kernel = bool(exact.gemv.packed)
        if self.kernel:
            from .kernels import ops

            if ops.qgemv_isa() == "none":
                raise RuntimeError("the certified head's qgemv needs AVX512 or AVX2 beside the packed GEMV kernel")
            self.Q, self.Qs, self.meta = ops.qpack(qt.data, qt.scale, bits, group, self.V, self.d), qt.scale, meta
            self.path = (f"{exact.gemv.name}: int{bits} group-{group} approximate head (qgemv, {ops.qgemv_isa()}) + "
                         "exact packed blocks (gemv)")
        else:
            self.Q, self.Qs, self.meta = qt.data.to(W.device), qt.scale.to(W.device), meta.to(W.device)
            self.path = (f"portable: int{bits} group-{group} approximate head (quant.qmatmul) + exact rows by torch.mm "
                         "on their columns")
        self.stats = torch.zeros(len(_STATS), dtype=torch.long, device="cpu" if self.kernel else W.device)

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        from .kernels.gemv import LRK_MAX_ROWS

        if x.dim() != 2 or x.shape[0] > LRK_MAX_ROWS:
            return self.exact(x)
        E = self.exact.S_p.P if self.kernel else self.exact.S_t
        return [certified_head_q(x, self.Q, self.Qs, self.meta, E, self.bits, self.group, self.kernel,
                                 self.max_fraction, self.stats)]

    @property
    def approx_nbytes(self) -> int:
        """Bytes every certified call reads: the copy's codes and fp16 scales, and the per-row (a, b)."""
        return quant.quantized_nbytes(self.V, self.d, self.bits, self.group) + self.meta.numel() * 4

    @property
    def stored_nbytes(self) -> int:
        return self.exact.stored_nbytes + self.approx_nbytes

    def report(self) -> dict:
        return {**super().report(), "bits": self.bits, "group": self.group}


class QuantHead:
    """The APPROXIMATE head (``lm_head="q8"`` / ``"q4"``): decode logits (up to ``LRK_MAX_ROWS`` rows) are the
    group-wise quantized head's, ``quant.qmatmul``'s product (``qgemv`` with the packed kernels, bit for bit), so
    they differ from the exact head's and so may the greedy tokens (measured in the module docstring). Prefill and
    larger batches run the exact head (kept). For shapes whose head has no margins (random weights), where no
    certified head can skip rows."""

    def __init__(self, exact: ProjectionGroup, bits: int, group: int, mode: str = "q4"):
        _check_exact(exact)
        self.exact, self.bits, self.group, self.mode = exact, bits, group, mode
        W = exact.S
        self.V, self.d = W.shape
        qt = quant.quantize(W.cpu(), bits, group)
        self.kernel = bool(exact.gemv.packed)
        if self.kernel:
            from .kernels import ops

            if ops.qgemv_isa() == "none":
                raise RuntimeError("the quantized head's qgemv needs AVX512 or AVX2 beside the packed GEMV kernel")
            self.Q = ops.qpack(qt.data, qt.scale, bits, group, self.V, self.d)
            self.path = f"{exact.gemv.name}: int{bits} group-{group} head (qgemv, {ops.qgemv_isa()})"
        else:
            self.qt = qt.to(W.device)
            self.path = f"portable: int{bits} group-{group} head (quant.qmatmul)"

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        from .kernels.gemv import LRK_MAX_ROWS

        if x.dim() != 2 or x.shape[0] > LRK_MAX_ROWS:
            return self.exact(x)
        if self.kernel:
            from .kernels import ops

            return [ops.qgemv(x.contiguous(), [self.Q], [self.V], [self.d], [0], self.bits, self.group)]
        return [quant.qmatmul(x, self.qt)]

    @property
    def nbytes(self) -> int:
        """Weight bytes per decode token: the quantized head's codes and scales."""
        return quant.quantized_nbytes(self.V, self.d, self.bits, self.group)

    @property
    def stored_nbytes(self) -> int:
        return self.exact.stored_nbytes + self.nbytes

    def report(self) -> dict:
        return {"mode": self.mode, "path": self.path, "bits": self.bits, "group": self.group,
                "approximate": True, "head_bytes": self.V * self.d * self.exact.S.dtype.itemsize,
                "approx_bytes": self.nbytes}
