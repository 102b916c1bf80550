"""The fused decode layer (``layer.cpp``) over QUANTIZED projection groups (int8 / int4 factors, issue 30) against the
per-op step of the same engine.

Each fused engine is fed the tokens of the per-op engine's greedy generation (teacher forcing) and must also make the
same greedy choices itself. Bounds, relative to the logit scale:

- bf16: one bf16 rounding of a logit (1e-2), as in ``test_fused_layer``; both steps run the same ``qgemv`` code on
  the same bf16 activations, and the op rounds every elementwise step where the eager step does.
- fp32: 3e-4. The fused op computes the RMSNorm statistics in its own order (``test_fused_layer``: 1e-5 on fp32
  packs), and a quantized GEMV then rounds each activation to an int16 code of its group's amax / 32767: a last-bit
  difference in one activation may move one code by one step, i.e. the output by |w| * amax / 32767 (~3e-5 of the
  group's scale), where an fp32 GEMV would move by the last bit, and two tiny layers carry it on. Measured here:
  <= 1.2e-4 (test_quant_engine allows 3e-4 for the same effect between the compiled and eager portable steps).

Each is also compared with the portable engine (``kernels="portable"``: ``quant.qmatmul``), which the per-op step is
not (it runs the same ``qgemv`` code), so a wrong kernel fails here too.

Every ISA path of ``qgemv`` this CPU has (the ``qisa`` fixture of ``test_qgemv``: AVX-512 + VNNI, AVX-512BW, AVX2),
and the fused logits are the same bits on every path (the kernel's integer sums are exact and its fp32 steps fixed);
1 / 2 / 3 threads give the op's same bits with the pool forced to split every call; eager and compiled step;
``kernels="portable"`` and an unavailable ``qgemv`` never call the op, and say why.
"""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import MIXED_4_8, models, quantize_factors
from lowrank_lib.compress import compress_svd
from lowrank_lib.factorized import factorize
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.kernels import build

from kernel_isa import needs_lrk_native, num_threads
from test_fused_layer import (_forced, _gen, _rel_err, biased_mha, counted,  # noqa: F401  (counted: the fixture)
                              prompt, same_bits_at_every_thread_count)
from test_qgemv import PATHS, qisa  # noqa: F401  (qisa: the fixture)

BOUND = {"fp32": 3e-4, "bf16": 1e-2}
#: against the portable engine (``kernels="portable"``: quant.qmatmul, aten GEMMs, SDPA attention), which checks the
#: kernel itself (the per-op step runs the same qgemv): fp32 as above; bf16 0.05, the bound test_fused_layer gives
#: steps whose elementwise / attention roundings differ (measured <= 0.029 here)
PORTABLE_BOUND = {"fp32": 3e-4, "bf16": 0.05}
#: (bits, group): both widths and every group quantize_factors / qgemv serve
KINDS = [(8, 32), (4, 32), (8, 64), (4, 64), (8, 128), (4, 256)]
needs_qgemv = pytest.mark.skipif(not PATHS, reason="qgemv cannot run on this CPU")


def _mixed_layers(seed):
    """Layer 0: low-rank attention (q / k / v / o quantized), dense MLP (bf16 / fp32 packs); layer 1 the other way."""
    m = models.tiny_model("tiny-gqa", seed=seed)
    ranks = {f"model.layers.0.self_attn.{n}": 12 for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
    ranks.update({f"model.layers.1.mlp.{n}": 20 for n in ("gate_proj", "up_proj", "down_proj")})
    return factorize(m, ranks=ranks)


def _biased(seed):
    """Low-rank q / k / v / MLP with biases (stage-2 biases of a quantized group)."""
    return compress_svd(biased_mha(seed), 0.6)


def _random_norms(m, seed):
    """RMSNorm weights away from 1 (a tiny model's are ones: a dropped norm weight would change nothing)."""
    g = _gen(seed)
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn(p.shape, generator=g))
    return m


BASES = {
    "lowrank-smol": lambda: compress_svd(models.tiny_model("tiny-smol", seed=3), 0.5),
    "lowrank-gqa": lambda: _random_norms(compress_svd(models.tiny_model("tiny-gqa", seed=1), 0.6), 8),
    "mixed-layers": lambda: _mixed_layers(6),
    "biased-mha": lambda: _biased(5),
}
_cache: dict = {}


