"""The fused decode layer (``runtime/kernels/layer.cpp``, ``EngineConfig.fused_layer``) against today's per-op step.

Each engine with the fused layer is fed the same tokens as the same engine without it (teacher forcing: a near tie
in one cannot change what the other sees) and their logits compared step by step: fp32 within 1e-5 of the logit
scale; bf16 eager within one bf16 rounding (the op rounds where the eager step does); the compiled step one extern
call per layer, equal to the eager per-op step and within the bf16 bound of the compiled per-op step (inductor fuses
the elementwise ops and rounds them differently). Models: dense, low-rank (RoPE folded and not), a basis shared by
q / k / v inside each layer, biases on a mixed dense / low-rank model, GQA and MHA; every ISA level the CPU has
(``kernel_isa``) and 1 / 2 / 3 threads with the pool forced to split every call.
"""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.compress import compress_svd
from lowrank_lib.factorized import LowRankLinear, factorize
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.kernels import build

from kernel_isa import THREADS, kernel_isa, needs_lrk, needs_lrk_native, num_threads  # noqa: F401  (the fixture)


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _shared_basis(seed):
    """Low rank, with k and v reading q's basis inside each layer (one stage-1 slice, three stage-2 factors)."""
    m = compress_svd(models.tiny_model("tiny-gqa", seed=seed), 0.6)
    g = _gen(seed)
    for L in m.model.layers:
        a = L.self_attn
        V = a.q_proj.V
        for name in ("k_proj", "v_proj"):
            out = getattr(a, name).out_features
            setattr(a, name, LowRankLinear(torch.randn(out, V.shape[0], generator=g) * 0.1, V))
    return m


def biased_mha(seed):
    """The dense tiny MHA model with random biases on q / k / v and the MLP."""
    m = models.tiny_model("tiny-mha", seed=seed, attention_bias=True, mlp_bias=True)
    g = _gen(seed)
    with torch.no_grad():
        for p in (p for n, p in m.named_parameters() if n.endswith(".bias")):
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def _mixed_bias(seed):
    """Dense and low-rank members in one group, with biases on q / k / v and the MLP."""
    m = biased_mha(seed)
    ranks = {"model.layers.0.self_attn.k_proj": 5, "model.layers.0.mlp.up_proj": 7,
             "model.layers.1.self_attn.q_proj": 6, "model.layers.1.mlp.down_proj": 11}
    return factorize(m, ranks=ranks)


MODELS = {
    "dense-gqa": lambda: models.tiny_model("tiny-gqa", seed=2),
    "lowrank-gqa": lambda: compress_svd(models.tiny_model("tiny-gqa", seed=1), 0.6),
    "lowrank-smol": lambda: compress_svd(models.tiny_model("tiny-smol", seed=3), 0.5),
    "shared-basis": lambda: _shared_basis(4),
    "mixed-bias-mha": lambda: _mixed_bias(5),
}
_cache: dict = {}


def _model(name):
    if name not in _cache:
        _cache[name] = MODELS[name]()
    return _cache[name]


def _forced(model, cfg, ids, n=6, mask=None, ref=None):
    """Logits of n steps: ``ref`` None -> (greedy tokens, logits) of a generation; else the logits of an engine fed
    ``ref``'s tokens after the prefill."""
    eng = Engine(model, EngineConfig(**cfg))
    if ref is None:
        out = eng.generate(ids, n, mask, return_logits=True)
        return eng, out.tokens, [x.float() for x in out.logits]
    with torch.no_grad():
        logits = [eng.prefill(ids, mask)]
        for j in range(n - 1):
            logits.append(eng.step(ref[:, j]))
    return eng, ref, [x.float() for x in logits]


def _rel_err(a, b):
    scale = max(float(x.abs().max()) for x in b)
    return max(float((x - y).abs().max()) for x, y in zip(a, b)) / scale


def prompt(batch):
    """(ids [batch, 9], mask): row 1 left-padded by 4 when batch > 1, else no mask."""
    ids = torch.randint(0, 256, (batch, 9), generator=_gen(7))
    mask = None
    if batch > 1:
        mask = torch.ones(batch, 9, dtype=torch.long)
        mask[1, :4] = 0
    return ids, mask


def _check(name, dtype, graph="none", extra=None, n=6, batch=1):
    model = _model(name)
    ids, mask = prompt(batch)
    cfg = dict(max_seq_len=24, max_batch=batch, dtype=dtype, **(extra or {}))
    _, tokens, ref = _forced(model, dict(cfg, fused_layer="off"), ids, n, mask)
    eng, _, got = _forced(model, dict(cfg, fused_layer="on", graph=graph), ids, n, mask, tokens)
    rep = eng.report()
    assert rep["fused_layer"] == "lrk_decode_layer" and "requested" in rep["fused_layer_reason"], rep
    return eng, tokens, ref, got, (model, cfg, ids, mask)


