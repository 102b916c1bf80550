"""runtime/ablation.py, issue 27: the uncompressed rows, every row defined, across-run spreads and the verdicts
notebook 03's conclusion is computed from."""
import pytest

from lowrank_lib import models
from lowrank_lib.compress import compress_svd
from lowrank_lib.runtime.ablation import (COMPARISONS, DEFINITIONS, MECHANISMS, ROW_SYSTEM, UNCOMPRESSED, compare,
                                          mechanism_table, mechanism_verdicts, step_latency_vs_context)
from lowrank_lib.runtime.baselines import ENGINE_VARIANTS
from lowrank_lib.runtime.config import PRESETS, EngineConfig
from lowrank_lib.runtime.baselines import make_runner
from lowrank_lib.runtime.profiling import per_token_counts


def test_every_row_is_defined_and_row_systems_are_those_systems():
    assert set(MECHANISMS) | set(UNCOMPRESSED) | {"hf_static", "hf_dynamic"} == set(DEFINITIONS)
    for a, b, _ in COMPARISONS:
        assert a in DEFINITIONS and b in DEFINITIONS
    for row, system in ROW_SYSTEM.items():
        if system.startswith("hf_") or system == "dense_hf_static":
            assert UNCOMPRESSED.get(row, row) == system
            continue
        kw = MECHANISMS.get(row, UNCOMPRESSED.get(row))
        want = ENGINE_VARIANTS[system] if system in ENGINE_VARIANTS else PRESETS[system]
        assert EngineConfig(max_seq_len=16, **kw) == EngineConfig(max_seq_len=16, **want), row
        assert (row in UNCOMPRESSED) == system.startswith("dense_") and system != "dense_kv" or system == "dense_kv"