def _model(name, bits, group):
    key = (name, bits, group)
    if key not in _cache:
        _cache[key] = quantize_factors(BASES[name](), bits, group)
    return _cache[key]


def _check(name, bits, group, dtype, graph="none", extra=None, n=6, batch=1):
    """(fused engine, per-op tokens, per-op logits, fused logits, fused own greedy tokens)."""
    model = _model(name, bits, group)
    ids, mask = prompt(batch)
    cfg = dict(max_seq_len=24, max_batch=batch, dtype=dtype, **(extra or {}))
    per_op, tokens, ref = _forced(model, dict(cfg, fused_layer="off"), ids, n, mask)
    assert per_op.report()["fused_layer"] == "per-op"
    eng, _, got = _forced(model, dict(cfg, fused_layer="on", graph=graph), ids, n, mask, tokens)
    rep = eng.report()
    assert rep["fused_layer"] == "lrk_decode_layer" and f"int{bits} group {group} factors through qgemv" in \
        rep["fused_layer_reason"], rep["fused_layer_reason"]
    _, own, _ = _forced(model, dict(cfg, fused_layer="on", graph=graph), ids, n, mask)
    _, _, port = _forced(model, dict(cfg, kernels="portable"), ids, n, mask, tokens)
    assert _rel_err(got, port) < PORTABLE_BOUND[dtype], ("vs the portable engine", _rel_err(got, port))
    return eng, tokens, ref, got, own


# --------------------------------------------------------------------------- eager: every qgemv path, width, group
@needs_qgemv
@pytest.mark.usefixtures("qisa")
@pytest.mark.parametrize("bits, group", KINDS)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_quantized_layer_equals_per_op_step(bits, group, dtype):
    eng, tokens, ref, got, own = _check("lowrank-smol", bits, group, dtype)
    assert all(g.quantized for g in eng._groups()[1:])
    assert torch.equal(own, tokens), "greedy tokens differ"
    assert _rel_err(got, ref) < BOUND[dtype], _rel_err(got, ref)


@needs_qgemv
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_mixed_widths_per_projection_group_serve_fused_like_per_op_and_portable(dtype):
    """MIXED_4_8 in one layer: q / k / v and down int8, o and gate / up int4; each packed group keeps its own width
    in the fused layer, which equals the per-op step and the portable engine; a group given two widths is refused."""
    model = quantize_factors(BASES["lowrank-gqa"](), MIXED_4_8, 32)
    ids, mask = prompt(1)
    cfg = dict(max_seq_len=24, max_batch=1, dtype=dtype)
    _, tokens, ref = _forced(model, dict(cfg, fused_layer="off"), ids, 6, mask)
    eng, _, got = _forced(model, dict(cfg, fused_layer="on"), ids, 6, mask, tokens)
    reason = eng.report()["fused_layer_reason"]
    assert "int8 group 32 / int4 group 32 factors through qgemv" in reason, reason
    assert {g.bits for g in eng._groups() if g.quantized} == {8, 4}
    _, _, port = _forced(model, dict(cfg, kernels="portable"), ids, 6, mask, tokens)
    assert _rel_err(got, ref) < BOUND[dtype] and _rel_err(got, port) < PORTABLE_BOUND[dtype]
    split = quantize_factors(BASES["lowrank-gqa"](), {"q_proj": 8, "*": 4}, 32)
    with pytest.raises(ValueError, match=r"one \(bits, group\) per group"):
        Engine(split, EngineConfig(**cfg))


@needs_qgemv
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_quantized_logits_are_the_same_bits_on_every_qgemv_path(dtype):
    """qgemv's AVX-512 paths (VNNI, BW) give the same bits and share the fp32 / bf16 kernels, so the fused layer's
    logits are the same bits on both; the AVX2 path's fp32 / bf16 GEMVs and attention sum in their own order, so
    there the logits agree within the bound."""
    logits = {}
    for level, path in PATHS:
        with build.limit_isa(level):
            _, _, ref, got, _ = _check("lowrank-gqa", 4, 32, dtype)
            logits[path] = got
    if "avx512_vnni" in logits and "avx512bw" in logits:
        assert all(torch.equal(a, b) for a, b in zip(logits["avx512_vnni"], logits["avx512bw"]))
    first = next(iter(logits.values()))
    for path, got in logits.items():
        assert _rel_err(got, first) < BOUND[dtype], path


