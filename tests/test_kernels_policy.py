"""``EngineConfig(kernels=...)`` governs EVERY native kernel (``torch.ops.lowrank_lrk``): the decode GEMVs, the
dense decode attention (``lrk_attend``), a ``MethodStore``'s tiered attention (``lrk_tiers``) and the certified
head. Counted, not inferred from reports: the profiler records every call of an op of the namespace during a
prefill and decode, eager and in a compiled step."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.compress import compress_svd
from lowrank_lib.kv import make_method
from lowrank_lib.kv.engine_adapter import MethodStore
from lowrank_lib.kv.tiers import lrk_tiers_unavailable
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.attention import lrk_attend_unavailable
from lowrank_lib.runtime.kernels.build import NAMESPACE

CPU = torch.device("cpu")
HAS_TIERS = lrk_tiers_unavailable(CPU, 16, torch.float32) is None
HAS_ATTEND = lrk_attend_unavailable(CPU, 16, torch.float32) is None


@pytest.fixture(scope="module")
def model():
    return compress_svd(models.tiny_model("tiny-gqa", seed=4), 0.5).eval()


def native_calls(eng: Engine, T: int = 48, steps: int = 4) -> Counter:
    """Calls of every ``lowrank_lrk`` op during a prefill of T tokens and ``steps`` decode steps."""
    from torch.profiler import ProfilerActivity, profile

    ids = torch.randint(3, 256, (1, T), generator=torch.Generator().manual_seed(5))
    logits = eng.prefill(ids)
    eng.prepare(1)                                   # the compile's warm run is not counted
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        logits = eng.prefill(ids)
        for _ in range(steps):
            logits = eng.step(logits.argmax(-1))
    return Counter(e.name.split("::")[1] for e in prof.events() if e.name.startswith(f"{NAMESPACE}::"))


def engine(model, kv: str, kernels: str, graph: str) -> Engine:
    store = MethodStore(make_method("composed-kvzip-q8", budget=0.25)) if kv == "composed" else None
    return Engine(model, EngineConfig(max_seq_len=64, kernels=kernels, graph=graph, compile_backend="eager",
                                      lm_head="certified"), kv=store)


@pytest.mark.parametrize("graph", ["none", "whole-step"])
@pytest.mark.parametrize("kv", ["dense", "composed"])
def test_portable_runs_no_native_kernel(model, kv, graph):
    eng = engine(model, kv, "portable", graph)
    calls = native_calls(eng)
    assert not calls, calls
    rep = eng.report()
    assert rep["gemv"] in ("aten", "inductor_reduce") and rep["backend"] in ("sdpa", "portable")


@pytest.mark.skipif(not (HAS_TIERS and HAS_ATTEND), reason="the native kernels cannot run on this CPU")
@pytest.mark.parametrize("graph", ["none", "whole-step"])
@pytest.mark.parametrize("kv", ["dense", "composed"])
def test_auto_runs_every_native_kernel_where_it_can(model, kv, graph):
    calls = native_calls(engine(model, kv, "auto", graph))
    if kv == "dense":   # the fused decode layer (layer.cpp) runs the GEMVs and the attention inside: every layer in
        # one decode_stack call a step
        assert calls["decode_stack"] == 4 and not calls["decode_layer"], calls
        assert calls["certified_head"] > 0 and not calls["gemv"], calls
        return
    # the composed cache: the same fused layers over its tiers, every layer in one decode_stack_tiers call a step (the
    # tier kernel inside)
    assert calls["decode_stack_tiers"] == 4 and not calls["decode_layer_tiers"], calls
    assert calls["certified_head"] > 0 and not calls["gemv"], calls


def test_a_native_backend_requested_under_portable_is_refused(model):
    with pytest.raises(RuntimeError, match="kernels='portable'"):
        Engine(model, EngineConfig(max_seq_len=64, kernels="portable", attention="lrk_attend"))
    with pytest.raises(RuntimeError, match="kernels='portable'"):
        Engine(model, EngineConfig(max_seq_len=64, kernels="portable"),
               kv=MethodStore(make_method("composed-kvzip-q8", budget=0.25), attention="lrk_tiers"))
    with pytest.raises(ValueError, match="dense-cache attention"):
        Engine(model, EngineConfig(max_seq_len=64, attention="sdpa"), kv=MethodStore(make_method("dense")))
