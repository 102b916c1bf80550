"""Notebook 05 (AttSVD quality vs memory) runs headless; its metrics hold the paper's qualitative claims."""
import pytest


@pytest.mark.notebook
@pytest.mark.smollm2
def test_nb_05_quality_memory(executed_notebook):
    m = executed_notebook("05_attsvd_quality_memory")
    assert len(m["figures"]) == 4
    # the frontier figure plots the committed kv-frontier run: every budget has its eviction-vs-ours summary
    fr = m["frontier"]
    assert fr["prefills"] and set(fr["windows"]) == {str(P) for P in fr["prefills"]}
    assert min(fr["windows"].values()) >= 1
    for P in fr["prefills"]:
        assert {b["budget"] for b in fr["best"] if b["prefill"] == P} == {0.5, 0.375, 0.25, 0.125}, P
    kl = m["kl"]
    # full rank reproduces the dense cache; raw-K/V SVD is clearly worse than attention-aware at 50 %
    assert abs(kl["attsvd@1"]) < 1e-4 and abs(kl["svd@1"]) < 1e-4
    assert kl["svd@0.5"] > 2 * kl["attsvd@0.5"]
    assert kl["attsvd@0.25"] > kl["attsvd@0.5"]
    # eviction budgets are matched to AttSVD's stored bytes
    mem = m["memory_ratio"]
    for p in ("streamingllm", "h2o", "snapkv", "keydiff", "svd"):
        assert abs(mem[f"{p}@0.5"] - mem["attsvd@0.5"]) < 0.02
    # the energy rule gives keys fewer directions than values (r_K << r_V)
    for v in m["energy_rule"].values():
        assert v["mean_rank_k"] < v["mean_rank_v"]
    # the streaming schedule stays close to the accumulating one
    assert all(abs(d) < 0.5 * kl["attsvd@0.5"] + 1e-3 for d in m["stream_minus_accum_kl"].values())
    assert m["targets_50pct"]["ppl_gap_pct"] < 5.0
