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

import pytest
import torch
from torch import nn

from lowrank_lib import models
from lowrank_lib.compress import compress_svd
from lowrank_lib.factorized import LowRankLinear, factorize
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.kernels import build, select_gemv
from lowrank_lib.runtime.kernels.gemv import lrk_unavailable

from kernel_isa import LIB, gemv_backend, kernel_isa, needs_lrk, needs_lrk_native  # noqa: F401  (the fixture)

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
    # enough bytes for the parallel split (> 256 KB): blocks are computed identically -> bitwise equal
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
    assert rep["backend"] == "cpu_lrk" and rep["kernels"]["available"]
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
        Engine(odd, EngineConfig(max_seq_len=24, attention="cpu_lrk"))


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
    eng = Engine(model, EngineConfig(max_seq_len=20, graph="whole-step", kernels="lrk"))
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
    """One matrix of each size class the 1B / 7B decode streams (bench.gemv_classes), against float64: every
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
