"""The packed GEMV of quantized matrices (``qgemv.cpp``: ops ``qpack``, ``qunpack``, ``qgemv``; issue 30).

The kernel implements the one semantic of quantized factors with exactly rounded steps in a fixed order, so it must
equal its portable path (``lowrank_lib.quant.qmatmul``) BIT FOR BIT: at every ISA path this CPU has
(AVX-512 + VNNI, AVX-512BW without VNNI, AVX2, forced with ``build.limit_isa``), every bit width and group, fp32 and
bf16 activations, 1..8 rows, odd shapes (outputs not a multiple of the 16 / 64 block, inputs not a multiple of the
group, rank-like widths), several matrices reading slices of x, and 1 / 2 / 3 threads.
"""
from __future__ import annotations

import pytest
import torch

from lowrank_lib.quant import QuantizedTensor, qmatmul
from lowrank_lib.runtime.kernels import build

from kernel_isa import LIB, THREADS, num_threads

GROUPS = (32, 64, 128, 256)
DTYPES = (torch.float32, torch.bfloat16)
QMAX = {8: 127, 4: 7}

# the ISA paths of qgemv this CPU has, as (limit_isa level, the path qgemv_isa() must report)
_AVX512 = ("avx512f", "avx512bw", "avx512vl")
PATHS = [(lvl, path) for lvl, path, ok in (
    ("all", "avx512_vnni", LIB.has(*_AVX512, "avx512_vnni")),
    ("avx512_no_vnni", "avx512bw", LIB.has(*_AVX512)),
    ("avx2", "avx2", LIB.has("avx2", "fma")),
) if ok]


@pytest.fixture(params=PATHS or [("none", "none")], ids=lambda p: p[1])
def qisa(request):
    """Every call of the test on one of qgemv's ISA paths (and the op says it runs that path)."""
    level, path = request.param
    if level == "none":
        pytest.skip(f"qgemv cannot run here: {LIB.reason}, isa={LIB.isa}")
    with build.limit_isa(level):
        assert _ops().qgemv_isa() == path
        yield path


