"""Notebook 03: mechanism ablation table and latency sweeps (CI: tiny model, few points)."""
import math

import pytest

pytestmark = pytest.mark.notebook


def test_graph_replay_ablation_notebook(executed_notebook):
    m = executed_notebook("03_graph_replay_ablation")
    from lowrank_lib.bench.ablation import MECHANISMS

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
    for rows, n in ((m["by_prompt"], 4 * 2), (m["by_gen"], 4 * 2), (m["step_latency"], 4 * 2)):
        assert len(rows) == n
    assert len(m["by_keep"]) == 2 * 2
    assert all(r["decode_ms"] > 0 and math.isfinite(r["decode_ms"]) for r in m["by_prompt"] + m["by_keep"])
    assert m["growth_naive"] > 0 and m["growth_engine"] > 0
    assert len(m["figures"]) == 3
