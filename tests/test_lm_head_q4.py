"""The certified LM head over a group-wise int8 / int4 copy (``lm_head="certified_q8"`` / ``"certified_q4"``) and the
approximate quantized heads (``"q8"`` / ``"q4"``), ``runtime/lm_head.py``.

The production bound (``quantize_head_q``, ``quantize_x``, ``row_bounds``) with the production quantizer
(``quant.quantize`` / ``quant.quantize_activations``) and scores (``quant.qmatmul``, which ``qgemv`` equals bit for bit)
against exact heads of three accumulation orders: random hostile heads, a second row engineered to sit within the
bound of the argmax (margins at rounding scale), and one input per term of the bound that the term decides. The op:
kernel against the exact packed GEMV bit for bit on every evaluated row, and against the portable op. The engine:
the exact head's greedy tokens, the certified path counted.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lowrank_lib import quant
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.lm_head import (APPROX_HEADS, BLOCK, QUANT_HEADS, certified_head_q, certify, quantize_head_q,
                                         quantize_x, row_bounds)

from kernel_isa import kernel_isa, lrk_runs  # noqa: F401  (kernel_isa: the fixture)
from kernel_isa import needs_lrk as needs_kernel
from test_lm_head import _Fixed, _assert_exact_argmax, _bf16_tie, _cancellation, _exact64, _head, _lowrank, _sequential, _x

U = 2.0 ** -24


def _quantizable(W, bits):
    """``quant.quantize`` refuses a group whose scale overflows fp16 (max |w| / qmax > 65504): so does the head."""
    return float(W.float().abs().max()) / quant.QMAX[bits] < 65000


def _certify_q(W, x, exact, dtype, bits, group, frac=1.0):
    """The production certification over the group-wise copy, against the exact head ``exact`` [N, V]."""
    V, d = W.shape
    qt, meta = quantize_head_q(W, bits, group)
    zh = quant.qmatmul(x.float(), qt)
    hn, rn = quantize_x(x, group)
    bd = row_bounds(zh, meta[:, 0], meta[:, 1], hn, rn, dtype == torch.bfloat16)
    y, c = certify(zh, bd, lambda blocks: {b: exact[:, b * BLOCK:(b + 1) * BLOCK]
                                           for b in (range(-(-V // BLOCK)) if blocks is None else blocks)},
                   dtype, frac)
    return y, c, zh, bd


def _near_tie(data, V, d, N, dtype):
    """A random head whose row b (another block) is the argmax row a plus eps along x: the exact logits differ by eps,
    from a few units of rounding (2^-22 |logit|) up to about the bound; their quantized copies differ at random."""
    W = _head(data, max(V, BLOCK + 2), d, torch.float32)
    x = _x(data, N, d, torch.float32, W)
    V = W.shape[0]
    a = int(_exact64(x[:1], W, torch.float32).argmax())
    b = data.draw(st.integers(0, V - 1).filter(lambda i: i // BLOCK != a // BLOCK), label="b")
    xn2 = float(x[0].double().norm()) ** 2
    if xn2 > 0:
        scale = data.draw(st.sampled_from([2.0 ** -22, 2.0 ** -16, 2.0 ** -10, 2.0 ** -5]), label="eps_scale")
        eps = data.draw(st.integers(-4, 4), label="eps") * scale * (abs(float(W[a].double() @ x[0].double())) + 1e-30)
        W[b] = (W[a].double() + eps * x[0].double() / xn2).float()
    return W.to(dtype), x.to(dtype)


def _tight(data, bits, group):
    """fp32, the bound made nearly TIGHT: x = +-c in every column (|x|_1 = sqrt(d) |x|, Cauchy-Schwarz exact along
    sign(x)), quantised exactly (c = 32767 2^-10: r = 0); row b's weights sit just inside half a step of their codes
    towards sign(x) (the scale fixed by one code at qmax), so its error e_b . x = (1 - eta) |e_b| |x| nearly; row a
    (another block) exactly representable, its logit a fraction ``at`` of the way from b's score to b's logit: b wins
    the exact head, while its score trails a's by at |e_b . x|. Half the bound drops b."""
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2 ** 31 - 1), label="tseed"))
    qmax = quant.QMAX[bits]
    d = data.draw(st.integers(8, 96), label="td")
    V = 3 * BLOCK
    sgn = torch.where(torch.rand(d, generator=g) < 0.5, -1.0, 1.0)
    x = (sgn * 32767 * 2.0 ** -10)[None]
    s = 2.0 ** -6
    eta = data.draw(st.sampled_from([2.0 ** -4, 2.0 ** -8]), label="eta")
    q = torch.randint(-qmax + 1, qmax, (d,), generator=g).float()
    q[::group] = qmax                                             # every group's amax: its scale is s exactly
    wb = s * (q + 0.5 * (1 - eta) * sgn)
    wb[::group] = s * qmax
    W = torch.zeros(V, d)
    W[:, 0] = -1000 * sgn[0]                                      # every other row: far below
    bb = BLOCK + data.draw(st.integers(0, 2 * BLOCK - 1), label="tb")
    W[bb] = wb
    zb = float((s * q).double() @ x[0].double())                  # b's score (exact: r = 0, scales exact)
    lb = float(wb.double() @ x[0].double())
    at = data.draw(st.sampled_from([0.55, 0.7, 0.9]), label="at")
    W[0] = 0
    W[0, 0] = (zb + at * (lb - zb)) / float(x[0, 0])            # a: one weight, logit between b's score and logit
    return W, x


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), V=st.integers(1, 300), d=st.integers(1, 80), N=st.integers(1, 4),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), frac=st.sampled_from([0.0, 0.25, 1.0]),
       bits=st.sampled_from([8, 4]), group=st.sampled_from([32, 64]),
       kind=st.sampled_from(["random", "near_tie", "tight", "cancellation", "bf16_tie"]))
