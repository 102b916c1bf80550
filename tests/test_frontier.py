"""The Pareto frontier of lowrank_lib.eval.frontier: who is on it, who misses it and by how much (issue 31)."""
from __future__ import annotations

import math

import pytest

from lowrank_lib.eval import frontier as fr


def P(i, b, ppl, system="lowrank_lib", method="svdllm", ms=None, **kw):
    p = {"id": i, "system": system, "method": method, "keep": 0.8, "weights": "bf16", "ppl": ppl,
         "weight_bytes_per_token": b, **kw}
    if ms is not None:
        p["speed"] = {"1": {"ms_per_token": ms}}
    return p


def test_a_dominated_point_is_marked_dominated():
    pts = [P("q4", 100, 20.0, "llama.cpp", "Q4_K_M"), P("lr", 200, 50.0), P("bf16", 270, 19.0, "llama.cpp", "BF16")]
    assert fr.pareto(pts) == ["q4", "bf16"]
    rows = {r["id"]: r for r in fr.misses(pts)}
    assert not rows["lr"]["on_frontier"] and rows["q4"]["on_frontier"] and rows["bf16"]["on_frontier"]
    # the extra perplexity at equal or fewer bytes: the best frontier point with <= 200 bytes is q4 (20.0)
    assert rows["lr"]["extra_y"] == pytest.approx(30.0) and rows["lr"]["extra_y_rel"] == pytest.approx(1.5)
    # the extra bytes at equal or better perplexity: q4 (100 bytes, 20 <= 50)
    assert rows["lr"]["extra_x"] == pytest.approx(2.0)
    assert rows["q4"]["extra_y"] == 0 and rows["q4"]["extra_x"] == 1


def test_dominated_in_one_coordinate_only_when_equal_in_the_other():
    pts = [P("a", 100, 20.0), P("b", 100, 21.0), P("c", 90, 21.0)]
    assert fr.pareto(pts) == ["c", "a"]
    rows = {r["id"]: r for r in fr.misses(pts)}
    assert rows["b"]["extra_y"] == pytest.approx(1.0) and rows["b"]["extra_x"] == pytest.approx(100 / 90)


def test_ties_are_all_on_the_frontier():
    pts = [P("a", 100, 20.0), P("b", 100, 20.0), P("c", 300, 30.0)]
    assert fr.pareto(pts) == ["a", "b"]
    assert [r["on_frontier"] for r in fr.misses(pts)] == [True, True, False]


def test_a_single_point_is_the_frontier():
    assert fr.pareto([P("a", 1, 2.0)]) == ["a"]
    (r,) = fr.misses([P("a", 1, 2.0)])
    assert r["on_frontier"] and r["extra_y"] == 0 and r["extra_x"] == 1
    assert fr.pareto([]) == [] and fr.misses([]) == []


def test_missing_or_nan_values_are_not_judged():
    pts = [P("fast", 100, 20.0, ms=5.0), P("nan", 50, float("nan"), ms=1.0), P("unmeasured", 60, 10.0),
           P("slow", 90, 25.0, ms=9.0), P("inf", 10, 1.0, ms=math.inf)]
    # quality vs speed: only points with a finite ms/token and ppl; "fast" dominates "slow"
    assert fr.pareto(pts, x="speed.1.ms_per_token") == ["fast"]
    assert [r["id"] for r in fr.misses(pts, x="speed.1.ms_per_token")] == ["fast", "slow"]
    # quality vs bytes: the NaN perplexity is left out, "unmeasured" (no speed) is judged here
    assert fr.pareto(pts) == ["inf"]
    assert "nan" not in {r["id"] for r in fr.misses(pts)}


def test_a_point_better_than_every_frontier_point_at_fewer_bytes_has_no_extra_y():
    pts = [P("small", 10, 50.0), P("big", 100, 10.0), P("mid", 5, 60.0)]
    rows = {r["id"]: r for r in fr.misses(pts)}
    assert all(r["on_frontier"] for r in rows.values())
    pts.append(P("worse_smallest", 4, 70.0))
    pts.append(P("dominated_first", 6, 61.0))
    rows = {r["id"]: r for r in fr.misses(pts)}
    assert rows["dominated_first"]["extra_y"] == pytest.approx(1.0)        # against mid (5 bytes, 60)


