"""Our compiled CPU kernels (``runtime/kernels``): every path against the portable one, and the fallback.

Three levels: the ops themselves (pack / unpack round trips, the packed GEMV and the decode attention
against float64 references, odd shapes that are no multiple of the vector width, several rows, several
threads, hostile arguments); ``ProjectionGroup`` with the packed backend against aten; whole engines
(``kernels="lrk"``) against the portable eager engine on tiny random Llamas, fp32 tight and bf16 within a
fidelity bound, batch > 1 with left padding, compiled step. The fallback (no library, no ISA, not a
CPU) is simulated and must run the portable path and say why. Every kernel test runs under each ISA level
the CPU has (``tests/kernel_isa.py``: the AVX-512 kernels, and the AVX2 ones forced on the same CPU).
"""
from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from lowrank_lib import models
from lowrank_lib.compress import compress_svd
from lowrank_lib.factorized import LowRankLinear, factorize
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.kernels import build, select_gemv
from lowrank_lib.runtime.kernels.gemv import lrk_unavailable

from kernel_isa import (LIB, THREADS, gemv_backend, kernel_isa, needs_lrk, needs_lrk_native,  # noqa: F401  (the fixture)
                        num_threads)

# bf16 runs everywhere the kernels run: AVX512_BF16, else the AVX2 kernels (needs_lrk runs each level here)
DTYPES = [torch.float32, torch.bfloat16]


def _ops():
    from lowrank_lib.runtime.kernels import ops

    return ops


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# --------------------------------------------------------------------------- ops
@needs_lrk
@pytest.mark.parametrize("dtype", DTYPES + [torch.int8])
@pytest.mark.parametrize("out,inp", [(1, 1), (15, 3), (17, 33), (63, 64), (64, 17), (65, 1), (130, 77), (209, 576)])
def test_pack_unpack_round_trip_and_padding(dtype, out, inp):
    ops = _ops()
    W = torch.randn(out, inp, generator=_gen(out * 1000 + inp))
    W = (W * 40).round().clamp(-127, 127).to(dtype) if dtype == torch.int8 else W.to(dtype)
    P = ops.pack(W)
    rows = (out // 64) * 64 + -(-(out % 64) // 16) * 16                 # blocks of 64, tail rounded to 16
    cols = 2 * -(-inp // 2) if dtype != torch.float32 else inp             # bf16 / int8 pairs
    assert P.shape == (rows * cols,) and P.dtype == dtype
    assert torch.equal(ops.unpack(P, out, inp), W)                         # exact: a permutation + zeros
    assert int((P != 0).sum()) == int((W != 0).sum())                      # padding is zeros, nothing lost


def _ref_gemv(x, Ws, xoffs):
    """float64 reference of the segmented GEMV on the same (rounded) inputs."""
    return torch.cat([x[:, o:o + W.shape[1]].double() @ W.double().t() for W, o in zip(Ws, xoffs)], -1)


def _check_close(y, ref, dtype):
    """fp32: a few ulps of the output scale; bf16: fp32 accumulation then one rounding to bf16 (2^-8
    relative) of the output, plus accumulation order."""
    scale = float(ref.abs().max()) + 1e-30
    err = float((y.double() - ref).abs().max())
    bound = 2e-6 if dtype == torch.float32 else 8e-3
    assert err <= bound * scale, (err, scale)


@needs_lrk
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 2, 3, 4, 5, 8, 9])
def test_gemv_matches_reference_rows_and_odd_shapes(dtype, N):
    ops = _ops()
    g = _gen(N)
    for out, inp in [(1, 1), (7, 5), (16, 16), (47, 33), (64, 64), (80, 129), (193, 37)]:
        W = torch.randn(out, inp, generator=g).to(dtype)
        x = torch.randn(N, inp, generator=g).to(dtype)
        y = ops.gemv(x, [ops.pack(W)], [out], [inp], [0])
        assert y.shape == (N, out) and y.dtype == dtype
        _check_close(y, _ref_gemv(x, [W], [0]), dtype)


@needs_lrk
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_segmented_strided_and_threads(dtype):
    """Several matrices in one call, each reading its column slice of x (a strided view), 1 vs 2 threads."""
    ops = _ops()
    g = _gen(11)
    shapes = [(300, 37), (5, 21), (129, 64), (64, 3)]            # (out, in): rank-space widths, odd outs
    xoffs = [0, 37, 10, 58]                                       # overlapping slices (shared bases do this)
    Ws = [torch.randn(o, i, generator=g).to(dtype) for o, i in shapes]
    Ps = [ops.pack(W) for W in Ws]
    big = torch.randn(3, 200, generator=g).to(dtype)
    x = big[:, 50:130]                                            # [3, 80], row stride 200
    assert not x.is_contiguous()
    y = ops.gemv(x, Ps, [o for o, _ in shapes], [i for _, i in shapes], xoffs)
    _check_close(y, _ref_gemv(x, Ws, xoffs), dtype)
    # enough bytes for the default parallel split: blocks are computed identically -> bitwise equal
    W = torch.randn(1536, 576, generator=g).to(dtype)
    xw = torch.randn(2, 576, generator=g).to(dtype)
    P = ops.pack(W)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        y1 = ops.gemv(xw, [P], [1536], [576], [0])
        torch.set_num_threads(2)
        y2 = ops.gemv(xw, [P], [1536], [576], [0])
    finally:
        torch.set_num_threads(before)
    assert torch.equal(y1, y2)
    _check_close(y1, _ref_gemv(xw, [W], [0]), dtype)