def test_production_q_bound_gives_the_exact_argmax_in_any_accumulation_order(data, V, d, N, dtype, frac, bits, group,
                                                                             kind):
    """The production bound of the group-wise copy: random hostile heads, a near tie engineered within the bound,
    a nearly tight one (:func:`_tight`: half the bound drops the winner), and the int8 suite's rounding-scale heads
    (gamma / bf16 ties), against float64-rounded-once and both sequential fp32 exact heads."""
    order = None
    if kind == "random":
        W = _head(data, V, d, dtype)
        x = _x(data, N, d, dtype, W)
    elif kind == "near_tie":
        W, x = _near_tie(data, V, d, N, dtype)
    elif kind == "tight":
        (W, x), dtype, frac = _tight(data, bits, group), torch.float32, 1.0
    else:
        W, x, dtype, order = (_cancellation if kind == "cancellation" else _bf16_tie)(data)
        frac = 1.0
    assume(_quantizable(W, bits))
    cols = list(range(W.shape[1])) if order is None else order
    for exact in (_exact64(x, W, dtype), _sequential(x, W, dtype, cols), _sequential(x, W, dtype, cols[::-1])):
        y, c, zh, bd = _certify_q(W, x, exact, dtype, bits, group, frac)
        _assert_exact_argmax(y, c, exact)
        assert (bd >= 0).all()


def _term_case(term, bits):
    """One input the term decides (row a = 0, row b = BLOCK, every other row far below): ``"e_term"``: row b =
    (qmax, 0.5) quantises to (qmax, 0), x = (0, 32767) along its error, b's score 0, its logit 16383.5, a's 8191.75;
    ``"r_term"``: x = (0.5, 32767) quantises to (0, 32767), row b = (2 qmax, 0) is exact, its score 0 and logit
    qmax, row a's logit qmax / 2 along x's second column."""
    qmax = quant.QMAX[bits]
    V = 3 * BLOCK
    W = torch.tensor([0.0, -1.0]).repeat(V, 1)
    if term == "e_term":
        W[0], W[BLOCK] = torch.tensor([0.0, 0.25]), torch.tensor([float(qmax), 0.5])
        x = torch.tensor([[0.0, 32767.0]])
    else:
        W[0], W[BLOCK] = torch.tensor([0.0, qmax / 2 / 32767]), torch.tensor([2.0 * qmax, 0.0])
        x = torch.tensor([[0.5, 32767.0]])
    return W, x, torch.float32, None


@pytest.mark.parametrize("case, bits", [("gamma_fp32", 8), ("bf16_term", 8), ("e_term", 8), ("e_term", 4),
                                        ("r_term", 8), ("r_term", 4)])