def test_table_and_conclusion_come_from_the_points():
    pts = [P("llama.cpp:q4_k_m", 100e6, 20.0, "llama.cpp", "Q4_K_M"), P("lowrank_lib:svdllm@0.8:bf16", 200e6, 50.0),
           P("lowrank_lib:dense:bf16", 270e6, 19.0, method="dense")]
    t = fr.format_table(pts)
    assert "| SVD-LLM v1 keep 0.8 bf16 | 50.00 | 200.0 | no | +30.00 (+150.0 %); 2.00x |" in t
    assert "| llama.cpp Q4_K_M | 20.00 | 100.0 | **yes** |  |" in t
    assert "vs F32" not in t and "ms/token" not in t                  # no F32 point; no sittings given
    f32 = P("llama.cpp:f32", 400e6, 18.0, "llama.cpp", "F32")
    assert "| llama.cpp Q4_K_M | 20.00 | +11.1 % | 100.0 | **yes** |  |" in fr.format_table([*pts, f32])
    c = fr.conclusion(pts)
    assert c.startswith("1 of 1 low-rank points are dominated: none is on the frontier.")
    assert "+150.0 %" in c and "llama.cpp Q4_K_M" in c
    pts[1]["weight_bytes_per_token"] = 50e6                  # now the smallest: on the frontier
    assert "on the frontier: SVD-LLM v1 keep 0.8 bf16" in fr.conclusion(pts)


def test_weight_bytes_per_token_counts_a_tied_head_once_and_an_untied_embedding_not():
    from lowrank_lib import models
    from lowrank_lib.factorized import account

    tied = models.tiny_model("tiny-gqa")
    assert fr.weight_bytes_per_token(tied) == account(tied).total_bytes
    untied = models.tiny_model("tiny-mha")
    emb = untied.get_input_embeddings().weight
    assert fr.weight_bytes_per_token(untied) == account(untied).total_bytes - emb.numel() * 4


def test_plot_draws_every_point_and_the_frontier():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    pts = [P("llama.cpp:q4_k_m", 100e6, 20.0, "llama.cpp", "Q4_K_M", ms=10.0),
           P("lowrank_lib:svdllm@0.8:bf16", 200e6, 50.0, ms=12.0),
           P("lowrank_lib:svdllm@0.6:bf16", 150e6, 130.0)]
    fig = fr.plot(pts, panels=(("weight_bytes_per_token", "MB", 1e-6), ("speed.1.ms_per_token", "ms", 1.0)))
    ax_b, ax_s = fig.axes
    n_points = sum(len(line.get_xdata()) for line in ax_b.lines if line.get_label() != "Pareto frontier")
    assert n_points == 3
    assert sum(len(line.get_xdata()) for line in ax_s.lines if line.get_label() != "Pareto frontier") == 2
    (front,) = [line for line in ax_b.lines if line.get_label() == "Pareto frontier"]
    assert list(front.get_xdata()) == [100.0]


def test_every_series_of_the_committed_frontier_has_its_own_colour():
    """Two storages of one kind share a marker (int8 of SVD-LLM v1 and of ASVD: both triangles), so the colour is
    what tells their series apart: no two may share one."""
    pytest.importorskip("matplotlib")
    import json

    import matplotlib
    from matplotlib.colors import to_hex

    from lowrank_lib.notebooks import root

    matplotlib.use("Agg")
    res = json.loads((root() / "benchmarks/results/frontier_smollm2.json").read_text())
    fig = fr.plot(res["points"])
    lines = [ln for ln in fig.axes[0].lines if ln.get_label() != "Pareto frontier"]
    assert len(lines) >= 30
    colours = [to_hex(ln.get_color()) for ln in lines]
    assert len(set(colours)) == len(colours)