# --------------------------------------------------------------------------- eager, every ISA level and thread count
@needs_lrk
@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_layer_equals_per_op_step_eager(name, dtype):
    _, _, ref, got, _ = _check(name, dtype)
    bound = 1e-5 if dtype == "fp32" else 1e-2        # bf16: one rounding of a logit at most
    assert _rel_err(got, ref) < bound, (name, dtype, _rel_err(got, ref))


@needs_lrk
@pytest.mark.parametrize("extra", [dict(fold_rope=False), dict(fold_norm=True)])
def test_fused_layer_unfolded_rope_and_folded_norms(extra):
    """Unfolded RoPE (rotate_half in the op) and norm weights folded into the stage-1 matrices (no weight)."""
    for dtype in ("fp32", "bf16"):
        _, _, ref, got, _ = _check("lowrank-gqa", dtype, extra=extra)
        assert _rel_err(got, ref) < (1e-5 if dtype == "fp32" else 1e-2), (extra, dtype)


@needs_lrk
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_layer_batch_with_left_padding(dtype):
    """Batch 3, one row left-padded: per-row RoPE positions and the attention's pad counts."""
    _, _, ref, got, _ = _check("lowrank-gqa", dtype, batch=3)
    assert _rel_err(got, ref) < (1e-5 if dtype == "fp32" else 1e-2)


@needs_lrk
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_layer_same_bits_at_every_thread_count(dtype):
    """1, 2 and 3 threads with every GEMV and the attention split (pool min_bytes=1): each engine equals its per-op
    step within the bound, and the op itself (the same layer inputs and cache) gives the same bits, cache writes
    included. (Whole generations differ across thread counts in the prefill's aten GEMMs, not in the op.)"""
    def engine():
        eng, _, ref, got, _ = _check("lowrank-smol", dtype)
        assert _rel_err(got, ref) < (1e-5 if dtype == "fp32" else 1e-2)
        return eng

    same_bits_at_every_thread_count(engine)


def same_bits_at_every_thread_count(engine):
    """At each of THREADS with the pool splitting every call (min_bytes=1): ``engine()`` builds and checks a fused
    engine; the first one's op, run on the same layer inputs and cache at every count, gives the same bits (output
    and K / V writes), and the pool did split calls. So does its ``decode_stack`` (every layer in one call, on a team
    of the threads in each pool mode, and with the team off): the same bits as the layer loop at one thread, a team's
    members taking chunks off the calling thread."""
    outs, stacks = {}, []
    for t in THREADS:
        with num_threads(t), build.pool(min_bytes=1):
            before = build.pool_info()["parallel_calls"]
            eng = engine()
            if t == 1:
                kv0, x0 = eng.kv.kv.clone(), torch.randn(1, eng.hidden, generator=_gen(3)).to(eng.dtype)
                same = eng
            same.kv.kv.copy_(kv0)
            x = x0
            for f in same._fused:
                x = f(x, same.cs_table, same.kv, same.cursor.length, same.cursor.pad)
            outs[t] = (x, same.kv.kv.clone())
            if t > 1:
                assert build.pool_info()["parallel_calls"] > before, "the pool never split a call"
            for mode, team in (("omp", "1"), ("own", "1"), ("own", "0")):
                with build.pool(mode=mode), pytest.MonkeyPatch.context() as mp:
                    mp.setenv("LOWRANK_LIB_TEAM", team)
                    same.kv.kv.copy_(kv0)
                    # a team's other members claim chunks in each of its hundreds of constructs; without the team a
                    # cold worker may find every chunk taken, so only the split is counted
                    key = "chunks_off_caller" if team == "1" else "parallel_calls"
                    n0 = build.pool_info()[key]
                    x = same._stack(x0, same.cs_table, same.kv, same.cursor.length, same.cursor.pad)
                    stacks.append((t, mode, team, x, same.kv.kv.clone()))
                    if t > 1:
                        assert build.pool_info()[key] > n0, (t, mode, team, "nothing split")
    assert not torch.equal(outs[1][1], kv0)                  # the op wrote the token's K / V
    for t in THREADS[1:]:
        assert torch.equal(outs[t][0], outs[1][0]) and torch.equal(outs[t][1], outs[1][1]), t
    for t, mode, team, x, kv in stacks:
        assert torch.equal(x, outs[1][0]) and torch.equal(kv, outs[1][1]), (t, mode, team)


