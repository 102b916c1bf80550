"""The fused tier attention (``runtime/kernels/tiers.cpp``, ``kv.tiers`` backend ``lrk_tiers``) against the portable
path that defines the result (``kv.tiers.attend_portable``).

Layouts are random and ragged: empty exact tiers, segments without runs, several runs of different ranks (rank 0
included), rows that are no multiple of the vector width or of the kernel's 256-token chunk, int8 factors with
fp16 and fp32 scales, zero or some appended rows, B = 2, G = 1..5, d = 16..128. fp32 must equal the portable path
to 1e-5 relative; bf16 must be the correctly rounded float64 evaluation of the same stored values to one ulp.
Also: the device-side appended count (garbage past it is never read), several threads (long segments split and merged;
every layout split into pieces at 1, 2 and 3 threads; the same bits at every thread count when unsplit),
``torch.compile`` with no graph break and no recompile as the count grows, hostile layouts refused by name, and the
backend choice with its reason (and the portable fallback without the library). The kernel's arithmetic runs under
each ISA level the CPU has (``tests/kernel_isa.py``: its AVX-512 code and its AVX2 + FMA code).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from lowrank_lib.kv import tiers
from lowrank_lib.kv.tiers import Run, Segment, TieredLayer, attend, attend_portable, select_backend
from lowrank_lib.runtime.kernels import build

from kernel_isa import LIB, THREADS, kernel_isa, needs_lrk, needs_lrk_native, num_threads  # noqa: F401 (the fixture)

#: bf16: the kernel computes in fp32 and rounds the output once, so every element is within one bf16 ulp of the
#: correctly rounded float64 evaluation of the same stored values (a fp32 rounding can only flip a near-tie), and
#: nearly all are equal to it
BF16_ULPS, BF16_EQUAL = 1, 0.98


def bf16_ulps(out: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """|out - round_bf16(exact)| in units of the bf16 spacing at round_bf16(exact) (elementwise)."""
    r = exact.to(torch.bfloat16).double()
    ulp = torch.ldexp(torch.ones_like(r), torch.frexp(r).exponent - 8).clamp_min(2.0 ** -133)
    return (out.double() - r).abs() / ulp


def make_layer(B=2, H=3, d=64, seed=0, dtype=torch.float32, quant8=False, max_exact=300, max_run=300, max_runs=3,
               max_rank=9, appended=5, cap=None, big_scale=False, blocked=False):
    """A random ragged layer (segment sizes drawn per segment; some empty) with ``appended`` rows written;
    ``blocked``: its exact keys in the fused kernel's blocked layout (``TieredLayer.block_exact_k``, 16-bit only)."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g)
    ri = lambda lo, hi: int(torch.randint(lo, hi + 1, (), generator=g))
    segs = []
    for b in range(B):
        row = []
        for h in range(H):
            ne = ri(0, max_exact) if ri(0, 3) else 0                         # a quarter of the tiers are empty
            runs = []
            for _ in range(ri(0, max_runs)):
                lo = 1 if quant8 else 0                                  # int8 rows of rank 0 cannot be scaled
                n, rk, rv = ri(1, max_run), ri(lo, max_rank), ri(lo, max_rank)
                f = 1e8 if big_scale else 1.0                                # fp32 scales (no fp16 fits)
                runs.append(Run(f * rnd(n, rk), rnd(rk, d) / f, f * rnd(n, rv), rnd(rv, d) / f))
            if ne == 0 and not runs and appended == 0:
                ne = 1
            row.append(Segment(2 * rnd(ne, d), rnd(ne, d), None, runs))
        segs.append(row)
    layer = TieredLayer.build(segs, quant8=quant8, dtype=dtype)
    if blocked:
        assert layer.block_exact_k()
    if cap is not None:
        layer.reserve(cap)
    if appended:
        layer.append((2 * rnd(B, H, appended, d)).to(dtype), rnd(B, H, appended, d).to(dtype))
    return layer