@needs_lrk
def test_gemv_rejects_hostile_arguments():
    ops = _ops()
    W = torch.randn(20, 10)
    P = ops.pack(W)
    x = torch.randn(1, 10)
    with pytest.raises(RuntimeError, match="not a packed"):
        ops.gemv(x, [P], [33], [10], [0])                          # wrong shape for this packed size
    with pytest.raises(RuntimeError, match="reads columns"):
        ops.gemv(x, [P], [20], [10], [1])                          # slice beyond x
    with pytest.raises(RuntimeError, match="not a packed"):
        ops.gemv(x.bfloat16(), [P], [20], [10], [0])               # dtype mismatch
    with pytest.raises(RuntimeError, match="fp32, bf16 or int8"):
        ops.pack(W.double())
    with pytest.raises(RuntimeError, match="unit column stride"):
        ops.gemv(torch.randn(10, 2).t(), [P], [20], [10], [0])
    with pytest.raises(RuntimeError, match="one out"):
        ops.gemv(x, [P], [20, 1], [10], [0])
    with pytest.raises(RuntimeError, match="not a packed"):
        ops.unpack(P, 20, 11)


def _ref_attend(q, K, V, length, pad, scale):
    """float64 softmax attention of q [B, H, G, D] over slots pad[b] <= s <= length."""
    B, H, G, D = q.shape
    out = torch.empty(B, H, G, D, dtype=torch.float64)
    for b in range(B):
        k, v = K[b, :, pad[b]:length + 1].double(), V[b, :, pad[b]:length + 1].double()   # [H, n, D]
        s = torch.einsum("hgd,hnd->hgn", q[b].double(), k) * scale
        out[b] = torch.einsum("hgn,hnd->hgd", s.softmax(-1), v)
    return out.reshape(B, H * G * D)


@needs_lrk
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B,H,G,D,S,length", [(1, 3, 3, 64, 40, 0), (1, 1, 1, 16, 17, 16), (2, 2, 2, 48, 70, 37),
                                              (3, 4, 1, 128, 33, 32), (1, 2, 5, 32, 600, 575)])
def test_attend_matches_reference(dtype, B, H, G, D, S, length):
    ops = _ops()
    g = _gen(B * 100 + D)
    q = torch.randn(B, H, G, D, generator=g).to(dtype)
    K = (2 * torch.randn(B + 1, H, S, D, generator=g)).to(dtype)    # a store with more rows than B
    V = torch.randn(B + 1, H, S, D, generator=g).to(dtype)
    pad = torch.tensor([min(3 * b, length) for b in range(B)] + [0], dtype=torch.long)
    L = torch.tensor([length], dtype=torch.long)
    o = ops.attend(q, K, V, L, pad, D ** -0.5)
    ref = _ref_attend(q, K, V, length, pad, D ** -0.5)
    err = float((o.double() - ref).abs().max())
    assert err <= (2e-6 if dtype == torch.float32 else 1e-2) * float(ref.abs().max()), err


@needs_lrk
@pytest.mark.parametrize("D", [32, 64, 96, 128])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attend_long_contexts_split_into_pieces_same_bits_at_every_thread_count(D, dtype):
    """Contexts long enough to cut each (row, KV head) pair's slots into pieces (>= 2048 live slots; the AVX512_BF16
    kernel and the AVX2 kernels, bf16 and fp32, merge them by their softmax states): the same bits at 1, 2, 3
    threads, pieces shared by threads when pairs are fewer than threads, odd slot counts, one row short enough for one
    piece, and close to the float64 reference."""
    ops = _ops()
    B, H, G, S, length = 3, 3, 3, 2600, 2502
    g = _gen(D)
    q = torch.randn(B, H, G, D, generator=g).to(dtype)
    K = (2 * torch.randn(B, H, S, D, generator=g)).to(dtype)
    V = torch.randn(B, H, S, D, generator=g).to(dtype)
    pad = torch.tensor([0, 37, 2200], dtype=torch.long)            # 2503, 2466 and 303 live slots
    L = torch.tensor([length], dtype=torch.long)
    outs = _at_every_thread_count(lambda: ops.attend(q, K, V, L, pad, D ** -0.5))
    _same_bits(outs)
    ref = _ref_attend(q, K, V, length, pad, D ** -0.5)
    tol = 1e-2 if dtype == torch.bfloat16 else 2e-6
    assert float((outs[0].double() - ref).abs().max()) <= tol * float(ref.abs().max())
    one = ops.attend(q[:1, :1], K[:1, :1], V[:1, :1], L, pad[:1], D ** -0.5)   # one pair: its pieces, no threads
    assert torch.equal(one, outs[0][:1, :G * D])


