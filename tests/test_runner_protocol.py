"""The written ``Runner`` protocol (``lowrank_lib.runtime.runner``): every runner ``make_runner`` builds, and the
Engine eager and compiled, has every member and behaves as the protocol says (prepare returns seconds, counters
have their keys, invalidate drops the capture so the next prepare captures again)."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.compress import compress_svd
from lowrank_lib.runtime import Engine, EngineConfig, Runner, run_generation
from lowrank_lib.runtime.baselines import SYSTEMS, make_runner
from lowrank_lib.runtime.runner import LM_HEAD_MODES

#: systems whose graph modes exist on CUDA only (CPU "graphs" are one compiled whole step): refused on CPU
CUDA_ONLY = {"engine_layer", "engine_split"}


@pytest.fixture(scope="module")
def models_pair():
    model = models.tiny_model("tiny-gqa", seed=3)
    return compress_svd(model, 0.5), model


def check_runner(r, B: int = 1, T: int = 6) -> None:
    """The protocol's behaviour on one runner (after a prefill, as a benchmark calls it)."""
    assert isinstance(r, Runner), type(r)
    assert r.lm_head_mode in LM_HEAD_MODES and isinstance(r.compiled, bool) and isinstance(r.capture_s, float)
    ids = torch.randint(3, 200, (B, T), generator=torch.Generator().manual_seed(1))
    r.reset_counters()
    logits = r.prefill(ids)
    assert logits.shape[0] == B and logits.dim() == 2
    first = r.prepare(B)
    assert isinstance(first, float) and first >= 0.0
    c = r.counters()
    assert set(c) >= {"lm_head", "compiles"} and isinstance(c["lm_head"], dict) and isinstance(c["compiles"], list)
    if r.compiled:
        assert first > 0.0 and len(c["compiles"]) == 1 and r.capture_s >= first, c
        assert r.prepare(B) == 0.0                                  # captured once per batch size
        r.invalidate()
        again = r.prepare(B)                                         # captured again
        assert again > 0.0 and len(r.counters()["compiles"]) == 2
    else:
        assert first == 0.0 and c["compiles"] == [] and r.capture_s == 0.0
        r.invalidate()
        assert r.prepare(B) == 0.0
    out = r.step(logits.argmax(-1))
    assert out.shape == logits.shape and torch.isfinite(out).all()
    if not r.compiled:          # the eager step marks every decoder layer, in order, until the undo
        marks = []
        undo = r.layer_sections(marks.append)
        r.step(out.argmax(-1))
        undo()
        layers = [m for m in marks if m is not None]
        assert layers and sorted(set(layers)) == list(range(layers[-1] + 1)) and layers == sorted(layers), marks
        assert marks[-1] is None and len(marks) == 2 * len(layers), marks
        marks.clear()
        r.step(out.argmax(-1))
        assert marks == []
    r.reset_counters()
    assert r.counters()["compiles"] == []


@pytest.mark.parametrize("system", SYSTEMS)
def test_every_baseline_system_is_a_runner(system, models_pair):
    lr, dense = models_pair
    kw = dict(max_seq_len=24, compile_backend="eager")      # a compile without inductor: seconds, not minutes
    if system in CUDA_ONLY:
        with pytest.raises(ValueError, match="not available on CPU"):
            make_runner(system, lr, dense, **kw)
        return
    check_runner(make_runner(system, lr, dense, **kw))


@pytest.mark.parametrize("graph", ["none", "whole-step"])
def test_engine_is_a_runner_eager_and_compiled(graph, models_pair):
    lr, _ = models_pair
    eng = Engine(lr, EngineConfig(max_seq_len=24, max_batch=2, graph=graph, compile_backend="eager"))
    assert eng.compiled == (graph != "none") and eng.lm_head_mode == "exact"
    check_runner(eng, B=2)
    assert eng.counters()["lm_head"] == {}                  # the exact head counts nothing


def test_certified_head_counts_through_the_protocol(models_pair):
    """``counters()["lm_head"]`` is the certified head's: every head call of the loop is counted, reset
    zeroes them."""
    lr, _ = models_pair
    eng = Engine(lr, EngineConfig(max_seq_len=24, lm_head="certified"))
    assert eng.lm_head_mode == "certified"
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(2))
    eng.reset_counters()
    run_generation(eng, ids, 5)
    head = eng.counters()["lm_head"]
    assert head["calls"] == 5 and {"certified_calls", "fallback_calls"} <= set(head), head   # prefill's last row + 4
    eng.reset_counters()
    assert eng.counters()["lm_head"]["calls"] == 0