def query(layer, G, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(layer.B, layer.H * G, 1, layer.d, generator=g).to(layer.dtype)


def assert_rel(out, ref, bound):
    err = float((out.double() - ref.double()).abs().max())
    scale = float(ref.double().abs().max())
    assert err <= bound * scale, f"max error {err:.3g} > {bound:g} x {scale:.3g}"


def as_float64(layer: TieredLayer) -> TieredLayer:
    """The same stored values in float64 (int8 factors and their scales kept): the exact evaluation of them."""
    f = lambda t: None if t is None or t.dtype in (torch.int8, torch.float16) else t.double()
    return dataclasses.replace(layer, k_exact=layer.k_exact.double(), v_exact=layer.v_exact.double(),
                               a_k=layer.a_k if layer.quant8 else layer.a_k.double(),
                               a_v=layer.a_v if layer.quant8 else layer.a_v.double(), b_k=layer.b_k.double(),
                               b_v=layer.b_v.double(), k_scale=layer.k_scale if layer.k_scale is None else
                               layer.k_scale.double(), v_scale=layer.v_scale if layer.v_scale is None else
                               layer.v_scale.double(), k_new=f(layer.k_new), v_new=f(layer.v_new))


@pytest.fixture(params=[48, None], ids=["chunk48", "chunk_default"])
def chunk(request):
    """The kernel's tokens per online-softmax update: 48 (every tier of these layouts cut into many chunks, tails
    included) or the built default (4096: most layouts here in one chunk); restored after the test."""
    if not LIB.available or request.param is None:
        yield request.param
        return
    from lowrank_lib.runtime.kernels import ops

    before = ops.tier_chunk(request.param)
    yield request.param
    ops.tier_chunk(before)


# --------------------------------------------------------------------------- equal to the portable path
@needs_lrk
@pytest.mark.parametrize("quant8", [False, True])
@pytest.mark.parametrize("seed", range(4))
def test_fp32_equals_portable_ragged_layouts(quant8, seed, chunk):
    """Ragged tiers of every kind, d 64, G 3 and B 2 (SmolLM2's attention), appended rows 0 or some."""
    for appended in (0, 7):
        layer = make_layer(seed=seed, quant8=quant8, appended=appended)
        q = query(layer, 3, seed)
        assert_rel(attend(layer, q, backend="lrk_tiers"), attend_portable(layer, q), 1e-5)


@needs_lrk
@pytest.mark.parametrize("d,G,B,H", [(16, 1, 1, 1), (32, 5, 2, 2), (48, 2, 1, 4), (128, 3, 2, 1), (80, 4, 1, 2)])
def test_fp32_head_dims_group_sizes_and_long_runs(d, G, B, H, chunk):
    """Every supported head_dim class, query groups beyond one register group (G 5), runs longer than a chunk."""
    for quant8 in (False, True):
        layer = make_layer(B, H, d, seed=d + G, quant8=quant8, max_exact=700, max_run=900, max_rank=16, appended=3)
        q = query(layer, G, d)
        assert_rel(attend(layer, q, 0.3, backend="lrk_tiers"), attend_portable(layer, q, 0.3), 1e-5)


@needs_lrk
def test_int8_fp32_scales_rank_zero_runs_and_segments_of_one_tier():
    """Scales too large for fp16 (the layer stores fp32 ones); a run of rank 0 (its tokens score 0, add nothing;
    float factors only: ``quantize_rows`` cannot scale an empty row);
    a segment holding only appended rows, one holding only a run, one only exact rows."""
    layer = make_layer(seed=3, quant8=True, big_scale=True)
    assert layer.k_scale.dtype == torch.float32
    q = query(layer, 3)
    assert_rel(attend(layer, q, backend="lrk_tiers"), attend_portable(layer, q), 1e-5)
    d = 32
    g = torch.Generator().manual_seed(0)
    rnd = lambda *s: torch.randn(*s, generator=g)
    zero = Run(rnd(20, 0), rnd(0, d), rnd(20, 2), rnd(2, d))
    for quant8 in (False, True):
        runs = ([] if quant8 else [zero]) + [Run(rnd(33, 3), rnd(3, d), rnd(33, 1), rnd(1, d))]
        segs = [[Segment(rnd(0, d), rnd(0, d)), Segment(rnd(0, d), rnd(0, d), None, runs), Segment(rnd(17, d),
                                                                                                  rnd(17, d))]]
        layer = TieredLayer.build(segs, quant8=quant8)
        layer.append(rnd(1, 3, 2, d), rnd(1, 3, 2, d))
        q = torch.randn(1, 6, 1, d, generator=g)
        assert_rel(attend(layer, q, backend="lrk_tiers"), attend_portable(layer, q), 1e-5)


@needs_lrk
@pytest.mark.parametrize("blocked", [False, True], ids=["rows", "blocked"])
@pytest.mark.parametrize("quant8", [False, True])
def test_bf16_within_bound_of_the_exact_evaluation(quant8, blocked, chunk):
    """bf16 K / V / bases (and bf16 or int8 factors), exact keys as rows or blocked: every element within BF16_ULPS
    of the correctly rounded float64 evaluation of the same stored values, at least BF16_EQUAL of them equal to it
    (the portable bf16 path, with bf16 products, is farther: up to a few percent of the output scale)."""
    for seed in range(3):
        layer = make_layer(seed=seed, dtype=torch.bfloat16, quant8=quant8, blocked=blocked)
        q = query(layer, 3, seed)
        out = attend(layer, q, backend="lrk_tiers")
        assert out.dtype == torch.bfloat16
        ulps = bf16_ulps(out, attend_portable(as_float64(layer), q.double()))
        assert float(ulps.max()) <= BF16_ULPS and float((ulps == 0).double().mean()) >= BF16_EQUAL, \
            (float(ulps.max()), float((ulps == 0).double().mean()))


@needs_lrk
@pytest.mark.parametrize("d,G,B,H", [(16, 1, 1, 1), (32, 5, 2, 2), (48, 2, 1, 4), (128, 3, 2, 1), (80, 4, 1, 2)])
def test_bf16_blocked_keys_every_head_dim_and_group(d, G, B, H, chunk):
    """Blocked exact keys at every head_dim class (d 48 / 80: no multiple of 32, which the row layout's dot products
    need), query groups beyond one register group (G 5), segments starting and ending inside a block of 16 rows:
    within BF16_ULPS of the exact evaluation, as the row layout is."""
    for quant8 in (False, True):
        layer = make_layer(B, H, d, seed=d + G, dtype=torch.bfloat16, quant8=quant8, max_exact=700, max_run=300,
                           max_rank=16, appended=3, blocked=True)
        assert layer.host_e_off[-1] % 16 or any(e % 16 for e in layer.host_e_off)   # unaligned segments
        q = query(layer, G, d)
        ref = attend_portable(as_float64(layer), q.double(), 0.3)
        assert float(bf16_ulps(attend(layer, q, 0.3, backend="lrk_tiers"), ref).max()) <= BF16_ULPS


def test_blocked_keys_round_trip_and_change_no_portable_result():
    """``block_exact_k``: the rows read back (``exact_k``, any range, across block edges) are the stored rows; the
    portable result is the same bits as from the row layout; the zero rows that pad to 16 are allocated, not held;
    fp32 keys stay rows."""
    layer = make_layer(seed=4, dtype=torch.bfloat16, quant8=True)
    rows, held = layer.k_exact.clone(), layer.nbytes
    q = query(layer, 3)
    ref = attend_portable(layer, q)
    assert layer.block_exact_k() and layer.k_blocked and layer.block_exact_k()      # idempotent
    n = rows.shape[0]
    assert layer.k_exact.shape == (-(-n // 16), 32, 16, 2)
    assert torch.equal(layer.exact_k(0, n), rows) and torch.equal(layer.exact_k()[:n], rows)
    for lo, hi in ((0, 0), (3, 17), (15, 16), (16, 48), (n - 5, n), (7, n - 1)):
        assert torch.equal(layer.exact_k(lo, hi), rows[lo:hi]), (lo, hi)
    assert layer.nbytes == held and layer.allocated_nbytes >= held
    assert torch.equal(attend_portable(layer, q), ref)
    assert [len(s.k) for r in layer.to_segments() for s in r] == [len(s.k) for r in
                                                                   make_layer(seed=4, dtype=torch.bfloat16,
                                                                              quant8=True).to_segments() for s in r]
    fp32 = make_layer(seed=4)
    assert not fp32.block_exact_k() and not fp32.k_blocked


# --------------------------------------------------------------------------- appended rows, threads, compile
@needs_lrk
def test_device_side_count_reads_only_the_rows_written():
    layer = make_layer(seed=5, quant8=True, appended=0, cap=12)
    q = query(layer, 3)
    n = torch.zeros(1, dtype=torch.long)
    g = torch.Generator().manual_seed(9)
    for i in range(4):
        k, v = torch.randn(2, 3, 1, 64, generator=g), torch.randn(2, 3, 1, 64, generator=g)
        layer.k_new[:, :, i + 1:] = float("nan")                  # past the count: never read
        layer.v_new[:, :, i + 1:] = float("nan")
        layer.append(k, v, slot=n.clone())
        n += 1
        out = attend(layer, q, n_new=n, backend="lrk_tiers")
        assert torch.isfinite(out).all()
        assert_rel(out, attend_portable(layer, q, n_new=int(n)), 1e-5)
    assert_rel(attend(layer, q, n_new=torch.zeros(1, dtype=torch.long), backend="lrk_tiers"),
               attend_portable(layer, q, n_new=0), 1e-5)


@needs_lrk
def test_threads_split_long_segments_and_merge(chunk):
    """Enough work for the default parallel split: pieces spanning tiers, merged by log-sum-exp, equal the
    single-thread result and the portable path at every thread count."""
    layer = make_layer(B=1, H=2, seed=7, quant8=True, max_exact=3000, max_run=4000, max_runs=2, appended=40)
    q = query(layer, 3)
    ref = attend_portable(layer, q)
    with num_threads(1):
        one = attend(layer, q, backend="lrk_tiers")
    assert_rel(one, ref, 1e-5)
    for n in THREADS[1:]:
        calls = build.pool_info()["parallel_calls"]
        with num_threads(n):
            got = attend(layer, q, backend="lrk_tiers")
        assert build.pool_info()["parallel_calls"] == calls + 1, "the layer was not split"
        assert_rel(got, ref, 1e-5)
        assert_rel(got, one, 1e-6)


@needs_lrk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_thread_count_small_pieces_and_unsplit_bits(dtype, chunk):
    """With the pool's threshold at one byte every layout is cut into pieces (pieces ending inside runs, in the
    appended rows, single tokens) claimed by 1, 2, 3 threads: each result equals the portable path; unsplit (threshold
    above the layer) the result is the same bits at every thread count."""
    cases = ((0, False, False), (1, True, False), (2, True, False))
    if dtype == torch.bfloat16:
        cases += ((3, False, True), (4, True, True))           # blocked exact keys: pieces start inside a block
    for seed, quant8, blocked in cases:
        layer = make_layer(seed=seed, quant8=quant8, dtype=dtype, max_exact=120, max_run=150, appended=3,
                           blocked=blocked)
        q = query(layer, 3, seed)
        ref = attend_portable(layer, q) if dtype == torch.float32 else attend_portable(as_float64(layer), q.double())

        def check(out):
            if dtype == torch.float32:
                assert_rel(out, ref, 1e-5)
            else:
                assert float(bf16_ulps(out, ref).max()) <= BF16_ULPS
        with build.pool(min_bytes=1):
            for n in THREADS:
                calls = build.pool_info()["parallel_calls"]
                with num_threads(n):
                    check(attend(layer, q, backend="lrk_tiers"))
                assert build.pool_info()["parallel_calls"] == calls + (n > 1)
        with build.pool(min_bytes=1 << 60):
            outs = []
            for n in THREADS:
                with num_threads(n):
                    outs.append(attend(layer, q, backend="lrk_tiers"))
            check(outs[0])
            assert all(torch.equal(outs[0], o) for o in outs[1:])


@needs_lrk_native
def test_compiled_step_calls_the_op_without_graph_break_or_recompile(request):
    """A compiled function around the attention (fullgraph: a graph break raises) equals eager, and replays as the
    device-side count grows (the count is read by the kernel, not baked into the graph)."""
    from torch._dynamo.testing import CompileCounterWithBackend

    layer = make_layer(B=1, seed=2, quant8=True, appended=0, cap=8)
    q = query(layer, 3)
    n = torch.zeros(1, dtype=torch.long)
    pool = build.pool(threads=2, min_bytes=1)              # the kernel's pool split every call, from inductor's code
    pool.__enter__()
    request.addfinalizer(lambda: pool.__exit__(None, None, None))

    def step(q, k, v, n):
        layer.k_new.index_copy_(2, n, k)
        layer.v_new.index_copy_(2, n, v)
        o = attend(layer, q * 1.5, n_new=n + 1, backend="lrk_tiers")
        return o.sum(-1) + o.amax(-1)

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    g = torch.Generator().manual_seed(4)
    for i in range(3):
        calls = build.pool_info()["parallel_calls"]
        k, v = torch.randn(1, 3, 1, 64, generator=g), torch.randn(1, 3, 1, 64, generator=g)
        got = compiled(q, k, v, n)
        layer.n_new = i + 1
        want = attend_portable(layer, q * 1.5)
        assert_rel(got, want.sum(-1) + want.amax(-1), 1e-5)
        assert build.pool_info()["parallel_calls"] > calls     # the pool ran inside the compiled code
        n += 1
    assert counter.frame_count == 1


# --------------------------------------------------------------------------- hostile inputs
@needs_lrk_native
def test_hostile_layouts_are_refused_by_name():
    from lowrank_lib.runtime.kernels import ops

    layer = make_layer(B=1, H=2, d=32, seed=1, quant8=True, appended=2)
    q = query(layer, 2).view(1, 2, 2, 32)
    args = dict(q=q, k_exact=layer.k_exact, v_exact=layer.v_exact, e_off=layer.e_off, runs=layer.runs,
                r_off=layer.r_off, a_k=layer.a_k, a_v=layer.a_v, b_k=layer.b_k, b_v=layer.b_v, k_scale=layer.k_scale,
                v_scale=layer.v_scale, k_new=layer.k_new, v_new=layer.v_new, n_new=torch.tensor([2]), scale=0.2)
    call = lambda **kw: ops.tier_attend(**{**args, **kw})
    call()
    bad_runs = layer.runs.clone()
    bad_runs[0, tiers.AK_OFF] = layer.a_k.numel()
    with pytest.raises(RuntimeError, match="overrun a_k"):
        call(runs=bad_runs)
    bad_runs = layer.runs.clone()
    other = 1 - int(bad_runs[0, tiers.SEG])
    bad_runs[0, tiers.SEG] = other
    with pytest.raises(RuntimeError, match=f"run 0 belongs to segment {other}"):
        call(runs=bad_runs)
    with pytest.raises(RuntimeError, match="exceeds the appended capacity"):
        call(n_new=torch.tensor([layer.k_new.shape[2] + 1]))
    with pytest.raises(RuntimeError, match="n_new must be"):
        call(n_new=torch.tensor([1], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="int8 factors need k_scale"):
        call(k_scale=None)
    with pytest.raises(RuntimeError, match="k_exact must be"):
        call(k_exact=layer.k_exact.double())
    with pytest.raises(RuntimeError, match="a blocked k_exact must be contiguous bf16"):    # fp32 q, 4-D keys
        call(k_exact=torch.zeros(1, 16, 16, 2))
    blk = make_layer(B=1, H=2, d=32, seed=1, dtype=torch.bfloat16, appended=0, blocked=True)
    bargs = dict(args, q=q.bfloat16(), k_exact=blk.k_exact, v_exact=blk.v_exact, e_off=blk.e_off, runs=blk.runs,
                 r_off=blk.r_off, a_k=blk.a_k, a_v=blk.a_v, b_k=blk.b_k, b_v=blk.b_v, k_scale=None, v_scale=None,
                 k_new=None, v_new=None, n_new=torch.tensor([0]))
    ops.tier_attend(**bargs)
    with pytest.raises(RuntimeError, match=r"a blocked k_exact must be contiguous bf16 \[N_e / 16, 16, 16, 2\]"):
        ops.tier_attend(**{**bargs, "k_exact": blk.k_exact.transpose(1, 2)})
    with pytest.raises(RuntimeError, match="end at most at the rows"):
        call(e_off=layer.e_off.clone().index_fill_(0, torch.tensor([2]), layer.k_exact.shape[0] + 1))
    with pytest.raises(RuntimeError, match="head_dim must be a multiple of 16"):
        call(q=torch.randn(1, 2, 2, 24))
    with pytest.raises(RuntimeError, match=r"e_off must be \[B\*H \+ 1\]"):
        call(e_off=layer.e_off[:-1])
    empty = TieredLayer.build([[Segment(torch.zeros(0, 16), torch.zeros(0, 16)), Segment(torch.ones(1, 16),
                                                                                       torch.ones(1, 16))]])
    with pytest.raises(RuntimeError, match=r"segment 0 \(row 0, KV head 0\) holds no token"):
        attend(empty, torch.zeros(1, 2, 1, 16), backend="lrk_tiers")
    with pytest.raises(ValueError, match="one query row"):
        attend(layer, torch.zeros(1, 4, 2, 32), backend="lrk_tiers")
    top = ops.tier_chunk()
    for bad in (-16, 8, 40, top + 16):
        with pytest.raises(RuntimeError, match="a multiple of 16"):
            ops.tier_chunk(bad)
    assert ops.tier_chunk() == top


# --------------------------------------------------------------------------- backend choice
def test_backend_choice_says_why():
    cpu = torch.device("cpu")
    assert select_backend("portable", cpu, 64, torch.float32).name == "portable"
    ch = select_backend("auto", cpu, 24, torch.float32)
    assert ch.name == "portable" and "head_dim 24" in ch.reason
    with pytest.raises(RuntimeError, match="head_dim 24"):
        select_backend("lrk_tiers", cpu, 24, torch.float32)
    assert "dtype torch.float16: serves float32, bfloat16" in select_backend("auto", cpu, 64, torch.float16).reason
    with pytest.raises(ValueError, match="unknown tiered attention"):
        select_backend("fast", cpu, 64, torch.float32)
    for level in ("all", "avx2") if LIB.has("avx2", "fma") else ():
        with build.limit_isa(level):                       # AVX2 CPUs get the fused kernel too
            for dtype in (torch.float32, torch.bfloat16):
                ch = select_backend("auto", cpu, 64, dtype)
                assert ch.name == "lrk_tiers" and ch.reason.startswith("auto: our fused tier attention"), ch.reason
    with build.limit_isa("none"):
        ch = select_backend("auto", cpu, 64, torch.float32)
        assert ch.name == "portable" and "AVX2 + FMA" in ch.reason


def test_without_the_library_auto_runs_the_portable_path(monkeypatch):
    monkeypatch.setattr(build, "_LIB", build.KernelLibrary(False, "kernel library unavailable: simulated"))
    ch = select_backend("auto", torch.device("cpu"), 64, torch.float32)
    assert ch.name == "portable" and "simulated" in ch.reason
    with pytest.raises(RuntimeError, match="cannot run: kernel library unavailable: simulated"):
        select_backend("lrk_tiers", torch.device("cpu"), 64, torch.float32)
    layer = make_layer(B=1, H=1, d=16, seed=0)
    q = query(layer, 2)
    torch.testing.assert_close(attend(layer, q, backend="auto"), attend_portable(layer, q))
    with pytest.raises(RuntimeError, match="simulated"):
        attend(layer, q, backend="lrk_tiers")


def test_the_library_is_built_from_every_source():
    """Every translation unit and header is in the build and in the tag (an edited file rebuilds)."""
    from pathlib import Path

    names = [p.name for p in build.SOURCES]
    assert names == ["tiers.cpp", "lrk.cpp", "qgemv.cpp", "layer.cpp", "pool.cpp", "arena.cpp"]     # longest compile first
    here = Path(build.__file__).parent
    assert sorted(p.name for p in build.SOURCES + build.HEADERS) == sorted(
        p.name for p in list(here.glob("*.cpp")) + list(here.glob("*.h")))
    assert all(p.exists() for p in build.SOURCES + build.HEADERS)
    assert build.extension_kwargs()["sources"] == [str(p) for p in build.SOURCES]


@needs_lrk_native
def test_the_exact_row_prefetch_changes_no_bit():
    """$LOWRANK_LIB_TIER_PF picks the exact-row loops with or without software prefetch (off by default on AMD with
    AVX-512, where it cost ~20 % at one thread; read once per process): both give the same bits, at 1 and 3 threads,
    fp32 and bf16 (its keys as rows and blocked: the blocked score pass prefetches the V rows), both ISA levels, over
    exact rows long enough for several chunks and the appended rows."""
    import subprocess
    import sys

    code = (
        "import sys, torch; sys.path.insert(0, 'tests'); from test_kernels_tiers import make_layer, query\n"
        "from lowrank_lib.kv.tiers import attend\n"
        "from lowrank_lib.runtime.kernels import build, ops\n"
        "import os; assert ops.tier_prefetch() == (os.environ['LOWRANK_LIB_TIER_PF'] == '1')\n"
        "ops.tier_chunk(64)\n"
        "outs = []\n"
        "levels = ['all'] + (['avx2'] if build.load().has('avx2', 'fma') else [])\n"
        "for dt, blk in ((torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)):\n"
        "    layer = make_layer(B=2, H=3, d=64, seed=5, dtype=dt, quant8=True, max_exact=1500, appended=300,\n"
        "                       blocked=blk)\n"
        "    q = query(layer, 3)\n"
        "    for lvl in levels:\n"
        "        for th in (1, 3):\n"
        "            torch.set_num_threads(th)\n"
        "            with build.limit_isa(lvl), build.pool(min_bytes=1):\n"
        "                outs.append(attend(layer, q, backend='lrk_tiers').float())\n"
        "torch.save(outs, sys.argv[1])\n")
    from pathlib import Path
    import tempfile

    root = Path(__file__).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        got = {}
        for pf in ("0", "1"):
            out = Path(tmp) / f"pf{pf}.pt"
            env = {**__import__("os").environ, "LOWRANK_LIB_TIER_PF": pf}
            subprocess.run([sys.executable, "-c", code, str(out)], cwd=root, env=env, check=True)
            got[pf] = torch.load(out)
    assert len(got["0"]) == len(got["1"]) >= 6
    for a, b in zip(got["0"], got["1"]):
        assert torch.equal(a, b)


@needs_lrk_native
def test_bf16_without_dot_products_rows_and_blocked_keys():
    """$LOWRANK_LIB_ATTN_DP=0 (read once per process) turns off the AVX512_BF16 dot products: the bf16 scores of
    rows and of blocked keys take the widening loops instead, and stay within BF16_ULPS of the exact evaluation at 1
    and 3 threads, pieces starting inside blocks."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, torch; sys.path.insert(0, 'tests')\n"
        "from test_kernels_tiers import make_layer, query, as_float64, bf16_ulps, BF16_ULPS\n"
        "from lowrank_lib.kv.tiers import attend, attend_portable\n"
        "from lowrank_lib.runtime.kernels import build\n"
        "for blocked in (False, True):\n"
        "    for seed, d in ((0, 64), (1, 48)):\n"
        "        layer = make_layer(B=2, H=2, d=d, seed=seed, dtype=torch.bfloat16, quant8=bool(seed), max_exact=400,\n"
        "                           appended=5, blocked=blocked)\n"
        "        q = query(layer, 3)\n"
        "        ref = attend_portable(as_float64(layer), q.double())\n"
        "        for th in (1, 3):\n"
        "            torch.set_num_threads(th)\n"
        "            with build.pool(min_bytes=1):\n"
        "                u = float(bf16_ulps(attend(layer, q, backend='lrk_tiers'), ref).max())\n"
        "            assert u <= BF16_ULPS, (blocked, seed, th, u)\n"
        "print('ok')\n")
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "LOWRANK_LIB_ATTN_DP": "0"},
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]
