"""The GPU checks' CPU-side logic: each dry run exercises the whole pipeline of its command on the CPU."""
import json

from lowrank_lib.bench.cli import main
from lowrank_lib.bench.gpu import verdicts


def test_gpu_checks_dry_run_pipeline(tmp_path):
    assert main(["gpu-checks", "--dry-run", "--out", str(tmp_path), "--repeats", "1"]) == 0
    rep = json.loads((tmp_path / "gpu_checks_dry-run.json").read_text())
    assert all(r.get("tokens_equal") and r["max_logit_err"] < 1e-4 for r in rep["correctness"])
    assert [r["config"]["prompt_len"] for r in rep["speed"]] == [32, 64]
    assert "dense_hf_static" in rep["speed"][0]["systems"] and "dense_hf_static" not in rep["speed"][1]["systems"]
    assert rep["command"] == f"python -m lowrank_lib.bench gpu-checks --dry-run --out {tmp_path} --repeats 1"
    assert "## Targets" in (tmp_path / "gpu_checks_dry-run.md").read_text()


def test_gpu_factor_space_dry_run_pipeline(tmp_path):
    assert main(["gpu-factor-space", "--dry-run", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "factor_space_gpu_dry-run.json").read_text())
    assert all(c["ok"] for c in res["correctness"].values()) and res["ok"]
    eg = res["engine_graphs"]
    assert set(eg) == {"none", "whole-step"} and all(eg["whole-step"]["tokens_equal_eager"])
    assert max(eg["whole-step"]["logit_rel_err"]) < 1e-5
    # bulks 284 and 294 share a bucket: the second prompt reuses the capture, the third re-captures
    cap = eg["whole-step"]["capture_s"]
    assert cap[0] > 0 and cap[1] == 0.0 and cap[2] > 0
    ratios = res["runs"]["gqa_small_eager"]["ratios"]
    assert {(r["context"], r["rank"]) for r in ratios} == {(256, 64), (256, 32), (512, 64), (512, 32)}


def test_verdicts_logic():
    row = lambda ms, n: {"decode_ms_per_token": ms, "per_token_count": n}
    res = [{"config": {"prompt_len": 512, "gen_len": 32},
            "systems": {"hf_static": row(30.0, 1100), "engine": row(20.0, 300), "engine_layer": row(9.0, 40),
                        "engine_step": row(11.0, 6)}},
           {"config": {"prompt_len": 2048, "gen_len": 128}, "error": "boom"}]
    v = {(x["target"].split()[0], x["system"]): x for x in verdicts(res, 32)}
    sp = v[("engine", "engine_layer")]
    assert abs(sp["value"] - 30 / 9) < 1e-9 and sp["met"]
    assert v[("engine_layer", "engine_layer")]["met"] and not v[("engine_step", "engine_step")]["met"]
    assert len(v) == 3
