"""Quantized factors in the engine (issue 30): the portable path (qmatmul for decode rows, dequantized fp32 GEMMs for
prefill) gives the logits of transformers' forward on the same quantized model, eagerly and in the compiled step;
packing, RoPE folding and the norm weight are exact on quantized factors."""
from __future__ import annotations

import copy

import pytest
import torch

from lowrank_lib import models, quantize_factors
from lowrank_lib.compress import compress_svd
from lowrank_lib.quant import qmatmul
from lowrank_lib.runtime import Engine, EngineConfig, run_generation
from lowrank_lib.runtime.baselines import HFRunner
from lowrank_lib.runtime.packing import ProjectionGroup, QuantizedProjectionGroup


def _model(bits=8, group=32, preset="tiny-gqa", seed=1):
    return quantize_factors(compress_svd(models.tiny_model(preset, seed=seed), 0.6), bits, group)


def _cmp(out, ref, tol):
    assert torch.equal(out.tokens, ref.tokens)
    err = max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits))
    scale = max(float(a.abs().max()) for a in ref.logits)
    assert err < tol * scale, (err, scale)


PORTABLE = dict(kernels="portable", fused_layer="off")


@pytest.mark.parametrize("bits, group", [(8, 32), (4, 64)])
@pytest.mark.parametrize("cfg", [{}, dict(pack_qkv=False, pack_mlp=False), dict(fold_rope=False),
                                 dict(fold_norm=True)])
def test_portable_engine_matches_hf_on_the_quantized_model(bits, group, cfg):
    model = _model(bits, group)
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(3))
    ref = run_generation(HFRunner(model, "dynamic"), ids, 10, None, return_logits=True)
    eng = Engine(model, EngineConfig(max_seq_len=32, **PORTABLE, **cfg))
    assert all(isinstance(g, QuantizedProjectionGroup) for g in eng._groups()[1:])
    assert "portable" in eng.layers[0].qkv.qgemv_reason or "kernels" in eng.layers[0].qkv.qgemv_reason
    # prefill dequantizes (fp32 GEMM) where HF runs qmatmul: the activations' int16 rounding is the difference
    _cmp(eng.generate(ids, 10, return_logits=True), ref, 1e-4)


def test_compiled_step_equals_eager_on_quantized_factors():
    model = _model(8, 32, seed=4)
    ids = torch.randint(0, 256, (2, 6), generator=torch.Generator().manual_seed(4))
    eager = Engine(model, EngineConfig(max_batch=2, max_seq_len=24, **PORTABLE)).generate(ids, 6, return_logits=True)
    eng = Engine(model, EngineConfig(max_batch=2, max_seq_len=24, graph="whole-step", **PORTABLE))
    graph = eng.generate(ids, 6, return_logits=True)
    assert "torch.compile" in eng.report()["graph_impl"]
    assert torch.equal(eager.tokens, graph.tokens)
    # inductor fuses qmatmul's per-group fp32 accumulation in its own order: 1.02e-4 measured on a fresh-clone CI run
    assert max(float((a - b).abs().max()) for a, b in zip(eager.logits, graph.logits)) < 3e-4