def test_production_q_bound_each_term_decides(case, bits):
    """One input per term, each one the term decides: without it the wrong row wins (checked by removing each term).
    ``gamma_fp32`` is decided by the two gamma terms together (the exact kernel's gamma_d |w| |x| and the score's
    gamma_{G+2} |w^| (|x| + |r|): either one alone covers this cancellation); 8u |zh| decides no input found. The
    gamma and bf16 cases run at 8 bits, where the copy of these heads is exact (at 4 bits the e term covers them)."""
    if case == "gamma_fp32":
        W, x, dtype, order = _cancellation(_Fixed(pairs=5, t_b=3, quarters=2, b=BLOCK, small_at=5))
    elif case == "bf16_term":
        W, x, dtype, order = _bf16_tie(_Fixed(c_a=31, c_b=1, exp=0, a=0, b=BLOCK))
    else:
        W, x, dtype, order = _term_case(case, bits)
    exact = _sequential(x, W, dtype, order)
    y, c, zh, bd = _certify_q(W, x, exact, dtype, bits, 32)
    a, b = 0, BLOCK
    best = b if zh[0, a] > zh[0, b] else a
    assert int(exact.argmax()) == best and best == (a if case == "bf16_term" else b)
    assert not c["fallback"] and c["exact_rows"] == 2 * BLOCK
    _assert_exact_argmax(y, c, exact)


def test_quantize_head_q_and_x_bounds_hold_elementwise():
    W = torch.randn(300, 70) * torch.logspace(-3, 3, 300)[:, None]
    W[5] = 0
    for bits in (8, 4):
        qt, meta = quantize_head_q(W, bits, 32)
        Wh = qt.dequantize().double()
        assert (meta[:, 0].double() >= (W.double() - Wh).norm(dim=1)).all()
        assert (meta[:, 1].double() >= Wh.norm(dim=1)).all() and meta[5].abs().sum() == 0
    x = torch.randn(3, 70) * torch.tensor([[1e-3], [1.0], [1e3]])
    xq, xs = quant.quantize_activations(x, 32)
    xh = (xq.double().view(3, 3, 32) * xs.double()[..., None]).view(3, 96)[:, :70]
    hn, rn = quantize_x(x, 32)
    assert (hn.double() >= x.double().norm(dim=1)).all()
    assert (rn.double() >= (x.double() - xh).norm(dim=1)).all()
    with pytest.raises(ValueError, match="finite head"):
        quantize_head_q(torch.tensor([[1.0, float("nan")]]), 8, 32)


# --------------------------------------------------------------------------- the op: kernel and portable
@needs_kernel
@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(data=st.data(), V=st.integers(1, 400), d=st.integers(1, 130), N=st.integers(1, 8),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), frac=st.sampled_from([0.0, 0.25, 1.0]),
       bits=st.sampled_from([8, 4]), group=st.sampled_from([32, 64]))
def test_kernel_op_is_the_exact_kernels_bit_for_bit_and_the_portable_ops_selection(data, V, d, N, dtype, frac, bits,
                                                                                     group):
    """The kernel path (``qgemv`` scores, ``gemv`` on views of the exact packed head's selected blocks): every
    evaluated row is the exact packed GEMV's bits, every other row below its best; the portable path (qmatmul,
    torch.mm) selects the same rows and leaves the same approximate scores."""
    from lowrank_lib.runtime.kernels import ops

    if data.draw(st.booleans(), label="near_tie"):
        W, x = _near_tie(data, V, d, N, dtype)
        V = W.shape[0]
    else:
        W = _head(data, V, d, dtype)
        x = _x(data, N, d, dtype, W)
    assume(_quantizable(W, bits))
    qt, meta = quantize_head_q(W, bits, group)
    P = ops.pack(W.contiguous())
    sk, sp = torch.zeros(5, dtype=torch.long), torch.zeros(5, dtype=torch.long)
    y = certified_head_q(x, ops.qpack(qt.data, qt.scale, bits, group, V, d), qt.scale, meta, P, bits, group, True,
                         frac, sk)
    exact = ops.gemv(x, [P], [V], [d], [0])
    assert y.dtype == dtype and y.shape == (N, V)
    assert torch.equal(y.argmax(1), exact.argmax(1))
    same = y == exact
    assert ((~same) <= (y < exact.max(1, keepdim=True).values)).all()
    calls, rows, fb, cands, ex_rows = sk.tolist()
    assert calls == 1 and rows == N and N <= cands <= N * V and 0 < ex_rows <= V
    if fb:
        assert torch.equal(y, exact) and ex_rows == V
    Wt = W.t().contiguous()
    yp = certified_head_q(x, qt.data, qt.scale, meta, Wt, bits, group, False, frac, sp)
    assert sp.tolist() == sk.tolist()                            # the same scores and bounds: the same selection
    # the portable op's exact rows are torch.mm on their block's columns: its exact head is that, block by block
    # (aten's full-width mm may round a rounding-scale near tie the other way)
    mm = torch.cat([torch.mm(x, Wt[:, b:b + BLOCK]) for b in range(0, V, BLOCK)], 1)
    skipped = (y != exact) & (yp != mm)                          # approximate in both: the same rounded-down score
    assert torch.equal(y[skipped], yp[skipped])
    assert torch.equal(yp.argmax(1), mm.argmax(1))


