"""The GPU check script's CPU-side logic: the dry run exercises the whole pipeline on a tiny model."""
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("gpu_checks", ROOT / "benchmarks" / "gpu_checks.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_dry_run_pipeline(tmp_path):
    gc = _load()
    assert gc.main(["--dry-run", "--out", str(tmp_path), "--repeats", "1"]) == 0
    rep = json.loads((tmp_path / "gpu_checks.json").read_text())
    assert all(r.get("tokens_equal") and r["max_logit_err"] < 1e-4 for r in rep["correctness"])
    assert [r["config"]["prompt_len"] for r in rep["speed"]] == [32, 64]
    assert "dense_hf_static" in rep["speed"][0]["systems"] and "dense_hf_static" not in rep["speed"][1]["systems"]
    assert "## Targets" in (tmp_path / "gpu_checks.md").read_text()


def test_verdicts_logic():
    gc = _load()
    row = lambda ms, n: {"decode_ms_per_token": ms, "per_token_count": n}
    res = [{"config": {"prompt_len": 512, "gen_len": 32},
            "systems": {"hf_static": row(30.0, 1100), "engine": row(20.0, 300), "engine_layer": row(9.0, 40),
                        "engine_step": row(11.0, 6)}},
           {"config": {"prompt_len": 2048, "gen_len": 128}, "error": "boom"}]
    v = {(x["target"].split()[0], x["system"]): x for x in gc.verdicts(res, 32)}
    sp = v[("engine", "engine_layer")]
    assert abs(sp["value"] - 30 / 9) < 1e-9 and sp["met"]
    assert v[("engine_layer", "engine_layer")]["met"] and not v[("engine_step", "engine_step")]["met"]
    assert len(v) == 3