def test_quantized_group_math_is_exact_per_member():
    """Packed stage 1 = each member's own qmatmul (rows concatenated, per-row scales); RoPE-folded rows = the
    rotated output, exactly; decode rows run qmatmul, prefill rows the dequantized fp32 GEMM."""
    model = _model(4, 32)
    a = model.model.layers[0].self_attn
    mods = {"q_proj": a.q_proj, "k_proj": a.k_proj, "v_proj": a.v_proj}
    rope = {"q_proj": (4, 16), "k_proj": (2, 16)}
    w = torch.rand(64) + 0.5
    g = ProjectionGroup(mods, True, torch.float32, "cpu", rope, in_scale=w)
    assert isinstance(g, QuantizedProjectionGroup) and g.pack and g.quantized
    x = torch.randn(3, 64)
    ys = g(x)
    for name, y in zip(mods, ys):
        m = mods[name]
        want = qmatmul(qmatmul(x * w, m.V), m.U)
        if name in rope:
            nh, hd = rope[name]
            r = want.view(3, nh, 2, hd // 2)
            want = torch.cat([want, torch.cat([-r[:, :, 1], r[:, :, 0]], 2).reshape(3, -1)], -1)
        assert torch.equal(y, want), name
    xp = torch.randn(12, 64)                                         # prefill rows: dequantized fp32 GEMMs
    m = mods["v_proj"]
    want = (xp * w) @ m.V.dequantize().t() @ m.U.dequantize().t()
    assert torch.allclose(g(xp)[2], want, rtol=1e-5, atol=1e-5)
    # what a decode step reads: codes + scales (no dense copy of the factors)
    assert g.nbytes == sum(t.nbytes for t in (a.q_proj.V, a.q_proj.U, a.k_proj.V, a.k_proj.U, a.v_proj.V,
                                              a.v_proj.U)) + (a.q_proj.U.nbytes + a.k_proj.U.nbytes) + w.numel() * 4


def test_a_group_mixing_bit_widths_is_refused():
    model = _model(8, 32)
    m2 = quantize_factors(compress_svd(models.tiny_model("tiny-gqa", seed=1), 0.6), 4, 32)
    a, b = model.model.layers[0].self_attn, m2.model.layers[0].self_attn
    with pytest.raises(ValueError, match="one \\(bits, group\\)"):
        ProjectionGroup({"q_proj": a.q_proj, "k_proj": b.k_proj}, True, torch.float32, "cpu")
    assert copy.deepcopy(model) is not None


# --------------------------------------------------------------------------- the packed qgemv kernel (H2's op)
def _kernel_gemv(dtype):
    from lowrank_lib.runtime.kernels.gemv import select_gemv
    from lowrank_lib.runtime.packing import qgemv_unavailable

    gemv = select_gemv("auto", "cpu", dtype)
    why = qgemv_unavailable(gemv)
    if why is not None:
        pytest.skip(f"qgemv cannot run here: {why}")
    return gemv


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_engine_equals_portable_engine(bits, dtype):
    """Engine (qgemv kernel) == engine (portable qmatmul) on a tiny random Llama, up to fp32 summation order."""
    _kernel_gemv(dtype)
    model = _model(bits, 32, seed=5)
    ids = torch.randint(0, 256, (2, 7), generator=torch.Generator().manual_seed(5))
    cfg = dict(max_batch=2, max_seq_len=24, dtype=dtype, fused_layer="off")
    port = Engine(model, EngineConfig(kernels="portable", **cfg))
    kern = Engine(model, EngineConfig(kernels="auto", **cfg))
    assert kern.layers[0].qkv.qgemv_reason is None and kern.layers[0].qkv.S_q.kernel
    assert not port.layers[0].qkv.S_q.kernel
    a, b = port.generate(ids, 6, return_logits=True), kern.generate(ids, 6, return_logits=True)
    assert torch.equal(a.tokens, b.tokens)
    err = max(float((x.float() - y.float()).abs().max()) for x, y in zip(a.logits, b.logits))
    scale = max(float(x.float().abs().max()) for x in a.logits)
    # qgemv gives qmatmul's bits, but kernels="portable" also turns off the native attention: its last-bit
    # differences can move an int16 activation code of the next stage by one step (a relative 3e-5 of its group's
    # max), so the tolerance is a few of those steps, not an fp32 ulp
    assert err <= (5e-4 if dtype == torch.float32 else 2e-2) * scale, (err, scale)


@pytest.mark.parametrize("bits", [8, 4])
def test_kernel_group_equals_portable_group_on_odd_shapes(bits):
    """A packed group through qgemv (stage 1 and the segmented stage 2) == the portable group: rank and width not
    multiples of the group, 1..8 rows, fp32."""
    from lowrank_lib import LowRankLinear
    from lowrank_lib.runtime.kernels.gemv import select_gemv

    gemv = _kernel_gemv(torch.float32)
    g0 = torch.Generator().manual_seed(bits)
    mods = torch.nn.ModuleDict({n: LowRankLinear(torch.randn(o, r, generator=g0), torch.randn(r, 100, generator=g0))
                                for n, o, r in (("a", 70, 37), ("b", 33, 50))})
    quantize_factors(mods, bits, 32)
    kern = ProjectionGroup(dict(mods), True, torch.float32, "cpu", gemv=gemv)
    port = ProjectionGroup(dict(mods), True, torch.float32, "cpu", gemv=select_gemv("portable", "cpu", torch.float32))
    assert kern.S_q.kernel and not port.S_q.kernel and "kernels='portable'" in port.qgemv_reason
    for n in range(1, 9):
        x = torch.randn(n, 100, generator=g0)
        for a, b in zip(kern(x), port(x)):
            assert torch.equal(a, b), n                # the kernel gives the spec's product bit for bit


def test_qgemv_is_not_chosen_where_it_has_no_code(monkeypatch):
    from lowrank_lib.runtime.kernels import ops
    from lowrank_lib.runtime.kernels.gemv import select_gemv
    from lowrank_lib.runtime.packing import qgemv_unavailable

    gemv = _kernel_gemv(torch.float32)
    monkeypatch.setattr(ops, "qgemv_isa", lambda: "none")
    assert "no code for this CPU" in qgemv_unavailable(gemv)
    g = ProjectionGroup({"o_proj": _model(8, 32).model.layers[0].self_attn.o_proj}, True, torch.float32, "cpu",
                        gemv=gemv)
    assert not g.S_q.kernel and "no code" in g.qgemv_reason
    assert "kernels='portable'" in qgemv_unavailable(select_gemv("portable", "cpu", torch.float32))
