"""Notebook 07 (low rank vs quantization) runs headless from the committed frontier JSON; its conclusion is the data's."""
import json

import pytest

from lowrank_lib.eval import frontier as fr
from lowrank_lib.notebooks import root


@pytest.mark.notebook
def test_nb_07_frontier_from_the_committed_result(executed_notebook):
    m = executed_notebook("07_lowrank_vs_quantization")
    res = json.loads((root() / "benchmarks/results/frontier_smollm2.json").read_text())
    assert m["live"] is False and [p["id"] for p in m["points"]] == [p["id"] for p in res["points"]]
    # the notebook's frontier and conclusion are the library's on the file's points (nothing typed by hand)
    assert m["frontier_bytes"] == fr.pareto(res["points"])
    assert m["conclusion"] == fr.conclusion(res["points"])
    ours = {p["id"] for p in res["points"] if p["system"] == "lowrank_lib" and p["method"] != "dense"}
    assert set(m["lowrank_on_frontier"]) | set(m["lowrank_dominated"]) == ours
    assert any(f.endswith("07_frontier_bytes.png") for f in m["figures"])
    # llama.cpp's points and the caveat are in the committed run
    assert {"llama.cpp:f32", "llama.cpp:q4_k_m"} <= {p["id"] for p in res["points"]}
    assert {c["geometry"] for c in m["caveat"]} == {"smollm2_like", "kquant"}
    assert all(c["ratio_off_over_on"] > 1 for c in m["caveat"])
    # speed is judged within a sitting: each point against the reference timed in its own sitting, never on
    # milliseconds from two sittings of a drifting machine
    spts = fr.with_speed_ratios(res)
    assert m["sittings"] == res["sittings"] and len(res["sittings"]) >= 2
    assert m["frontier_speed"] == {t: fr.pareto(spts, x=f"speed_ratio.{t}") for t in ("1", "2")}
    assert all(p["speed_ratio"].keys() == p["speed"].keys() for p in spts if p.get("speed"))