def test_merge_keeps_its_own_points_and_adds_the_others():
    from lowrank_lib.eval.frontier import merge_runs as merge

    a = {"points": [P("x", 1, 2.0)], "cross_check": {"protocol": "p", "points": {"f32": {"ppl": 1.0}}},
         "commands": ["a"]}
    b = {"points": [P("x", 1, 3.0), P("y", 2, 1.0)], "caveat": [{"geometry": "g"}], "commands": ["b", "a"],
         "cross_check": {"protocol": "p", "points": {"f32": {"ppl": 9.0}, "q8_0": {"ppl": 2.0}}}}
    merge(a, b)
    assert [(p["id"], p["ppl"]) for p in a["points"]] == [("x", 2.0), ("y", 1.0)]
    assert a["cross_check"]["points"] == {"f32": {"ppl": 1.0}, "q8_0": {"ppl": 2.0}}
    assert a["caveat"] == [{"geometry": "g"}] and a["commands"] == ["a", "b"]


def test_speed_is_judged_against_the_reference_of_its_own_sitting():
    """Two sittings on a drifting machine: a point's ms/token is compared with the reference's in ITS sitting."""
    q4 = P("llama.cpp:q4_k_m", 100e6, 20.0, "llama.cpp", "Q4_K_M")
    a, b, c = (P(i, mb * 1e6, ppl, label=i) for i, mb, ppl in (("a", 200, 65.0), ("b", 150, 60.0), ("c", 120, 70.0)))
    res = {"points": [q4, a, b, c]}
    s1 = fr.open_sitting(res, "first", when="t1")
    assert s1["id"] == 1 and s1["reference"] == "llama.cpp:q4_k_m" and s1["when"] == "t1"
    fr.record_speed(s1, q4, {"1": {"ms_per_token": 10.0}}, 1, 1.0)
    fr.record_speed(s1, a, {"1": {"ms_per_token": 5.0}}, 1, 1.0)
    s2 = fr.open_sitting(res, "second", when="t2", threads=[1])        # a slower hour: the reference takes 20 ms
    assert s2["id"] == 2 and s2["threads"] == [1]
    fr.record_speed(s2, q4, {"1": {"ms_per_token": 20.0}}, 1, 1.0, own=False)
    fr.record_speed(s2, b, {"1": {"ms_per_token": 8.0}}, 1, 1.0)
    # the reference's own row stays the first sitting's; the second holds its time as that sitting's reference
    assert q4["sitting"] == 1 and q4["speed"]["1"]["ms_per_token"] == 10.0
    assert s2["reference_speed"]["1"]["ms_per_token"] == 20.0 and s2["points"] == ["b"]
    assert s1["points"] == ["llama.cpp:q4_k_m", "a"]
    # b (8 ms) is faster than a (5 ms) relative to its own sitting: 0.4 against 0.5, so b dominates a
    assert fr.speed_ratio(res, a, "1") == pytest.approx(0.5) and fr.speed_ratio(res, b, "1") == pytest.approx(0.4)
    assert fr.speed_ratio(res, c, "1") is None and fr.speed_ratio(res, a, "2") is None      # untimed
    pts = fr.with_speed_ratios(res)
    assert [p["speed_ratio"] for p in pts] == [{"1": 1.0}, {"1": 0.5}, {"1": 0.4}, {}]
    assert "speed_ratio" not in a                                       # copies, not the points
    assert fr.pareto(pts, x="speed_ratio.1") == ["b", "llama.cpp:q4_k_m"]
    # in raw ms b would be slower than a: the table prints both, and each ratio and sitting
    t = fr.format_table(res["points"], sittings=res["sittings"])
    assert "| b | 60.00 | 150.0 | no |" in t and "| 8.00 (0.40x) | 2 |" in t and "| 5.00 (0.50x) | 1 |" in t
    row_c = next(r for r in t.splitlines() if r.startswith("| c |"))
    assert row_c.endswith(" |  |  |")                                  # untimed: empty speed and sitting cells
    assert "x llama.cpp Q4_K_M's in its sitting" in t
    # a sitting with no reference point in the result: no ratio
    res2 = {"points": [P("x", 1, 1.0, ms=3.0)]}
    s = fr.open_sitting(res2, "c")
    fr.record_speed(s, res2["points"][0], {"1": {"ms_per_token": 3.0}}, 1, 1.0)
    assert s["reference"] is None and fr.speed_ratio(res2, res2["points"][0], "1") is None
