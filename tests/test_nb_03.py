"""Notebook 03: mechanism ablation table and latency sweeps (CI: tiny model, few points)."""
import math

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
        lat = sorted((r["cached_len"], r["step_ms"]) for r in m["step_latency"] if r["system"] == s)
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
    else:
        assert "not installed" in peer["why_not"]
    assert len(m["figures"]) == 3 + peer["ran"]
