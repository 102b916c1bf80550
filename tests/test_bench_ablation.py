"""runtime/ablation.py (bench ablation, notebook 03): every comparison is timed side by side (tiny model, no speed
assertions: the derived numbers are checked against the samples they came from)."""
import statistics

import pytest

from lowrank_lib import models
from lowrank_lib.runtime.ablation import mechanism_table, step_latency_vs_context, sweep
from lowrank_lib.compress import compress_svd


@pytest.fixture(scope="module")
def tiny():
    dense = models.tiny_model("tiny-gqa", seed=0)
    return dense, compress_svd(dense, 0.5)


def test_mechanism_rows_are_paired_with_the_reference(tiny):
    dense, comp = tiny
    rows = mechanism_table(comp, dense, 8, 3, 1, rows=["dense KV", "engine - pack qkv"], progress=False)
    assert [r["system"] for r in rows] == ["hf_static", "dense KV", "engine - pack qkv"]
    ref, *others = rows
    assert ref["speedup_vs_hf_static"] == 1.0 and len(ref["decode_ms_repeats"]) == len(others)   # pooled pairs
    for r in others:
        assert len(r["decode_ms_repeats"]) == 1 and r["decode_ms_q1"] <= r["decode_ms"] <= r["decode_ms_q3"]
        assert r["speedup_vs_hf_static"] == pytest.approx(r["reference_ms"] / r["decode_ms"])
    assert others[0]["ops_per_token"] < ref["ops_per_token"]


def test_sweep_and_step_latency_cover_their_grids_in_order(tiny):
    dense, comp = tiny
    rows = sweep(comp, dense, ("hf_static", "engine"), (4, 8), (3,), 1, progress=False)
    assert [(r["system"], r["prompt_len"]) for r in rows] == [("hf_static", 4), ("hf_static", 8), ("engine", 4),
                                                               ("engine", 8)]
    lat = step_latency_vs_context(comp, dense, ("naive", "engine"), (4, 8), steps=4, progress=False)
    assert [(r["system"], r["cached_len"]) for r in lat] == [("naive", 4), ("naive", 8), ("engine", 4), ("engine", 8)]
    for r in lat:       # the first step is the warm-up
        assert len(r["step_ms_samples"]) == 3 and r["step_ms"] == pytest.approx(statistics.median(r["step_ms_samples"]))