@needs_lrk
def test_attend_rejects_hostile_arguments():
    ops = _ops()
    q, K = torch.randn(1, 2, 1, 24), torch.randn(1, 2, 8, 24)
    L, pad = torch.tensor([3]), torch.tensor([0])
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.attend(q, K, K, L, pad, 1.0)
    q, K = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 8, 16)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.attend(q, K, K, torch.tensor([8]), pad, 1.0)
    with pytest.raises(RuntimeError, match="int64"):
        ops.attend(q, K, K, torch.tensor([3], dtype=torch.int32), pad, 1.0)


# --------------------------------------------------------------------------- ProjectionGroup
def _lrk_choice(dtype=torch.float32):
    return select_gemv("lrk", torch.device("cpu"), dtype)


# --------------------------------------------------------------------------- threads (the kernels' own pool)
def _at_every_thread_count(call, split=True):
    """call() at each of THREADS threads -> the results, with the pool's threshold at one byte, so every call that has
    two jobs is split (tiny shapes, uneven cuts, more threads than cores); ``split``: it has, the pool must run."""
    outs = []
    with build.pool(min_bytes=1):
        for n in THREADS:
            before = build.pool_info()
            with num_threads(n):
                outs.append(call())
            after = build.pool_info()
            if split and n > 1:
                assert after["parallel_calls"] > before["parallel_calls"], "the call was not split"
    return outs


def _same_bits(outs):
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "results differ across thread counts"