@needs_qgemv
@pytest.mark.parametrize("name", ["mixed-layers", "biased-mha"])
@pytest.mark.parametrize("bits, group", [(8, 32), (4, 64)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_mixed_layers_and_biases(name, bits, group, dtype):
    """Quantized and fp32 / bf16 groups in one layer (each group its own kind); stage-2 biases of quantized groups."""
    eng, tokens, ref, got, own = _check(name, bits, group, dtype)
    kinds = {g.quantized for g in eng._groups()[1:]}
    assert kinds == ({True, False} if name == "mixed-layers" else {True}), kinds
    assert torch.equal(own, tokens)
    assert _rel_err(got, ref) < BOUND[dtype], _rel_err(got, ref)


@needs_qgemv
@pytest.mark.parametrize("extra", [dict(fold_rope=False), dict(fold_norm=True), dict(batch=3)])
def test_fused_quantized_unfolded_rope_folded_norm_and_padded_batch(extra):
    """Unfolded RoPE (quantized U without rotated rows), norm weights that a quantized group keeps as x_scale, and
    batch 3 with a left-padded row."""
    extra = dict(extra)
    batch = extra.pop("batch", 1)
    for bits, group in ((8, 32), (4, 64)):
        for dtype in ("fp32", "bf16"):
            _, tokens, ref, got, own = _check("lowrank-gqa", bits, group, dtype, extra=extra, batch=batch)
            assert torch.equal(own, tokens), (extra, bits, dtype)
            assert _rel_err(got, ref) < BOUND[dtype], (extra, bits, dtype, _rel_err(got, ref))


# --------------------------------------------------------------------------- threads
@needs_qgemv
@pytest.mark.parametrize("bits, group", [(8, 32), (4, 64)])
def test_fused_quantized_layer_same_bits_at_every_thread_count(bits, group):
    """1, 2 and 3 threads, the pool splitting every call: the op on the same inputs and cache gives the same bits
    (output and K / V writes), and each engine equals its per-op step within the bound."""
    def engine():
        eng, _, ref, got, _ = _check("lowrank-smol", bits, group, "bf16")
        assert _rel_err(got, ref) < BOUND["bf16"]
        return eng

    same_bits_at_every_thread_count(engine)


# --------------------------------------------------------------------------- compiled step
@needs_qgemv
@needs_lrk_native
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_quantized_compiled_step_one_call_per_layer(dtype):
    """torch.compile of the whole step: one decode_stack extern call for every layer, no GEMM but the LM head's; logits
    within the bound of the eager per-op step and, in fp32, of the compiled per-op step (its compile is most of a
    case's time with a cold compile cache, as in test_fused_layer; the compiled per-op step on quantized factors
    equals the eager one in test_quant_engine)."""
    from lowrank_lib.runtime.profiling import per_token_counts

    with num_threads(2):
        eng, tokens, ref, got, own = _check("lowrank-smol", 8, 32, dtype, graph="whole-step")
        assert torch.equal(own, tokens)
        assert _rel_err(got, ref) < BOUND[dtype], _rel_err(got, ref)
        ids = torch.randint(0, 256, (1, 9), generator=_gen(7))
        if dtype == "fp32":
            model, cfg = _model("lowrank-smol", 8, 32), dict(max_seq_len=24, max_batch=1, dtype=dtype)
            _, _, comp = _forced(model, dict(cfg, fused_layer="off", graph="whole-step"), ids, 6, None, tokens)
            assert _rel_err(got, comp) < BOUND["fp32"], _rel_err(got, comp)
        counts = per_token_counts(eng, ids, 2)
    assert counts["ops"].get("lowrank_lrk.decode_stack") == 1, counts["ops"]
    assert "lowrank_lrk.qgemv" not in counts["ops"] and "lowrank_lrk.decode_layer" not in counts["ops"], counts["ops"]
    assert counts["by_class"]["layer"] == 1 and counts["by_class"]["gemm"] == 1, counts["by_class"]


# --------------------------------------------------------------------------- when it runs, and why not
@needs_qgemv
@needs_lrk_native
def test_portable_or_no_qgemv_never_call_the_fused_layer(counted, monkeypatch):  # noqa: F811  (the fixture)
    from lowrank_lib.runtime.kernels import ops

    model = _model("lowrank-gqa", 4, 64)
    ids = torch.randint(0, 256, (1, 7), generator=_gen(1))
    steps = 5
    eng = Engine(model, EngineConfig(max_seq_len=16, kernels="portable"))
    eng.generate(ids, steps)
    assert not counted
    assert eng.report()["fused_layer"] == "per-op" and "the decode GEMVs run aten" in eng.report()["fused_layer_reason"]
    with pytest.raises(RuntimeError, match="fused_layer='on' cannot run: the decode GEMVs run aten"):
        Engine(model, EngineConfig(max_seq_len=16, kernels="portable", fused_layer="on"))
    eng = Engine(model, EngineConfig(max_seq_len=16))                      # auto: it runs here
    eng.generate(ids, steps)
    assert counted == list(range(len(eng.layers))) * (steps - 1)
    assert "int4 group 64 factors through qgemv" in eng.report()["fused_layer_reason"]
    counted.clear()
    with monkeypatch.context() as mp:                                      # packed GEMVs, but no qgemv for this CPU
        mp.setattr(ops, "qgemv_isa", lambda: "none")
        eng = Engine(model, EngineConfig(max_seq_len=16))
        why = eng.report()["fused_layer_reason"]
        assert eng.report()["fused_layer"] == "per-op" and "cannot run qgemv (qgemv has no code" in why, why
        with pytest.raises(RuntimeError, match="cannot run qgemv"):
            Engine(model, EngineConfig(max_seq_len=16, fused_layer="on"))
    eng.generate(ids, 3)
    assert not counted


@needs_qgemv
@needs_lrk_native
def test_decode_layer_rejects_hostile_quantized_arguments():
    """The op checks a quantized group's description: its bits / group, each blob's size and dtype, the row limit."""
    from lowrank_lib.runtime.kernels import ops

    eng = Engine(_model("lowrank-gqa", 8, 32), EngineConfig(max_seq_len=16))
    f = eng._fused[0]
    x = torch.randn(1, eng.hidden)
    c = eng.cursor
    desc = dict(ln1=f.ln1, ln2=f.ln2, w=f.w, meta=f.meta, hidden=eng.hidden, head_dim=eng.head_dim, bf16=False,
                eps=1e-6, n_heads=eng.n_heads, n_kv=eng.n_kv, folded=eng.fold)
    good = dict(x=x, plan=f.plan, rope=eng.cs_table, kv=eng.kv.kv, layer=0, length=c.length, pad=c.pad)
    assert f.meta[:2] == [8, 32] and f.w[0].dtype == torch.uint8
    assert ops.decode_layer(**good).shape == x.shape
    for meta in ([5] + f.meta[1:], [8, 48] + f.meta[2:]):
        with pytest.raises(RuntimeError, match="layer_plan: group 0: quantized as .*qgemv serves 8 / 4 bits"):
            ops.layer_plan(**{**desc, "meta": meta})
    bad = [dict(meta=[4] + f.meta[1:]), dict(w=[f.w[0][:-1]] + f.w[1:]), dict(w=[f.w[0].view(torch.int8)] + f.w[1:]),
           dict(w=[f.w[1]] + f.w[1:])]
    for b in bad:
        with pytest.raises(RuntimeError, match="layer_plan: weight tensor 0"):
            ops.layer_plan(**{**desc, **b})
    kv9 = eng.kv.kv.new_zeros((eng.kv.kv.shape[0], 9, *eng.kv.kv.shape[2:]))
    nine = dict(x=torch.randn(9, eng.hidden), kv=kv9, pad=torch.zeros(9, dtype=torch.long))
    with pytest.raises(RuntimeError, match="at most 8 rows with quantized groups"):
        ops.decode_layer(**{**good, **nine})