# --------------------------------------------------------------------------- compiled step
@needs_lrk_native
@pytest.mark.parametrize("name", ["dense-gqa", "lowrank-smol"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_layer_compiled_step_one_call_per_layer(name, dtype):
    """torch.compile of the whole step: one lowrank_lrk::decode_stack extern call for every layer (the dense store)
    and no other GEMM than the LM head's; logits equal to the eager per-op step (fp32 1e-5, bf16 one rounding). Once
    (fp32, low rank) also equal to the compiled per-op step: compiling that graph took 38 of the 64 CPU-s of the four
    cases with a cold compile cache (measured), and the compiled per-op step equals the eager one in
    test_runtime_engine."""
    from lowrank_lib.runtime.profiling import per_token_counts

    with num_threads(2):
        eng, tokens, ref, got, (model, cfg, ids, mask) = _check(name, dtype, graph="whole-step")
        bound = 1e-5 if dtype == "fp32" else 1e-2
        assert _rel_err(got, ref) < bound, _rel_err(got, ref)
        if (name, dtype) == ("lowrank-smol", "fp32"):
            _, _, comp = _forced(model, dict(cfg, fused_layer="off", graph="whole-step"), ids, 6, mask, tokens)
            assert _rel_err(got, comp) < 1e-5, _rel_err(got, comp)
        counts = per_token_counts(eng, ids, 2)
    assert counts["ops"].get("lowrank_lrk.decode_stack") == 1 and "lowrank_lrk.decode_layer" not in counts["ops"], \
        counts["ops"]
    assert counts["by_class"]["layer"] == 1 and counts["by_class"]["gemm"] == 1, counts["by_class"]


# --------------------------------------------------------------------------- when it runs, and why not
@pytest.fixture
def counted(monkeypatch):
    """The layer index of every fused layer the engine runs through ``kernels.ops``: each lowrank_lrk::decode_layer
    call, and each layer of a decode_stack call (the dense store's step: every layer, in order, in one call)."""
    from lowrank_lib.runtime.kernels import ops

    calls = []
    real, real_stack = ops.decode_layer, ops.decode_stack

    def counting(*a, **k):
        calls.append(a[4])
        return real(*a, **k)

    def counting_stack(x, plans, *a, **k):
        calls.extend(range(len(plans)))
        return real_stack(x, plans, *a, **k)

    monkeypatch.setattr(ops, "decode_layer", counting)
    monkeypatch.setattr(ops, "decode_stack", counting_stack)
    return calls


@needs_lrk_native
def test_portable_and_off_never_call_the_fused_layer(counted):
    model = _model("lowrank-gqa")
    ids = torch.randint(0, 256, (1, 7), generator=_gen(1))
    steps = 5
    for cfg, why in ((dict(kernels="portable"), "the decode GEMVs run aten"), (dict(fused_layer="off"), "'off'")):
        eng = Engine(model, EngineConfig(max_seq_len=16, **cfg))
        eng.generate(ids, steps)
        assert not counted, cfg
        assert eng.report()["fused_layer"] == "per-op" and why in eng.report()["fused_layer_reason"], eng.report()
    eng = Engine(model, EngineConfig(max_seq_len=16))                      # auto: it can run here
    eng.generate(ids, steps)
    assert counted == list(range(len(eng.layers))) * (steps - 1)
    assert "auto: one lowrank_lrk::decode_layer call per layer" in eng.report()["fused_layer_reason"]
    with pytest.raises(RuntimeError, match="fused_layer='on' cannot run: the decode GEMVs run aten"):
        Engine(model, EngineConfig(max_seq_len=16, kernels="portable", fused_layer="on"))
    with pytest.raises(ValueError, match="fused_layer="):
        EngineConfig(fused_layer="yes")


@needs_lrk_native
def test_other_stores_attention_and_shapes_keep_the_per_op_step(counted):
    from lowrank_lib.kv import MethodStore, make_method

    model = _model("lowrank-gqa")
    ids = torch.randint(0, 256, (1, 7), generator=_gen(2))
    cases = [(dict(kv="rebuild"), None, "'rebuild' KV store"), (dict(attention="sdpa"), None, "attention is sdpa"),
             (dict(pack_qkv=False), None, "not packed"), (dict(max_batch=9), None, "max_batch 9"),
             ({}, MethodStore(make_method("attsvd", 0.5)), "AttSVD appends tokens its own way"),
             ({}, MethodStore(make_method("dense"), attention="portable"), "not a kernel the fused layer runs")]
    for cfg, store, why in cases:
        eng = Engine(model, EngineConfig(max_seq_len=16, **cfg), kv=store)
        assert eng.report()["fused_layer"] == "per-op" and why in eng.report()["fused_layer_reason"], (cfg, eng.report())
        eng.generate(ids, 3)
    gelu = models.tiny_model("tiny-gqa", seed=2, hidden_act="gelu")
    eng = Engine(gelu, EngineConfig(max_seq_len=16))
    assert "not SiLU" in eng.report()["fused_layer_reason"]
    assert not counted


# --------------------------------------------------------------------------- over the tiered store of lowrank_lib.kv
@pytest.fixture
def counted_tiers(monkeypatch):
    """Every lowrank_lrk::decode_stack_tiers / decode_layer_tiers call the engine makes through ``kernels.ops``, by
    name."""
    from lowrank_lib.runtime.kernels import ops

    calls = []
    for name in ("decode_stack_tiers", "decode_layer_tiers"):
        def counting(*a, _real=getattr(ops, name), _name=name, **k):
            calls.append(_name)
            return _real(*a, **k)

        monkeypatch.setattr(ops, name, counting)
    return calls


def _tiered(name, dtype, graph, fused, batch=2, n=8, stack=True):
    """A MethodStore engine on a low-rank tiny model, a 40-token prompt (row 1 left-padded by 5 when batch 2), teacher
    forced over the same tokens -> (engine, store, logits); ``stack`` False: one fused call per layer."""
    from lowrank_lib.kv import MethodStore, make_method

    model = _model("lowrank-smol")
    g = _gen(11)
    ids = torch.randint(3, 256, (batch, 40), generator=g)
    mask = torch.ones(batch, 40, dtype=torch.long)
    if batch > 1:
        mask[1, :5] = 0
    nxt = torch.randint(3, 256, (n, batch), generator=g)
    store = MethodStore(make_method(name, 0.5))
    eng = Engine(model, EngineConfig(max_batch=batch, max_seq_len=40 + n + 2, dtype=dtype, graph=graph,
                                     fused_layer=fused, compile_backend="aot_eager"), kv=store)
    if not stack:
        eng._stack = None
    with torch.no_grad():
        out = [eng.prefill(ids, attention_mask=mask)] + [eng.step(t) for t in nxt]
    return eng, store, [x.float() for x in out]


@needs_lrk
@pytest.mark.parametrize("name", ["composed-kvzip-q8", "kvzip", "dense"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("graph", ["none", "whole-step"])
def test_fused_layer_over_the_tiered_store_equals_its_per_op_step(name, dtype, graph, counted_tiers):
    """A KV method of ``lowrank_lib.kv`` in the engine (exact rows, low-rank runs with int8 factors, evicted
    tokens, appended rows): the fused layer writes each token's k / v at its appended row and runs the tier kernel
    inside the op, every layer in one decode_stack_tiers call per step; logits equal to the per-op step (fp32 1e-5,
    bf16 one rounding), the same bytes held and the same appended rows, eager and compiled."""
    eng, store, got = _tiered(name, dtype, graph, "on")
    rep = eng.report()
    assert rep["fused_layer"] == "lrk_decode_layer" and "lrk_tiers attention" in rep["fused_layer_reason"], rep
    if graph == "none":
        assert counted_tiers == ["decode_stack_tiers"] * 8
    ref_eng, ref_store, ref = _tiered(name, dtype, graph, "off")
    assert ref_eng.report()["fused_layer"] == "per-op"
    assert _rel_err(got, ref) < (1e-5 if dtype == "fp32" else 1e-2), _rel_err(got, ref)
    assert store.nbytes == ref_store.nbytes
    for a, b in zip(store.layers, ref_store.layers):
        assert a.n_new == b.n_new
        for x, y in ((a.k_new, b.k_new), (a.v_new, b.v_new)):     # the rows written, and nothing past them
            assert _rel_err([x[:, :, :9].float()], [y[:, :, :9].float()]) < (1e-5 if dtype == "fp32" else 1e-2)
            assert torch.equal(x[:, :, 9:], y[:, :, 9:])


@needs_lrk_native
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_stack_tiers_is_the_layer_loop_bit_for_bit_and_its_layout_is_checked_once(dtype):
    """The tiered store's step runs every layer in one decode_stack_tiers call: on a team at 2 and 3 threads (every
    GEMV and every layer's tier attention split: the attention's pieces claimed by the members, merged by one), on
    one thread, and with the team off ($LOWRANK_LIB_TEAM=0, read per call), the same logits and the same appended rows,
    bit for bit, as one decode_layer_tiers call per layer at the same thread count (its pieces are cut for the same
    threads), batch 2 with left padding. The layouts are checked once, when the store registers them after its
    prefill (ops.tier_layout); a step checks its plans against the layout before the first layer writes."""
    from lowrank_lib.runtime.kernels import ops

    for threads in THREADS:
        for team in ("1", "0"):
            out = {}
            for stacked in (True, False):
                with num_threads(threads), build.pool(min_bytes=1), pytest.MonkeyPatch.context() as mp:
                    mp.setenv("LOWRANK_LIB_TEAM", team)
                    eng, store, logits = _tiered("composed-kvzip-q8", dtype, "none", "on", n=4, stack=stacked)
                assert (eng._stack is not None and eng._stack.tiered) == stacked
                out[stacked] = logits, [torch.cat([l.k_new, l.v_new]) for l in store.layers]
            assert all(torch.equal(a, b) for a, b in zip(out[True][0], out[False][0])), (threads, team)
            assert all(torch.equal(a, b) for a, b in zip(out[True][1], out[False][1])), (threads, team)
    # hostile layouts are refused when made (a list one short; e_off one entry short in the last layer); a step
    # naming a dropped layout, or a layout of another geometry, is refused with nothing appended
    eng, store, _ = _tiered("composed-kvzip-q8", dtype, "none", "on", n=1)
    per = [store.fused_tier_args(i) for i in range(len(store.layers))]
    lists = [[p[j] for p in per] for j in range(13)]
    short = [list(t) for t in lists]
    short[5] = short[5][:-1]
    with pytest.raises(RuntimeError, match="one entry per layer"):
        ops.tier_layout(short, eng.n_kv)
    bad = [list(t) for t in lists]
    bad[4][-1] = bad[4][0][:-1]
    with pytest.raises(RuntimeError, match="e_off"):
        ops.tier_layout(bad, eng.n_kv)
    layout, t0 = store.fused_tier_layout()
    x, c = torch.randn(2, eng.hidden).to(eng.dtype), eng.cursor
    before = [l.k_new.clone() for l in store.layers]
    plans = eng._stack.plans
    other = ops.tier_layout([t[:-1] for t in lists], eng.n_kv)          # one layer fewer than the plans
    with pytest.raises(RuntimeError, match="layers, the plans"):
        ops.decode_stack_tiers(x, plans, eng.cs_table, torch.tensor([other]), t0, c.length, c.pad)
    assert ops.drop_tier_layout(other) and not ops.drop_tier_layout(other)
    with pytest.raises(RuntimeError, match="no tier layout"):
        ops.decode_stack_tiers(x, plans, eng.cs_table, torch.tensor([other]), t0, c.length, c.pad)
    with pytest.raises(RuntimeError, match="rows of"):
        ops.decode_stack_tiers(x[:1], plans, eng.cs_table, layout, t0, c.length, c.pad)
    assert all(torch.equal(a, l.k_new) for a, l in zip(before, store.layers))
    # the store drops its layout at the next prefill and with itself
    held = list(store._layout_ids)
    with torch.no_grad():
        eng.prefill(torch.randint(3, 256, (2, 40), generator=_gen(5)))
    assert held and not any(ops.drop_tier_layout(i) for i in held) and store._layout_ids != held
    held = list(store._layout_ids)
    del eng, store
    import gc

    gc.collect()
    assert not any(ops.drop_tier_layout(i) for i in held), "the store's tier layout outlived it"


@needs_lrk_native
def test_decode_layer_tiers_rejects_hostile_arguments():
    """The tiered op checks the appended rows it writes and the row it writes at; the tier layout is tier_attend's
    own checks (an offset past a buffer is an error, never a read out of bounds)."""
    from lowrank_lib.runtime.kernels import ops

    eng, store, _ = _tiered("composed-kvzip-q8", "fp32", "none", "on", batch=1, n=2)
    f = eng._fused[0]
    args = list(store.fused_tier_args(0))
    names = ["k_new", "v_new", "k_exact", "v_exact", "e_off", "runs", "r_off", "a_k", "a_v", "b_k", "b_v", "k_scale",
             "v_scale", "t0"]
    x = torch.randn(1, eng.hidden)
    good = dict(x=x, plan=f.plan, rope=eng.cs_table, **dict(zip(names, args)), length=eng.cursor.length,
                pad=eng.cursor.pad)
    assert ops.decode_layer_tiers(**good).shape == x.shape
    kn = good["k_new"]
    bad = [dict(t0=eng.cursor.length + 1), dict(t0=eng.cursor.length - kn.shape[2]), dict(k_new=kn[..., :8]), dict(k_new=kn[:, :, :1]),
           dict(v_new=good["v_new"].double()), dict(k_new=kn.transpose(2, 3)), dict(e_off=good["e_off"] + 1),
           dict(runs=good["runs"][:, :8]), dict(plan=f.plan + 10**6), dict(x=x.bfloat16())]
    for b in bad:
        with pytest.raises(RuntimeError, match="decode_layer_tiers|tier_attend"):
            ops.decode_layer_tiers(**{**good, **b})


@needs_lrk_native
def test_decode_layer_rejects_hostile_arguments():
    """The op checks what it reads: the plan, x against the plan, the RoPE table, the layer and the slot."""
    from lowrank_lib.runtime.kernels import ops

    eng = Engine(_model("lowrank-gqa"), EngineConfig(max_seq_len=16))
    f = eng._fused[0]
    x = torch.randn(1, eng.hidden)
    c = eng.cursor
    good = dict(x=x, plan=f.plan, rope=eng.cs_table, kv=eng.kv.kv, layer=0, length=c.length, pad=c.pad)
    assert ops.decode_layer(**good).shape == x.shape
    bad = [dict(plan=f.plan + 10**6), dict(plan=-1), dict(layer=len(eng.layers)), dict(length=torch.tensor([16])),
           dict(x=x.bfloat16()), dict(x=torch.randn(2, eng.hidden + 1)), dict(rope=eng.cs_table[..., :8]),
           dict(kv=eng.kv.kv[:, :, :1]), dict(pad=c.pad.int())]
    for b in bad:
        with pytest.raises(RuntimeError, match="decode_layer"):
            ops.decode_layer(**{**good, **b})


@needs_lrk_native
@pytest.mark.parametrize("name", ["lowrank-gqa", "mixed-bias-mha", "shared-basis"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_decode_stack_is_the_layer_loop_bit_for_bit_and_refuses_hostile_plans(name, dtype):
    """The dense store's step runs every layer in one decode_stack call (at 2 threads a team, every call split, the
    biases added by one member): the same logits and the same KV bits as one decode_layer call per layer (the
    engine's loop, which a profiler's layer marks switch to and their undo switches back from), batch 2 with left
    padding; an empty, dropped, or too long list of plans is refused, and a stack is the engine's layers in order on
    the dense store or nothing."""
    from lowrank_lib.runtime.kernels import ops
    from lowrank_lib.runtime.kernels.layer import FusedStack

    model = _model(name)
    ids, mask = prompt(2)
    out = {}
    for stacked in (True, False):
        eng = Engine(model, EngineConfig(max_seq_len=24, max_batch=2, dtype=dtype))
        assert eng._stack is not None and eng._stack.plans == [f.plan for f in eng._fused]
        if not stacked:
            eng._stack = None
        with torch.no_grad(), num_threads(2), build.pool(min_bytes=1):
            logits = [eng.prefill(ids, mask)]
            for _ in range(5):
                logits.append(eng.step(logits[-1].argmax(-1)))
        out[stacked] = logits, eng.kv.kv.clone()
    assert all(torch.equal(a, b) for a, b in zip(out[True][0], out[False][0]))
    assert torch.equal(out[True][1], out[False][1])
    stack = eng._stack = FusedStack(eng._fused)
    undo = eng.layer_sections(lambda i: None)
    assert eng._stack is None
    undo()
    assert eng._stack is stack
    x, c = torch.randn(1, eng.hidden).to(eng.dtype), eng.cursor
    args = dict(rope=eng.cs_table, kv=eng.kv.kv, length=c.length, pad=c.pad)
    plans = stack.plans
    for bad in ([], plans + plans[:1], plans[:1] + [plans[-1] + 10**6]):
        with pytest.raises(RuntimeError, match="decode_stack|decode_layer"):
            ops.decode_stack(x, bad, **args)
    with pytest.raises(ValueError, match="FusedStack"):
        FusedStack(eng._fused[1:])
    with pytest.raises(ValueError, match="FusedStack"):
        FusedStack([])


@needs_lrk_native
def test_decode_stack_over_long_contexts_splits_pairs_into_pieces_with_the_same_bits():
    """bf16, D = 64, 2100+ cached slots: the attention cuts each (row, KV head) pair's slots into pieces whose softmax
    states the team's members share (one KV head per row here, so at 2 and 3 threads the members split pairs). From
    the same cache, the stack at 1, 2, 3 threads (a team, every call split) and the per-layer loop give the same
    logits and K / V bits, batch 2 with left padding, and stay within the bf16 bound of the fp32 engine."""
    model = compress_svd(models.tiny_model("tiny-smol", seed=3, max_position_embeddings=4096), 0.5)
    ids = torch.randint(0, 256, (2, 2100), generator=_gen(11))
    mask = torch.ones(2, 2100, dtype=torch.long)
    mask[1, :9] = 0
    eng = Engine(model, EngineConfig(max_seq_len=2120, max_batch=2, dtype="bf16"))
    assert eng._stack is not None
    with torch.no_grad(), num_threads(1):
        eng.prefill(ids, mask)
    c, stack = eng.cursor, eng._stack
    p0, kv0 = c.host, eng.kv.kv.clone()
    toks = torch.randint(0, 256, (3, 2), generator=_gen(12))
    runs = []
    for t in THREADS:
        for stacked in (True, False):
            eng._stack = stack if stacked else None
            eng.kv.kv.copy_(kv0)
            c.length.fill_(p0)
            c.host = p0
            with torch.no_grad(), num_threads(t), build.pool(min_bytes=1):
                runs.append(([eng.step(tk) for tk in toks], eng.kv.kv.clone()))
    for logits, kv in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(logits, runs[0][0]))
        assert torch.equal(kv, runs[0][1])
    ref = Engine(model, EngineConfig(max_seq_len=2120, max_batch=2, dtype="fp32"))
    with torch.no_grad():
        ref.prefill(ids, mask)
        want = [ref.step(tk) for tk in toks]
    assert all(_rel_err(a.float(), b) < 3e-2 for a, b in zip(runs[0][0], want))


@needs_lrk_native
def test_layer_plan_rejects_hostile_descriptions_and_outlives_nothing():
    """A plan is checked once, when made: the description's length, the tensors' sizes and dtypes, member widths,
    the geometry. A dropped plan's id is refused by the ops, never served by another layer's weights."""
    from lowrank_lib.runtime.kernels import ops

    eng = Engine(_model("lowrank-gqa"), EngineConfig(max_seq_len=16))
    f = eng._fused[0]
    good = dict(ln1=f.ln1, ln2=f.ln2, w=f.w, meta=f.meta, hidden=eng.hidden, head_dim=eng.head_dim, bf16=False,
                eps=1e-6, n_heads=eng.n_heads, n_kv=eng.n_kv, folded=eng.fold)
    bad = [dict(meta=f.meta[:-1]), dict(meta=f.meta + [1]), dict(w=f.w[:-1]), dict(w=[f.w[1]] + f.w[1:]),
           dict(n_kv=eng.n_kv + 1), dict(folded=not eng.fold), dict(bf16=True), dict(hidden=eng.hidden + 1),
           dict(head_dim=eng.head_dim + 1), dict(w=[t.double() for t in f.w]), dict(final_w=torch.randn(eng.hidden)),
           dict(final_norm=True, final_w=torch.randn(eng.hidden + 1))]
    for b in bad:
        with pytest.raises(RuntimeError, match="layer_plan"):
            ops.layer_plan(**{**good, **b})
    plan = ops.layer_plan(**good)
    x, c = torch.randn(1, eng.hidden), eng.cursor
    args = dict(rope=eng.cs_table, kv=eng.kv.kv, layer=0, length=c.length, pad=c.pad)
    kv0 = eng.kv.kv.clone()
    assert torch.equal(ops.decode_layer(x, plan, **args), ops.decode_layer(x, f.plan, **args))
    assert ops.drop_layer_plan(plan) and not ops.drop_layer_plan(plan)
    assert ops.layer_plan(**good) > plan                      # ids move on
    with pytest.raises(RuntimeError, match="no layer plan"):
        ops.decode_layer(x, plan, **args)
    # the engine's plans go with its layers
    plans = [g.plan for g in eng._fused]
    del eng, f
    import gc
    gc.collect()
    assert not any(ops.drop_layer_plan(p) for p in plans)
    assert kv0.numel() > 0


def test_selection_without_packed_gemvs_says_why():
    """The selection reads capabilities: a portable GEMV backend rules the fused layer out before anything else."""
    from lowrank_lib.runtime.kernels.gemv import GemvChoice
    from lowrank_lib.runtime.kernels.layer import select_fused_layer

    ch = select_fused_layer("auto", GemvChoice("aten", "requested: kernels='portable'"), None, [], True, 1)
    assert not ch.enabled and "aten" in ch.reason and ch.name == "per-op"
    with pytest.raises(ValueError, match="fused_layer="):
        select_fused_layer("always", GemvChoice("aten", ""), None, [], True, 1)


# --------------------------------------------------------------------------- where a token's time goes (issue 29)
@needs_lrk_native
@pytest.mark.parametrize("graph", ["none", "whole-step"])
def test_token_breakdown_accounts_for_every_phase_inside_the_step(graph):
    """token_breakdown: every phase of every layer call is timed (a lap left out would leave its phase at zero and
    fold its time into the next), the phases fit inside the measured step, the GEMV bytes are the layers' groups."""
    from lowrank_lib.runtime.kernels.layer import PHASES
    from lowrank_lib.runtime.kernels.ops import layer_profile
    from lowrank_lib.runtime.profiling import token_breakdown

    model = _model("lowrank-smol")
    ids = torch.randint(0, 256, (1, 9), generator=_gen(3))
    eng = Engine(model, EngineConfig(max_seq_len=40, dtype="bf16", graph=graph))
    b = token_breakdown(eng, ids, 12)
    assert b["available"] and b["steps"] == 11 and b["layer_calls_per_token"] == len(eng.layers), b
    assert set(b["phases_ms"]) == set(PHASES) and all(v > 0 for v in b["phases_ms"].values()), b["phases_ms"]
    assert b["outside_layers_ms"] > -1e-3 and sum(b["phases_ms"].values()) <= b["step_ms"] + 1e-3, b
    assert b["gemv_ms"] == pytest.approx(sum(b["phases_ms"][p] for p in ("qkv_gemv", "o_gemv", "gate_up_gemv",
                                                                        "down_gemv")))
    assert b["gemv_bytes_per_token"] == sum(g.nbytes for L in eng.layers for g in (L.qkv, L.o, L.gate_up, L.down))
    assert b["gemv_bytes_per_token"] + b["head_and_other_bytes"] == eng.weight_bytes_per_token()
    eng.generate(ids, 4)                                       # timers off outside the block: nothing counted
    assert layer_profile(False) == [0] * (1 + len(PHASES))
    off = token_breakdown(Engine(model, EngineConfig(max_seq_len=40, fused_layer="off")), ids, 4)
    assert not off["available"] and "'off'" in off["reason"], off


# --------------------------------------------------------------------------- the layer's vectorised SiLU * up
@needs_lrk
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_atens_at_every_isa_level(dtype):
    """The fused layer's SiLU(g) * u (scalar, AVX2 and AVX-512 code, tails included) against ATen's silu(g) * u: bf16
    the same bits on 200k values (both round silu to bf16 before the product), fp32 within 4 ulp (two roundings and
    two exps of 1-2 ulp each); NaN stays NaN."""
    gen = torch.Generator().manual_seed(0)
    g = torch.cat([torch.randn(200_003, generator=gen) * 6, torch.tensor([0.0, -0.0, 80.0, -80.0, 1e-40, -1e-40, 30.5,
                                                                       -17.25])])
    u = torch.randn(g.numel(), generator=gen)
    g, u = g.to(dtype), u.to(dtype)
    ref = torch.nn.functional.silu(g) * u
    for lv in range(_silu_level() + 1):
        for n in (g.numel(), 7, 15, 17):                                 # every tail length of 8 / 16 lanes
            out = torch.ops.lowrank_lrk.silu_mul(g[:n].contiguous(), u[:n].contiguous(), lv)
            if dtype == torch.bfloat16:
                assert torch.equal(out, ref[:n]), (lv, n, int((out != ref[:n]).sum()))
            else:
                err = ((out.double() - ref[:n].double()).abs() / ref[:n].double().abs().clamp_min(1e-30))
                assert float(err.max()) < 5e-7, (lv, n, float(err.max()))                 # 4 ulp
        nan = torch.ops.lowrank_lrk.silu_mul(torch.tensor([float("nan")] * 3, dtype=dtype), torch.ones(3, dtype=dtype), lv)
        assert torch.isnan(nan).all(), lv
    with pytest.raises(RuntimeError, match="g and u must be"):
        torch.ops.lowrank_lrk.silu_mul(g[:4], u[:5], -1)


def _silu_level() -> int:
    """The highest silu_mul level this CPU (under the kernels' ISA mask) runs: 2 AVX-512, 1 AVX2 + FMA, else 0."""
    for lv in (2, 1):
        try:
            torch.ops.lowrank_lrk.silu_mul(torch.zeros(1), torch.zeros(1), lv)
            return lv
        except RuntimeError:
            continue
    return 0
