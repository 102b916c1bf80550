"""Notebook 03: mechanism ablation table and latency sweeps (CI: tiny model, few points)."""
import math
import statistics

import pytest

pytestmark = pytest.mark.notebook


def test_graph_replay_ablation_notebook(executed_notebook):
    m = executed_notebook("03_graph_replay_ablation")
    from lowrank_lib.runtime.ablation import MECHANISMS

    mech = m["mechanisms"]
    assert {"hf_static", "hf_dynamic"} <= set(mech)
    assert {k for k in MECHANISMS if "graph" not in k} <= set(mech)
    ops = {k: v["ops_per_token"] for k, v in mech.items()}
    eng = ops["+ weight layout (= engine, eager)"]
    assert ops["engine - weight layout (out_major)"] == eng == ops["+ fold RoPE"]   # layout: same ops, other order
    assert eng < ops["dense KV"] < ops["naive: low-rank history rebuilt"] < ops["hf_static"]
    for k in ("engine - pack qkv", "engine - fold RoPE"):
        assert ops[k] > eng, k                      # these mechanisms remove CPU dispatches
    # packed gate/up trades 2 GEMMs for 1 GEMM + split: the same CPU dispatch count (on CUDA the
    # split is a view, so it saves a launch)
    assert ops["engine - pack mlp"] == eng
    assert ops["engine + fold norm (ulp drift)"] < eng
    # every sweep covers its full grid once (CI: 2 prompt lengths, 2 generation lengths, 2 cached lengths, 2 keeps)
    systems = {"hf_static", "dense_kv", "engine", "naive"}
    for rows, key, fixed in ((m["by_prompt"], "prompt_len", ("gen_len", m["gen_len"])),
                             (m["by_gen"], "gen_len", ("prompt_len", m["prompt_len"])),
                             (m["step_latency"], "cached_len", None)):
        vals = sorted({r[key] for r in rows})
        assert len(vals) == 2 and sorted((r["system"], r[key]) for r in rows) == sorted(
            (s, v) for s in systems for v in vals)
        assert fixed is None or all(r[fixed[0]] == fixed[1] for r in rows)
        assert all(math.isfinite(r["step_ms" if key == "cached_len" else "decode_ms"]) for r in rows)
    keeps = sorted({r["keep"] for r in m["by_keep"]})
    assert keeps == [0.3, 0.7] and sorted((r["keep"], r["system"]) for r in m["by_keep"]) == [
        (k, s) for k in keeps for s in ("engine", "hf_static")]
    # the growth figures are the step latency at the longest over the shortest cached length
    for s in ("naive", "engine"):
        lat = sorted((r["cached_len"], r["step_ms_run_median"]) for r in m["step_latency"] if r["system"] == s)
        assert m[f"growth_{s}"] == pytest.approx(lat[-1][1] / lat[0][1])
    # llama.cpp side by side when the `peer` extra is installed, a plain reason when not
    peer = m["peer"]
    from lowrank_lib.bench.llamacpp import available

    assert peer["available"] == available()[0]
    if peer["ran"]:
        assert {(r["system"], r["dtype"]) for r in peer["rows"]} == {
            (s, "fp32") for s in ("llamacpp_dense", "lowrank_lib_dense", "lowrank_lib_lowrank")}
        assert peer["equivalence"]["tokens_equal"]
        assert all(r["decode_ms_per_token"] > 0 for r in peer["rows"])
        for r in peer["rows"]:                 # medians across PEER_RUNS runs (issue 27), each with its run range
            d = r["decode_runs"]
            assert d["runs"] == peer["runs"] == 2 and d["min_ms"] <= r["decode_ms_per_token"] == d["median_ms"] <= d["max_ms"]
    else:
        assert "not installed" in peer["why_not"]
    assert len(m["figures"]) == 3 + peer["ran"]
    if peer["ran"]:                      # plain and certified heads both reported, each row naming its head
        assert {r["lm_head"] for r in peer["rows"] if r["system"] != "llamacpp_dense"} == {"exact", "certified"}
        assert all("met" in t for t in peer["targets"])


def test_ablation_rows_defined_uncompressed_and_spread_across_runs(executed_notebook):
    """Issue 27: the uncompressed-model rows, every row defined, medians across runs with their spread, the
    verdicts computed from those spreads."""
    m = executed_notebook("03_graph_replay_ablation")
    from lowrank_lib.runtime.ablation import DEFINITIONS, UNCOMPRESSED

    mech = m["mechanisms"]
    assert set(UNCOMPRESSED) <= set(mech)
    assert m["definitions"] == {k: DEFINITIONS[k] for k in mech}
    # the uncompressed model through the same runners: one GEMM per projection, fewer than the factors need
    assert mech["uncompressed: engine, eager"]["ops_by_class"]["gemm"] < mech["+ weight layout (= engine, eager)"]["ops_by_class"]["gemm"]
    assert mech["uncompressed: HF static"]["ops_per_token"] < mech["hf_static"]["ops_per_token"]
    rows = list(mech.values()) + m["by_prompt"] + m["by_gen"] + m["by_keep"]
    for r in rows:
        assert r["runs"] == len(r["decode_ms_repeats"]) >= m["repeats"]
        assert r["decode_ms_run_min"] <= r["decode_ms_run_median"] <= r["decode_ms_run_max"]
        assert r["decode_ms_run_median"] == pytest.approx(statistics.median(r["decode_ms_repeats"]))
    for r in m["step_latency"]:              # section 4: REPEATS runs (a prefill, then STEPS steps) per point
        assert r["runs"] == len(r["step_ms_repeats"]) == m["repeats"]
        assert r["step_ms_run_min"] <= r["step_ms_run_median"] <= r["step_ms_run_max"]
    for v in m["verdicts"]:
        a, b = mech[v["row"]], mech[v["against"]]
        apart = a["decode_ms_run_max"] < b["decode_ms_run_min"] or b["decode_ms_run_max"] < a["decode_ms_run_min"]
        assert v["verdict"] == ("within noise" if not apart else "faster" if a["decode_ms_run_median"] <
                                b["decode_ms_run_median"] else "slower"), v
    assert any(v["what"].startswith("compression") for v in m["verdicts"])


def test_dispatch_counts_agree_with_notebook_02(executed_notebook):
    """ONE definition of a dispatch: notebook 02 and notebook 03 report the same count for the same configuration
    (same model, factors and runner; CI: tiny-smol, keep 0.5, fp32)."""
    m3, m2 = executed_notebook("03_graph_replay_ablation"), executed_notebook("02_launch_count_profiling")
    assert (m3["model"], m3["keep"], m3["dtype"]) == (m2["model"], m2["keep"], m2["dtype"])
    shared = set(m3["dispatch_by_system"]) & set(m2["per_token"])
    assert shared >= {"naive", "dense_kv", "engine", "hf_static", "hf_dynamic", "dense_hf_static", "dense_engine"}
    for s in shared:
        assert m3["dispatch_by_system"][s] == m2["per_token"][s], s