@needs_lrk
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_every_thread_count_same_bits(dtype):
    """Rows split over 1, 2, 3 threads: the same bits as one thread, equal to the reference, at odd shapes (rows not a
    multiple of the 64-row block, rank 1 either way, one row) and for a segmented group (the split runs over the
    group's total rows), N = 1 and several rows of x."""
    ops = _ops()
    g = _gen(31)
    cases = [[(1, 1)], [(300, 1)], [(1, 300)], [(193, 37)], [(130, 77)], [(300, 37), (5, 21), (129, 64), (64, 3)]]
    for shapes in cases:
        xoffs = [0, 37, 10, 58][:len(shapes)] if len(shapes) > 1 else [0]
        width = max(o + i for o, (_, i) in zip(xoffs, shapes))
        Ws = [torch.randn(o, i, generator=g).to(dtype) for o, i in shapes]
        Ps = [ops.pack(W) for W in Ws]
        for N in (1, 3):
            x = torch.randn(N, width, generator=g).to(dtype)
            blocks = sum(-(-o // 64) for o, _ in shapes)
            outs = _at_every_thread_count(lambda: ops.gemv(x, Ps, [o for o, _ in shapes], [i for _, i in shapes],
                                                           xoffs), split=blocks > 1)
            _same_bits(outs)
            _check_close(outs[0], _ref_gemv(x, Ws, xoffs), dtype)


@needs_lrk
def test_gemv_threshold_one_thread_below_split_just_above():
    """At the default threshold (min_bytes of weights per thread) a matrix of less than two shares runs on the caller
    alone at any thread count, one just above it is split; both give the same bits as one thread."""
    ops = _ops()
    mb = build.pool_info()["min_bytes"]
    g = _gen(32)
    out = 128                                                    # two 64-row blocks (jobs), fp32
    for inp, split in ((2 * mb // (out * 4) - 1, False), (2 * mb // (out * 4) + 1, True)):  # just below / above
        W = torch.randn(out, inp, generator=g)
        P = ops.pack(W)
        x = torch.randn(1, inp, generator=g)
        outs = []
        for n in THREADS:
            before = build.pool_info()
            with num_threads(n):
                outs.append(ops.gemv(x, [P], [out], [inp], [0]))
            after = build.pool_info()
            went = after["parallel_calls"] - before["parallel_calls"]
            assert went == (1 if split and n > 1 else 0), (out, inp, n, went)
        _same_bits(outs)
        _check_close(outs[0], _ref_gemv(x, [W], [0]), torch.float32)


@needs_lrk
@pytest.mark.parametrize("dtype", DTYPES)
def test_attend_every_thread_count_same_bits(dtype):
    """The decode attention's (row, KV head) pairs split over 1, 2, 3 threads: the same bits, equal to the reference
    (3 heads on 2 threads, more threads than pairs, left padding)."""
    ops = _ops()
    for B, H, G, D, S, length in [(1, 3, 3, 64, 40, 39), (2, 2, 2, 48, 70, 37), (1, 1, 4, 32, 9, 8)]:
        g = _gen(B * 10 + H)
        q = torch.randn(B, H, G, D, generator=g).to(dtype)
        K = (2 * torch.randn(B, H, S, D, generator=g)).to(dtype)
        V = torch.randn(B, H, S, D, generator=g).to(dtype)
        pad = torch.tensor([3 * b for b in range(B)], dtype=torch.long)
        L = torch.tensor([length], dtype=torch.long)
        outs = _at_every_thread_count(lambda: ops.attend(q, K, V, L, pad, D ** -0.5), split=B * H > 1)
        _same_bits(outs)
        ref = _ref_attend(q, K, V, length, pad, D ** -0.5)
        assert float((outs[0].double() - ref).abs().max()) <= (2e-6 if dtype == torch.float32 else 1e-2) * float(
            ref.abs().max())


@needs_lrk
@pytest.mark.parametrize("dtype", DTYPES)
def test_certified_head_every_thread_count_same_bits(dtype):
    """The certified head's int8 scoring and exact blocks split over 1, 2, 3 threads: the same bits and statistics."""
    from lowrank_lib.runtime.lm_head import quantize_head

    ops = _ops()
    g = _gen(33)
    V, d = 333, 70
    W = torch.randn(V, d, generator=g).to(dtype)
    x = torch.randn(2, d, generator=g).to(dtype)
    Q, meta = quantize_head(W)
    Qp, P = ops.pack(Q), ops.pack(W.contiguous())
    stats = []

    def call():
        st = torch.zeros(5, dtype=torch.long)
        y = ops.certified_head(x, Qp, meta, P, V, 0.5, st)
        stats.append(st)
        return y

    _same_bits(_at_every_thread_count(call))
    _same_bits(stats)


@needs_lrk_native
def test_pool_mode_follows_torchs_threads_unless_the_environment_says():
    """A process starts with our kernels' chunks on torch's OpenMP threads where torch's intra-op backend is OpenMP
    (no second set of spinning threads beside libgomp's), else on our own workers; ``$LOWRANK_LIB_POOL`` overrides,
    and a bad value is refused by name."""
    import subprocess
    import sys

    assert build.default_pool_mode() in build.POOL_MODES
    if torch.backends.openmp.is_available():            # torch's CPU wheels: ATen's threads are OpenMP's
        assert build.default_pool_mode() == "omp"
    code = ("import torch; from lowrank_lib.runtime.kernels import build; build.load(); "
            "print(build.pool_info()['mode'])")
    env = {k: v for k, v in os.environ.items() if k != "LOWRANK_LIB_POOL"}
    for setting, want in ((None, build.default_pool_mode()), ("own", "own"), ("omp", "omp")):
        e = dict(env, **({"LOWRANK_LIB_POOL": setting} if setting else {}))
        out = subprocess.run([sys.executable, "-c", code], env=e, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0 and out.stdout.split()[-1] == want, (setting, out.stdout, out.stderr[-2000:])
    bad = subprocess.run([sys.executable, "-c", code], env=dict(env, LOWRANK_LIB_POOL="threads"),
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "LOWRANK_LIB_POOL='threads'" in bad.stderr


@needs_lrk_native
def test_pool_survives_fork_and_concurrent_callers():
    """A forked child (whose parent's workers do not exist in it) builds a fresh pool on its first split call and gets
    the parent's bits; two Python threads calling at once (one owns the workers, the other runs alone) both get them;
    the OpenMP mode gives the same bits."""
    import threading
    import time

    ops = _ops()
    g = _gen(34)
    W = torch.randn(700, 300, generator=g)
    P = ops.pack(W)
    x = torch.randn(2, 300, generator=g)
    with build.pool(threads=2, min_bytes=1, mode="own"):   # our workers (the default may be OpenMP's threads)
        want = ops.gemv(x, [P], [700], [300], [0])          # the parent's workers are running now
        assert build.pool_info()["workers"] >= 1
        pid = os.fork()
        if pid == 0:         # the child: exit 0 only with the same bits and a chunk run by a (new) worker
            code = 1
            try:
                before, t0 = build.pool_info()["chunks_off_caller"], time.monotonic()
                code = 3
                while time.monotonic() - t0 < 20:
                    if not torch.equal(ops.gemv(x, [P], [700], [300], [0]), want):
                        code = 2
                        break
                    if build.pool_info()["chunks_off_caller"] > before:
                        code = 0
                        break
            finally:
                os._exit(code)
        deadline = time.monotonic() + 60
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung calling the kernel")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status) == 0
        results = []
        threads = [threading.Thread(target=lambda: results.extend(ops.gemv(x, [P], [700], [300], [0])
                                                                  for _ in range(20))) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(results) == 40 and all(torch.equal(r, want) for r in results)
    with build.pool(threads=2, min_bytes=1, mode="omp"):
        assert torch.equal(ops.gemv(x, [P], [700], [300], [0]), want)


@needs_lrk
@pytest.mark.parametrize("pack", [True, False])
@pytest.mark.parametrize("N", [1, 3, 20])       # 20 rows: prefill, the packed matrix is unpacked for aten
def test_projection_group_packed_backend_equals_aten(pack, N):
    from lowrank_lib.runtime.packing import ProjectionGroup

    g = _gen(5)
    shared = nn.Parameter(torch.randn(13, 70, generator=g), requires_grad=False)   # a basis read by two members
    mods = {"a": LowRankLinear(torch.randn(45, 13, generator=g), shared, torch.randn(45, generator=g)),
            "b": nn.Linear(70, 33, bias=True),
            "c": LowRankLinear(torch.randn(81, 13, generator=g), shared),
            "d": LowRankLinear(torch.randn(17, 9, generator=g), torch.randn(9, 70, generator=g))}
    x = torch.randn(N, 70, generator=g)
    cpu = torch.device("cpu")
    ref = ProjectionGroup(mods, pack, torch.float32, cpu)
    lrk = ProjectionGroup(mods, pack, torch.float32, cpu, gemv=_lrk_choice())
    assert lrk.gemv.packed and not hasattr(lrk, "U_t")                  # the weights are stored once, packed
    if pack:
        assert lrk.sizes == [13, 33, 9] and lrk.seg["members"] == [0, 2, 3]
        torch.testing.assert_close(lrk.S, ref.S)
    for y, r in zip(lrk(x), ref(x)):
        torch.testing.assert_close(y, r, rtol=1e-5, atol=1e-5 * float(r.abs().max()))
    hs, hr = lrk.stage1(x), ref.stage1(x)
    for i, m in enumerate(lrk.members):
        torch.testing.assert_close(lrk.stage2(i, hs[m.first]), ref.stage2(i, hr[m.first]), rtol=1e-5, atol=1e-4)
    # the same weight bytes; packing pads rows to 16 (and the bf16 inner length to 2) in memory
    assert lrk.nbytes == ref.nbytes == ref.stored_nbytes <= lrk.stored_nbytes


# --------------------------------------------------------------------------- engines
def _lowrank(preset, seed, keep=0.6, **overrides):
    return compress_svd(models.tiny_model(preset, seed=seed, **overrides), keep)


def _gen_out(model, cfg, ids, n=8, mask=None):
    return Engine(model, EngineConfig(**cfg)).generate(ids, n, mask, return_logits=True)


def _max_err(a, b):
    return max(float((x.float() - y.float()).abs().max()) for x, y in zip(a.logits, b.logits))


@needs_lrk_native
@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa", "tiny-smol"])
@pytest.mark.parametrize("extra", [{}, dict(pack_qkv=False, pack_mlp=False), dict(fold_rope=False, fold_norm=False)])
def test_engine_lrk_equals_portable_fp32(preset, extra):
    model = _lowrank(preset, seed=1)
    ids = torch.randint(0, 256, (1, 11), generator=_gen(3))
    base = dict(max_seq_len=32, **extra)
    ref = _gen_out(model, dict(base, kernels="portable"), ids)
    eng = Engine(model, EngineConfig(**base, kernels="lrk"))
    out = eng.generate(ids, 8, return_logits=True)
    rep = eng.report()
    assert rep["gemv"] == gemv_backend(torch.float32) and "requested" in rep["gemv_reason"]
    assert rep["backend"] == "lrk_attend" and rep["kernels"]["available"]
    assert torch.equal(out.tokens, ref.tokens)
    assert _max_err(out, ref) < 1e-4


@needs_lrk_native
def test_engine_lrk_dense_model_mixed_and_odd_shapes():
    """A dense model; a mixed dense / low-rank one; hidden 72, ffn 100, head_dim 24 (no multiple of 16:
    the GEMVs run the kernel, attention falls back to sdpa and says why)."""
    ids = torch.randint(0, 256, (1, 9), generator=_gen(0))
    dense = models.tiny_model("tiny-gqa", seed=2)
    ranks = {"model.layers.0.self_attn.k_proj": 5, "model.layers.0.mlp.up_proj": 7,
             "model.layers.1.self_attn.o_proj": 9, "model.layers.1.mlp.down_proj": 11}
    mixed = factorize(models.tiny_model("tiny-gqa", seed=2), ranks=ranks)
    odd = _lowrank("tiny-mha", seed=4, keep=0.55, hidden_size=72, intermediate_size=100, num_attention_heads=3,
                   num_key_value_heads=3)
    for model in (dense, mixed, odd):
        ref = _gen_out(model, dict(max_seq_len=24, kernels="portable"), ids)
        eng = Engine(model, EngineConfig(max_seq_len=24))             # auto: the kernel where it can run
        out = eng.generate(ids, 8, return_logits=True)
        assert eng.report()["gemv"] == gemv_backend(torch.float32)
        assert torch.equal(out.tokens, ref.tokens) and _max_err(out, ref) < 1e-4
    rep = eng.report()
    assert rep["backend"] == "sdpa" and "head_dim 24" in rep["backend_reason"]
    with pytest.raises(RuntimeError, match="head_dim 24"):
        Engine(odd, EngineConfig(max_seq_len=24, attention="lrk_attend"))


@needs_lrk_native
@pytest.mark.parametrize("graph", ["none", "whole-step"])
def test_engine_lrk_batch_left_padding_and_compiled(graph):
    """Batch 3 with left padding (the attention kernel reads the pad counts), eager and torch.compile-d."""
    model = _lowrank("tiny-gqa", seed=6)
    ids = torch.randint(0, 256, (3, 9), generator=_gen(7))
    mask = torch.ones(3, 9, dtype=torch.long)
    mask[1, :4] = 0
    mask[2, :8] = 0
    ref = _gen_out(model, dict(max_batch=3, max_seq_len=24, kernels="portable"), ids, 7, mask)
    eng = Engine(model, EngineConfig(max_batch=3, max_seq_len=24, graph=graph, kernels="lrk"))
    out = eng.generate(ids, 7, mask, return_logits=True)
    assert torch.equal(out.tokens, ref.tokens) and _max_err(out, ref) < 1e-4
    if graph != "none":
        rep = eng.report()
        assert rep["compiles"] and rep["compiles"][0]["seconds"] > 0 and rep["compiles"][0]["batch"] == 3


@needs_lrk_native
def test_engine_lrk_compiled_step_calls_our_kernels():
    """The compiled step calls our ops (counted as gemm / attention), one stage-1 and one stage-2 call per
    packed group; the portable fused lowering leaves no GEMM call."""
    from lowrank_lib.runtime.profiling import per_token_counts

    model = _lowrank("tiny-gqa", seed=9, keep=0.5)
    ids = torch.randint(0, 256, (1, 7), generator=_gen(5))
    eng = Engine(model, EngineConfig(max_seq_len=20, graph="whole-step", kernels="lrk", fused_layer="off"))
    counts = per_token_counts(eng, ids, 2)["by_class"]
    n_layers = len(eng.layers)
    # per layer: qkv (2 calls), o_proj (2), gate/up (2), down (2); plus the lm_head (1)
    assert counts["gemm"] == 8 * n_layers + 1, counts
    assert counts["attention"] == n_layers, counts


@needs_lrk_native
@pytest.mark.parametrize("preset", ["tiny-gqa", "tiny-smol"])
def test_engine_lrk_bf16_fidelity(preset):
    """bf16: the kernel accumulates in fp32 and rounds once (aten rounds differently): both bf16 engines
    stay as close to the fp32 engine as each other, and their logits within a bf16 bound of each other."""
    model = _lowrank(preset, seed=3)
    ids = torch.randint(0, 256, (1, 12), generator=_gen(2))
    fp32 = _gen_out(model, dict(max_seq_len=32, kernels="portable"), ids)
    lrk = Engine(model, EngineConfig(max_seq_len=32, dtype="bf16", kernels="lrk"))
    assert lrk.report()["gemv"] == gemv_backend(torch.bfloat16)
    assert ("AVX512_BF16" if gemv_backend(torch.bfloat16) == "lrk_avx512" else "AVX2") in lrk.report()["gemv_reason"]
    a = lrk.generate(ids, 8, return_logits=True)
    b = _gen_out(model, dict(max_seq_len=32, dtype="bf16", kernels="portable"), ids)
    # teacher-free comparison: the prefill logits (same input for all three), relative to the logit scale
    scale = float(fp32.logits[0].abs().max())
    e_lrk = float((a.logits[0].float() - fp32.logits[0]).abs().max()) / scale
    e_aten = float((b.logits[0].float() - fp32.logits[0]).abs().max()) / scale
    assert e_lrk < 0.05 and e_aten < 0.05, (e_lrk, e_aten)
    assert e_lrk < 2 * e_aten + 0.01, (e_lrk, e_aten)


# --------------------------------------------------------------------------- fallback
@pytest.fixture
def no_library(monkeypatch):
    """The kernel library as a machine without a compiler would find it."""
    monkeypatch.setattr(build, "_LIB", build.KernelLibrary(False, "kernel library unavailable: simulated"))


def test_fallback_without_library_runs_portable_path(no_library):
    cpu = torch.device("cpu")
    for compiled, name in ((False, "aten"), (True, "inductor_reduce")):
        ch = select_gemv("auto", cpu, torch.float32, compiled=compiled)
        assert ch.name == name and "simulated" in ch.reason and not ch.packed
    with pytest.raises(RuntimeError, match="kernels='lrk' cannot run: kernel library unavailable: simulated"):
        select_gemv("lrk", cpu, torch.float32)
    model = _lowrank("tiny-gqa", seed=1)
    ids = torch.randint(0, 256, (1, 8), generator=_gen(1))
    eng = Engine(model, EngineConfig(max_seq_len=20))
    rep = eng.report()
    assert rep["gemv"] == "aten" and "simulated" in rep["gemv_reason"]
    assert rep["backend"] == "sdpa" and "simulated" in rep["backend_reason"]
    assert rep["kernels"]["available"] is False
    out = eng.generate(ids, 6, return_logits=True)
    from lowrank_lib.runtime import run_generation
    from lowrank_lib.runtime.baselines import HFRunner

    hf = run_generation(HFRunner(model, "dynamic"), ids, 6, return_logits=True)
    assert torch.equal(out.tokens, hf.tokens) and _max_err(out, hf) < 1e-4
    with pytest.raises(RuntimeError, match="cannot run"):
        Engine(model, EngineConfig(max_seq_len=20, kernels="lrk"))


def test_fallback_build_failures_are_reported(monkeypatch, tmp_path):
    """No AOT library and no compiler / no ninja: load() says so instead of raising."""
    import torch.utils.cpp_extension as ce

    monkeypatch.setattr(build, "aot_library", lambda: None)
    monkeypatch.setattr(build, "jit_dir", lambda: tmp_path)
    monkeypatch.setattr(build, "_LIB", None)
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    lib = build.load(log=lambda m: None)
    assert not lib.available and "no C++ compiler" in lib.reason
    assert "no C++ compiler" in lrk_unavailable(torch.device("cpu"), torch.float32)
    monkeypatch.setattr(build, "_LIB", None)
    monkeypatch.setattr(build.shutil, "which", lambda name: "/usr/bin/c++")
    monkeypatch.setattr(ce, "is_ninja_available", lambda: False)
    assert "ninja" in build.load(log=lambda m: None).reason
    monkeypatch.setattr(build, "_LIB", None)
    assert not build.load(jit=False).available


def test_fallback_missing_isa_dtype_and_device(monkeypatch):
    """A CPU with AVX-512 but without AVX512_BF16 runs bf16 on the AVX2 kernels and fp32 on the AVX-512 ones; one
    without AVX2 either runs bf16 on the portable path; fp16 and non-CPU devices never take the kernel."""
    isa = {"avx512f": True, "avx512bw": True, "avx512vl": True, "avx512_bf16": False, "avx2": True, "fma": True}
    monkeypatch.setattr(build, "_LIB", build.KernelLibrary(True, "loaded (simulated)", "jit", None, "x", 0.0, isa))
    cpu = torch.device("cpu")
    ch = select_gemv("auto", cpu, torch.bfloat16)
    assert ch.name == "lrk_avx2" and ch.packed and "AVX2" in ch.reason
    assert select_gemv("auto", cpu, torch.float32).name == "lrk_avx512"
    assert "lacks avx512_bf16 (the AVX2 kernels do not cover this op)" in lrk_unavailable(cpu, torch.bfloat16,
                                                                                           avx512=True)
    monkeypatch.setattr(build, "_LIB", build.KernelLibrary(True, "loaded (simulated)", "jit", None, "x", 0.0,
                                                           {**isa, "avx2": False}))
    ch = select_gemv("auto", cpu, torch.bfloat16)
    assert ch.name == "aten" and "lacks avx512_bf16 and AVX2 + FMA" in ch.reason
    assert select_gemv("auto", cpu, torch.float32).name == "lrk_avx512"
    assert "fp32 and bf16" in lrk_unavailable(cpu, torch.float16)
    assert "CPU-only" in lrk_unavailable(torch.device("meta"), torch.float32)
    assert select_gemv("portable", cpu, torch.float32).reason == "requested: kernels='portable'"
    with pytest.raises(ValueError, match="kernels="):
        EngineConfig(kernels="fast")


@pytest.mark.skipif(not LIB.available, reason="no kernel library")
def test_limit_isa_lowers_and_restores_the_kernels_features():
    """``limit_isa("none")``: every kernel refuses and engines built inside take the portable path; on exit the
    CPU's features are back; ``$LOWRANK_LIB_ISA`` names only known levels."""
    before = dict(LIB.isa)
    with build.limit_isa("none"):
        assert not any(LIB.isa.values())
        assert select_gemv("auto", torch.device("cpu"), torch.float32, compiled=True).name == "inductor_reduce"
        with pytest.raises(RuntimeError, match="lacks AVX2"):
            _ops().gemv(torch.ones(1, 4), [_ops().pack(torch.ones(3, 4))], [3], [4], [0])
    assert LIB.isa == before
    with pytest.raises(ValueError, match="limit_isa"):
        with build.limit_isa("sse2"):
            pass


def test_portable_presets_never_take_the_kernels():
    from lowrank_lib.runtime.config import PRESETS

    assert PRESETS["dense_kv"]["kernels"] == "portable" and PRESETS["naive"]["kernels"] == "portable"
    eng = Engine(_lowrank("tiny-gqa", seed=1), EngineConfig(max_seq_len=16, kernels="portable"))
    assert eng.report()["gemv"] == "aten" and eng.report()["backend"] == "sdpa"
    assert all(not L.qkv.gemv.packed and hasattr(L.qkv, "S_t") for L in eng.layers)


# --------------------------------------------------------------------------- the real geometries (1B, 7B)
@needs_lrk
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_at_7b_and_1b_class_shapes(dtype):
    """One matrix of each size class the 1B / 7B decode streams (runtime.bandwidth), against float64: every
    output within the rigorous fp32 accumulation bound (K + 2) u sum|w x| (+ one bf16 rounding)."""
    ops = _ops()
    g = _gen(22)
    for out, inp in [(11008, 1365), (4096, 2730), (1638, 2048), (2048, 819), (2048, 8192)]:
        W = (torch.randn(out, inp, generator=g) * 0.02).to(dtype)
        x = torch.randn(2, inp, generator=g).to(dtype)
        y = ops.gemv(x, [ops.pack(W)], [out], [inp], [0]).double()
        ref = _ref_gemv(x, [W], [0])
        bound = (inp + 2) * 2.0 ** -24 * (x.double().abs() @ W.double().abs().t())
        if dtype == torch.bfloat16:
            bound = bound + 2.0 ** -8 * ref.abs()
        assert ((y - ref).abs() <= bound + 1e-30).all()


@pytest.fixture(scope="module")
def one_layer_1b(tmp_path_factory):
    from lowrank_lib.models import load_shape_model

    d = tmp_path_factory.mktemp("shape")
    kw = dict(layers=1, overrides={"vocab_size": 4096}, cache_dir=d, progress=False)
    return load_shape_model("llama3.2-1b", **kw), load_shape_model("llama3.2-1b", keep=0.5, **kw)


@needs_lrk_native
@pytest.mark.parametrize("which", ["dense", "keep0.5"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_engine_lrk_equals_portable_at_the_1b_geometry(one_layer_1b, which, dtype):
    """Llama-3.2-1B's projections (hidden 2048, ffn 8192, 32/8 heads, head_dim 64) with one layer: the kernel
    engine against the portable one, dense and keep-0.5 random factors."""
    model = one_layer_1b[0 if which == "dense" else 1]
    ids = torch.randint(0, 4096, (1, 12), generator=_gen(8))
    ref32 = _gen_out(model, dict(max_seq_len=24, dtype="fp32", kernels="portable"), ids, 6)
    a = _gen_out(model, dict(max_seq_len=24, dtype=dtype, kernels="lrk"), ids, 6)
    b = _gen_out(model, dict(max_seq_len=24, dtype=dtype, kernels="portable"), ids, 6)
    scale = float(ref32.logits[0].abs().max())
    if dtype == "fp32":
        assert torch.equal(a.tokens, b.tokens) and _max_err(a, b) < 1e-4 * scale
    else:
        e_lrk = float((a.logits[0].float() - ref32.logits[0]).abs().max()) / scale
        e_aten = float((b.logits[0].float() - ref32.logits[0]).abs().max()) / scale
        assert e_lrk < 0.05 and e_lrk < 2 * e_aten + 0.01, (e_lrk, e_aten)


@needs_lrk_native
def test_weight_prefetch_hint_follows_the_env_and_never_changes_bits():
    """``$LOWRANK_LIB_PF_NTA`` picks the GEMVs' prefetch hint at load (``ops.weight_prefetch()``: "nta" by default,
    "t0" with 0): a packed GEMV (fp32, bf16, several rows and matrices) and an int8 / int4 qgemv give the same bits in a
    process of each."""
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    code = (
        "import sys, torch\n"
        "from lowrank_lib.quant import quantize\n"
        "from lowrank_lib.runtime.kernels import build, ops\n"
        "assert build.load().available\n"
        "g = torch.Generator().manual_seed(3)\n"
        "outs = [ops.weight_prefetch()]\n"
        "for dt in (torch.float32, torch.bfloat16):\n"
        "    Ws = [torch.randn(o, i, generator=g).to(dt) for o, i in ((300, 70), (96, 70))]\n"
        "    x = torch.randn(3, 70, generator=g).to(dt)\n"
        "    outs.append(ops.gemv(x, [ops.pack(W) for W in Ws], [300, 96], [70, 70], [0, 0]))\n"
        "    for bits, group in ((8, 32), (4, 64)):\n"
        "        t = quantize(torch.randn(200, 70, generator=g), bits, group)\n"
        "        P = ops.qpack(t.data, t.scale, bits, group, 200, 70)\n"
        "        outs.append(ops.qgemv(x, [P], [200], [70], [0], bits, group))\n"
        "torch.save(outs, sys.argv[1])\n")
    root = Path(__file__).resolve().parent.parent
    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for nta in ("1", "0"):
            out = Path(tmp) / f"nta{nta}.pt"
            env = {**os.environ, "LOWRANK_LIB_PF_NTA": nta}
            subprocess.run([sys.executable, "-c", code, str(out)], cwd=root, env=env, check=True)
            got[nta] = torch.load(out)
    assert got["1"][0] == "nta" and got["0"][0] == "t0"
    assert len(got["1"]) == len(got["0"]) == 7
    for a, b in zip(got["1"][1:], got["0"][1:]):
        assert torch.equal(a, b)