def _row(name, runs):
    s = sorted(runs)
    return {"system": name, "decode_ms_run_median": s[len(s) // 2], "decode_ms_run_min": s[0],
            "decode_ms_run_max": s[-1]}


def test_verdicts_say_within_noise_when_run_ranges_overlap():
    a, b, c = _row("dense KV", [10, 11, 12]), _row("naive: low-rank history rebuilt", [11.5, 13, 14]), \
        _row("hf_static", [20, 21, 22])
    assert compare(a, b) == {"speedup": pytest.approx(13 / 11), "verdict": "within noise"}
    assert compare(a, c)["verdict"] == "faster" and compare(c, a)["verdict"] == "slower"
    v = mechanism_verdicts([a, b, c])
    assert [(x["row"], x["against"], x["verdict"]) for x in v] == [
        ("dense KV", "naive: low-rank history rebuilt", "within noise")]


def test_uncompressed_rows_run_the_dense_model():
    dense = models.tiny_model("tiny-gqa", seed=0)
    comp = compress_svd(dense, 0.5)
    rows = mechanism_table(comp, dense, 8, 3, 2, rows=["+ our CPU kernels (packed GEMV + attention), eager",
                                                             "+ weight layout (= engine, eager)"],
                           uncompressed=True, progress=False)
    by = {r["system"]: r for r in rows}
    assert set(UNCOMPRESSED) <= set(by)
    for r in rows:
        assert r["runs"] == len(r["decode_ms_repeats"])
        assert r["decode_ms_run_min"] <= r["decode_ms_run_median"] <= r["decode_ms_run_max"]
    import torch
    ids = torch.randint(0, comp.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    for row in ("uncompressed: HF static", "uncompressed: engine + our CPU kernels, eager", "hf_static"):
        want = per_token_counts(make_runner(ROW_SYSTEM[row], comp, dense, max_seq_len=16), ids)["total"]
        assert by[row]["ops_per_token"] == want, row
    # the dense model has one GEMM per projection: fewer dispatches than the factors through the same runner
    assert by["uncompressed: HF static"]["ops_per_token"] < by["hf_static"]["ops_per_token"]
    L = comp.config.num_hidden_layers          # one GEMM per dense projection (4 per layer packed), 11 low-rank
    assert by["uncompressed: engine, eager"]["ops_by_class"]["gemm"] == 4 * L + 1
    assert by["+ weight layout (= engine, eager)"]["ops_by_class"]["gemm"] == 11 * L + 1
    with pytest.raises(ValueError):
        mechanism_table(comp, None, 8, 3, 1, rows=[], uncompressed=True, progress=False)


def test_step_latency_repeats_are_runs_with_their_spread():
    import statistics

    dense = models.tiny_model("tiny-gqa", seed=0)
    comp = compress_svd(dense, 0.5)
    rows = step_latency_vs_context(comp, dense, ("engine", "naive"), (8, 16), steps=4, progress=False, repeats=3)
    assert len(rows) == 4
    for r in rows:
        assert r["runs"] == len(r["step_ms_repeats"]) == 3 and len(r["step_ms_samples"]) == 3 * 3
        assert r["step_ms_run_min"] <= r["step_ms_run_median"] <= r["step_ms_run_max"]
        assert r["step_ms_run_median"] == pytest.approx(statistics.median(r["step_ms_repeats"]))
        assert r["step_ms"] == pytest.approx(statistics.median(r["step_ms_samples"]))


def test_side_by_side_counts_the_model_and_every_copy_a_runner_holds():
    import torch

    from lowrank_lib.runtime.ablation import side_by_side

    comp = compress_svd(models.tiny_model("tiny-gqa", seed=0), 0.5)
    b = sum(t.numel() * t.element_size() for t in [*comp.parameters(), *comp.buffers()])
    hf = ("hf_static", "hf_dynamic", "naive", "dense_kv")              # read the model's own fp32 tensors
    assert side_by_side(comp, hf, memory_bytes=int(b / 0.75) + 1)
    assert not side_by_side(comp, hf, memory_bytes=int(b / 0.75) - 8)
    two = int(2 * b / 0.75) + 1                                          # the model and one packed engine
    assert side_by_side(comp, ("hf_static", "engine"), memory_bytes=two)
    assert not side_by_side(comp, ("hf_static", "engine", "engine"), memory_bytes=two)
    half = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in [*comp.parameters(),
                                                                                          *comp.buffers()])
    # in bf16 an HF runner casts its own copy of an fp32 model
    assert side_by_side(comp, ("hf_static",), torch.bfloat16, memory_bytes=int(2 * half / 0.75) + 1)
    assert not side_by_side(comp, ("hf_static",), torch.bfloat16, memory_bytes=int(2 * half / 0.75) - 8)


def test_runners_too_large_together_are_timed_one_at_a_time(monkeypatch):
    """A machine too small for the model beside a packed copy (a 7B model on 24 GB): every timing runs one system
    alone (no clock runs while weights page in), and every row says so; the rows are the same rows."""
    from lowrank_lib import host
    from lowrank_lib.runtime import ablation

    comp = compress_svd(models.tiny_model("tiny-gqa", seed=0), 0.5)
    seen = []
    tg, il = ablation.timed_generations, ablation.interleaved
    monkeypatch.setattr(ablation, "timed_generations", lambda r, *a, **k: seen.append(len(r)) or tg(r, *a, **k))
    monkeypatch.setattr(ablation, "interleaved", lambda fns, *a, **k: seen.append(len(fns)) or il(fns, *a, **k))
    big = ablation.sweep(comp, None, ("hf_static", "engine"), [4], [2], 2, progress=False)
    assert {r["timed"] for r in big} == {"interleaved"} and set(seen) == {2}
    monkeypatch.setattr(host, "physical_memory", lambda: 1)
    seen.clear()
    rows = ablation.sweep(comp, None, ("hf_static", "engine"), [4], [2], 2, progress=False)
    lat = ablation.step_latency_vs_context(comp, None, ("dense_kv", "engine"), [4], steps=3, progress=False)
    mech = ablation.mechanism_table(comp, None, 4, 2, 2, rows=["dense KV", "+ weight layout (= engine, eager)"],
                                    progress=False)
    assert set(seen) == {1}
    assert [r["system"] for r in rows] == [r["system"] for r in big]
    for r in rows + lat + mech:
        assert r["timed"] == "alone" and r["runs"] >= 1, r["system"]
    by = {r["system"]: r for r in mech}
    assert by["dense KV"]["reference_ms"] == by["hf_static"]["decode_ms"]          # the reference, timed once alone