def test_non_finite_x_runs_the_exact_head_and_says_so():
    W = torch.randn(200, 40)
    qt, meta = quantize_head_q(W, 4, 32)
    x = torch.randn(2, 40)
    x[1, 3] = float("inf")
    stats = torch.zeros(5, dtype=torch.long)
    y = certified_head_q(x, qt.data, qt.scale, meta, W.t(), 4, 32, False, 0.25, stats)
    assert torch.equal(y.isnan(), torch.mm(x, W.t()).isnan()) and stats.tolist() == [1, 2, 1, 0, 200]


# --------------------------------------------------------------------------- the engine
@pytest.mark.parametrize("mode", list(QUANT_HEADS))
@pytest.mark.parametrize("kernels", [pytest.param("lrk", marks=lrk_runs), "portable"])
def test_engine_q_certified_head_gives_the_exact_greedy_tokens(mode, kernels):
    """The engine with the certified group-wise head: the exact head's greedy tokens; the certified path ran (its
    calls counted apart from the fallbacks, which the tiny random model also needs on some steps)."""
    model = _lowrank()
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(4))
    base = dict(max_batch=2, max_seq_len=40, kernels=kernels)
    ref = Engine(model, EngineConfig(**base)).generate(ids, 16, return_logits=True)
    eng = Engine(model, EngineConfig(**base, lm_head=mode))
    eng.lm_head.max_fraction = 1.0                # certify every step (tiny random heads have small margins)
    out = eng.generate(ids, 16, return_logits=True)
    assert torch.equal(out.tokens, ref.tokens)
    rep = eng.report()["lm_head"]
    assert rep["mode"] == mode and rep["bits"] == QUANT_HEADS[mode][0] and rep["calls"] >= 15
    assert rep["certified_calls"] > 0 and rep["fallback_calls"] + rep["certified_calls"] == rep["calls"], rep
    assert ("qgemv" in rep["path"]) == (kernels == "lrk")
    for y, e in zip(out.logits[1:], ref.logits[1:]):
        assert torch.equal(y.argmax(-1), e.argmax(-1))
    # int8: some rows were never multiplied exactly; int4's bound (|e| ~ 10 % of |w|) admits every block of this
    # random head (no margins): its skipping is covered by the op tests above
    assert (rep["exact_rows"] < rep["calls"] * ref.logits[0].shape[-1]) == (mode == "certified_q8"), rep


@pytest.mark.parametrize("mode", list(APPROX_HEADS))
@pytest.mark.parametrize("kernels", [pytest.param("lrk", marks=lrk_runs), "portable"])
def test_engine_approximate_head_is_the_quantized_product(mode, kernels):
    """``lm_head="q8"`` / ``"q4"``: the decode logits ARE quant.qmatmul's over the quantized head (bit for bit,
    kernel or portable), not the exact head's; bytes per token are the quantized head's."""
    model = _lowrank()
    ids = torch.randint(0, 512, (1, 9), generator=torch.Generator().manual_seed(5))
    eng = Engine(model, EngineConfig(max_seq_len=40, kernels=kernels, lm_head=mode))
    bits, group = APPROX_HEADS[mode]
    x = torch.randn(3, eng.lm_head.d)
    qt = quant.quantize(eng.lm_head.exact.S, bits, group)
    assert torch.equal(eng.lm_head(x)[0], quant.qmatmul(x, qt))
    assert not torch.equal(eng.lm_head(x)[0], eng.lm_head.exact(x)[0])
    out = eng.generate(ids, 6)
    assert out.tokens.shape == (1, 6)
    rep = eng.report()["lm_head"]
    assert rep["mode"] == mode and rep["approximate"] and rep["approx_bytes"] == quant.quantized_nbytes(
        eng.lm_head.V, eng.lm_head.d, bits, group)
    exact = Engine(model, EngineConfig(max_seq_len=40, kernels=kernels))
    assert eng.weight_bytes_per_token() - exact.weight_bytes_per_token() == rep["approx_bytes"] - exact.lm_head.nbytes


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="lm_head="):
        EngineConfig(lm_head="certified_q3")