def _ops():
    from lowrank_lib.runtime.kernels import ops

    return ops


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- random quantized matrices
def _pad(n, g):
    return -(-n // g) * g


def _random_quantized(out, inp, bits, g, gen):
    """Canonical storage of a random quantized [out, inp] matrix: every code value (int4: -8 .. 7, the stored nibbles
    0 .. 15), fp16 scales of several magnitudes, some zero; padding columns zero as the spec stores them."""
    p = _pad(inp, g)
    lo, hi = (-128, 127) if bits == 8 else (-8, 7)
    q = torch.randint(lo, hi + 1, (out, p), generator=gen, dtype=torch.int8)
    q[:, inp:] = 0
    scale = (torch.rand(out, p // g, generator=gen) * 10.0 ** torch.randint(-4, 1, (out, p // g), generator=gen))
    scale[torch.rand(out, p // g, generator=gen) < 0.05] = 0
    scale = scale.to(torch.float16)
    if bits == 8:
        return q, scale
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous(), scale


def _ref(x, data, scale, bits, g):
    """The portable path of the spec (``quant.qmatmul``) on the same canonical storage."""
    out, inp = data.shape[0], x.shape[1]
    return qmatmul(x, QuantizedTensor(data, scale, bits, g, (out, inp)))


def _same(y, ref):
    """Bitwise equal, NaN where the reference has NaN."""
    assert y.dtype == ref.dtype and y.shape == ref.shape
    nan = torch.isnan(ref)
    assert torch.equal(torch.isnan(y), nan), "NaN positions differ"
    diff = (y.double() - ref.double()).abs()[~nan]
    assert torch.equal(y[~nan], ref[~nan]), f"max |diff| {float(diff.max())} of {float(ref.abs().max())}"


# --------------------------------------------------------------------------- qpack / qunpack
@pytest.mark.skipif(not PATHS, reason=f"the kernel library cannot run here: {LIB.reason}")
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("g", GROUPS)
def test_qpack_qunpack_round_trip_and_size(bits, g):
    ops = _ops()
    gen = _gen(bits * 1000 + g)
    for out, inp in [(1, 1), (15, 3), (17, 33), (64, 64), (90, 70), (130, 300), (209, 576)]:
        data, scale = _random_quantized(out, inp, bits, g, gen)
        P = ops.qpack(data, scale, bits, g, out, inp)
        rows = (out // 64) * 64 + -(-(out % 64) // 16) * 16                 # blocks of 64, tail rounded to 16
        G = _pad(inp, g) // g
        assert P.dtype == torch.uint8 and P.shape == (rows * G * (g * bits // 8 + 2),)
        d2, s2 = ops.qunpack(P, bits, g, out, inp)
        assert torch.equal(d2, data) and torch.equal(s2.view(torch.int16), scale.view(torch.int16))
        # every stored byte of codes and scales is in the blob once (a permutation plus padding rows)
        pad_code = 0 if bits == 8 else 0x88                                  # padding rows: q = 0, scale 0
        npad = (rows - out) * G * (g * bits // 8)
        assert int((P == pad_code).sum()) >= npad


# --------------------------------------------------------------------------- qgemv against the spec
SHAPES = [(1, 1), (7, 5), (16, 16), (47, 33), (64, 64), (90, 70), (80, 129), (193, 37), (130, 300)]


@pytest.mark.skipif(not PATHS, reason=f"the kernel library cannot run here: {LIB.reason}")
@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("g", GROUPS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_qgemv_equals_spec_bitwise_rows_and_odd_shapes(bits, g, dtype):
    """Every ISA path against one reference per case (the portable product is the slow part of this file)."""
    ops = _ops()
    gen = _gen(bits * 7 + g)
    for out, inp in SHAPES:
        data, scale = _random_quantized(out, inp, bits, g, gen)
        P = ops.qpack(data, scale, bits, g, out, inp)
        for N in range(1, 9):
            x = (torch.randn(N, inp, generator=gen) * 3).to(dtype)
            x[:, ::5] *= 100                                                 # groups of very different ranges
            if N > 2:
                x[1, : min(inp, g)] = 0                                      # a whole group of zeros
            ref = _ref(x, data, scale, bits, g)
            for level, path in PATHS:
                with build.limit_isa(level):
                    assert ops.qgemv_isa() == path
                    _same(ops.qgemv(x, [P], [out], [inp], [0], bits, g), ref)


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("dtype", DTYPES)
def test_qgemv_segmented_strided_every_thread_count(qisa, bits, dtype):
    """Several matrices in one call (rank-space widths, overlapping slices of a strided x), split over 1, 2, 3 threads
    with the pool's threshold at one byte: the same bits as the spec at every count, and the call really split."""
    ops = _ops()
    g = 32
    gen = _gen(bits + 50)
    shapes = [(300, 37), (5, 21), (129, 64), (64, 3)]
    xoffs = [0, 37, 10, 58]
    mats = [_random_quantized(o, i, bits, g, gen) for o, i in shapes]
    Ps = [ops.qpack(d, s, bits, g, o, i) for (d, s), (o, i) in zip(mats, shapes)]
    for N in (1, 3, 8):
        big = (torch.randn(N, 200, generator=gen)).to(dtype)
        x = big[:, 50:130]
        assert not x.is_contiguous() or N == 1
        ref = torch.cat([_ref(x[:, o:o + i], d, s, bits, g) for (d, s), (_, i), o in zip(mats, shapes, xoffs)], 1)
        with build.pool(min_bytes=1):
            for n in THREADS:
                before = build.pool_info()
                with num_threads(n):
                    y = ops.qgemv(x, Ps, [o for o, _ in shapes], [i for _, i in shapes], xoffs, bits, g)
                _same(y, ref)
                if n > 1:
                    assert build.pool_info()["parallel_calls"] > before["parallel_calls"], "the call was not split"


@pytest.mark.parametrize("bits", (8, 4))
def test_qgemv_default_split_same_bits_at_a_real_shape(qisa, bits):
    """A 1536 x 576 matrix (SmolLM2's MLP class) at the pool's default threshold: 1, 2, 3 threads give one result,
    the spec's."""
    ops = _ops()
    g = 128
    gen = _gen(bits + 60)
    data, scale = _random_quantized(1536, 576, bits, g, gen)
    P = ops.qpack(data, scale, bits, g, 1536, 576)
    x = torch.randn(2, 576, generator=gen).to(torch.bfloat16)
    ys = []
    for n in THREADS:
        with num_threads(n):
            ys.append(ops.qgemv(x, [P], [1536], [576], [0], bits, g))
    for y in ys:
        _same(y, _ref(x, data, scale, bits, g))


def test_qgemv_non_finite_rows_give_nan_like_the_spec(qisa):
    """A row with Inf or NaN in a matrix's columns: that row's outputs are NaN (the spec's scale xs is non-finite), the
    other rows are unaffected; a group whose max is tiny (32767 / max overflows) still quantizes as the spec does."""
    ops = _ops()
    g = 32
    gen = _gen(70)
    data, scale = _random_quantized(40, 70, 8, g, gen)
    P = ops.qpack(data, scale, 8, g, 40, 70)
    x = torch.randn(4, 70, generator=gen)
    x[0, 3] = float("inf")
    x[1, 40] = float("nan")
    x[2, :32] = torch.tensor(1e-37)                                          # inv = 32767 / 1e-37 = inf
    x[2, 5] = 0
    y = ops.qgemv(x, [P], [40], [70], [0], 8, g)
    ref = _ref(x, data, scale, 8, g)
    _same(y, ref)
    assert torch.isnan(y[:2]).all() and torch.isfinite(y[2:]).all()


@pytest.mark.skipif(not PATHS, reason=f"the kernel library cannot run here: {LIB.reason}")
@pytest.mark.parametrize("bits", (8, 4))
def test_qgemv_fakes_and_torch_compile(bits):
    """The ops' fake functions (``build._register_fakes``) give the shapes and dtypes the kernels return, so a compiled
    step can call qgemv as one extern op (fullgraph, shape-dependent ops after it) and gets the eager bits."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ops = _ops()
    data, scale = _random_quantized(70, 45, bits, 32, _gen(85))
    P = ops.qpack(data, scale, bits, 32, 70, 45)
    x = torch.randn(3, 50).to(torch.bfloat16)
    args = ([70, 70], [45, 45], [0, 5], bits, 32)
    y = ops.qgemv(x, [P, P], *args)
    unpacked = ops.qunpack(P, bits, 32, 70, 45)
    with FakeTensorMode() as mode:
        fy = ops.qgemv(mode.from_tensor(x), [mode.from_tensor(P)] * 2, *args)
        fu = ops.qunpack(mode.from_tensor(P), bits, 32, 70, 45)
    for real, fake in [(y, fy), *zip(unpacked, fu)]:
        assert fake.shape == real.shape and fake.dtype == real.dtype
    f = torch.compile(lambda x: ops.qgemv(x, [P, P], *args).view(3, 2, 70).float().sum(1), backend="aot_eager",
                      fullgraph=True)
    assert torch.equal(f(x), y.view(3, 2, 70).float().sum(1))


def test_qgemv_hostile_arguments(qisa):
    ops = _ops()
    g = 32
    data, scale = _random_quantized(20, 10, 8, g, _gen(80))
    P = ops.qpack(data, scale, 8, g, 20, 10)
    x = torch.randn(1, 10)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ops.qgemv(x.half(), [P], [20], [10], [0], 8, g)
    with pytest.raises(RuntimeError, match="fp32 or bf16"):
        ops.qgemv(x.double(), [P], [20], [10], [0], 8, g)
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        ops.qgemv(torch.randn(9, 10), [P], [20], [10], [0], 8, g)
    with pytest.raises(RuntimeError, match="one out, in and x offset per matrix"):
        ops.qgemv(x, [P], [20, 3], [10], [0], 8, g)
    with pytest.raises(RuntimeError, match="one out, in and x offset per matrix"):
        ops.qgemv(x, [P, P], [20, 20], [10, 10], [0], 8, g)
    with pytest.raises(RuntimeError, match="not a packed"):
        ops.qgemv(x, [P], [33], [10], [0], 8, g)                            # wrong shape for this blob
    with pytest.raises(RuntimeError, match="not a packed"):
        ops.qgemv(x, [P], [20], [10], [0], 4, g)                            # wrong bit width for this blob
    with pytest.raises(RuntimeError, match="not a packed"):
        ops.qgemv(x, [P.view(torch.int8)], [20], [10], [0], 8, g)           # wrong dtype
    with pytest.raises(RuntimeError, match="reads columns"):
        ops.qgemv(x, [P], [20], [10], [1], 8, g)                            # slice beyond x
    with pytest.raises(RuntimeError, match="unit column stride"):
        ops.qgemv(torch.randn(10, 2).t(), [P], [20], [10], [0], 8, g)
    with pytest.raises(RuntimeError, match="bits must be 8 or 4"):
        ops.qgemv(x, [P], [20], [10], [0], 2, g)
    with pytest.raises(RuntimeError, match="group must be"):
        ops.qgemv(x, [P], [20], [10], [0], 8, 16)
    with pytest.raises(RuntimeError, match="codes of a"):
        ops.qpack(data.to(torch.uint8), scale, 8, g, 20, 10)                # int8 codes expected
    with pytest.raises(RuntimeError, match="codes of a"):
        ops.qpack(data, scale, 4, g, 20, 10)                                # int4 codes are [out, in_pad / 2] uint8
    with pytest.raises(RuntimeError, match="scales of a"):
        ops.qpack(data, scale.float(), 8, g, 20, 10)
    with pytest.raises(RuntimeError, match="not a packed"):
        ops.qunpack(P, 8, g, 20, 40)


@pytest.mark.skipif(not PATHS, reason=f"the kernel library cannot run here: {LIB.reason}")
def test_qgemv_refuses_without_any_isa():
    ops = _ops()
    data, scale = _random_quantized(20, 10, 8, 32, _gen(90))
    P = ops.qpack(data, scale, 8, 32, 20, 10)
    with build.limit_isa("none"):
        assert ops.qgemv_isa() == "none"
        with pytest.raises(RuntimeError, match="lacks"):
            ops.qgemv(torch.randn(1, 10), [P], [20], [10], [0], 8, 32)
