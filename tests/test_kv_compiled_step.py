"""The configuration behind the committed ``kv_decode_3.json``, at CI size: a composed KV method through
``MethodStore`` in the engine's compiled whole step (``torch.compile``, inductor), with the fused tier kernel where
the CPU has it and the portable path everywhere (``kernels="portable"``), against the eager portable engine.

The fused kernel's calls are counted with the torch profiler (the ops are opaque to the compiler, so each call of the
compiled step reaches the dispatcher): once per layer and step where it runs, never under ``kernels="portable"``.
Where the fused decode layer runs (``EngineConfig.fused_layer`` auto) the kernel is called inside
``lowrank_lrk::decode_layer_tiers``, which is then the op counted.
"""
from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from lowrank_lib import models
from lowrank_lib.kv import MethodStore, make_method
from lowrank_lib.kv.tiers import lrk_tiers_unavailable
from lowrank_lib.runtime import Engine, EngineConfig

from helpers import rel_err

T, STEPS, METHOD, BUDGET = 64, 4, "composed-kvzip-q8", 0.5
FUSED_OP = "lowrank_lrk::tier_attend"


@pytest.fixture(scope="module")
def model():
    return models.tiny_model("tiny-gqa", seed=0).eval()


@pytest.fixture(scope="module")
def reference(model):
    """The eager portable engine (graph none, kernels portable): logits, fused calls, report."""
    return _run(model, "portable", "none")


def _run(model, kernels: str, graph: str):
    """Prefill + STEPS decode steps (batch 1): the logits, the fused kernel's calls during the decode steps after
    the first (which compiles), the engine's report."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (1, T), generator=g)
    nxt = torch.randint(3, 256, (STEPS, 1), generator=g)
    store = MethodStore(make_method(METHOD, BUDGET))
    eng = Engine(model, EngineConfig(max_batch=1, max_seq_len=T + STEPS + 1, graph=graph, kernels=kernels), kv=store)
    with torch.no_grad():
        out = [eng.prefill(ids), eng.step(nxt[0])]                 # the first step compiles and warms up
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            out += [eng.step(t) for t in nxt[1:]]
    op = "lowrank_lrk::decode_stack_tiers" if eng.report()["fused_layer"] == "lrk_decode_layer" else FUSED_OP
    calls = sum(e.count for e in prof.key_averages() if e.key == op)
    return out, calls, eng.report()


def _fused_unavailable(model) -> str | None:
    cfg = model.config
    return lrk_tiers_unavailable(torch.device("cpu"), cfg.hidden_size // cfg.num_attention_heads, torch.float32)


@pytest.mark.parametrize("kernels", ["auto", "portable"])
def test_compiled_whole_step_composed_cache_equals_the_eager_portable_engine(model, reference, kernels):
    if kernels == "auto" and (why := _fused_unavailable(model)):
        pytest.skip(f"the fused tier kernel cannot run here: {why}")
    ref, ref_calls, ref_rep = reference
    out, calls, rep = _run(model, kernels, "whole-step")
    assert ref_calls == 0 and ref_rep["kv_store"]["attention"] == "portable"
    assert rep["graph"] == "whole-step" and rep["config"]["compile_backend"] == "inductor" and rep["compiles"], rep
    if kernels == "auto":                     # the fused stack ran, once per decode step (every layer inside)
        assert rep["kv_store"]["attention"] == "lrk_tiers", rep["kv_store"]
        assert rep["fused_layer"] == "lrk_decode_layer", rep["fused_layer_reason"]
        assert calls == STEPS - 1, calls
    else:                                     # kernels="portable": no fused kernel anywhere
        assert rep["kv_store"]["attention"] == "portable", rep["kv_store"]
        assert calls == 0, calls
    assert max(rel_err(a, b) for a, b in zip(out, ref)) < 1e-5      # prefill and every decode step
    assert rep["kv_store"]["fit"]["bytes_held"] == ref_rep["kv_store"]["fit"]["bytes_held"]
