"""The GPU session's CPU-side logic: the dry run exercises every stage of the device call on the CPU."""
import json

from lowrank_lib.bench.cli import main
from lowrank_lib.bench.gpu import SESSION_STAGES, verdicts


def test_gpu_session_dry_run_runs_every_stage(tmp_path):
    assert main(["gpu-session", "--dry-run", "--out", str(tmp_path), "--repeats", "1", "--budget-s", "100000"]) == 0
    rep = json.loads((tmp_path / "gpu_checks_dry-run.json").read_text())
    fs = json.loads((tmp_path / "factor_space_gpu_dry-run.json").read_text())
    stages = {**rep["stages"], **fs["stages"]}
    assert set(stages) == {s for s, _ in SESSION_STAGES} - {"factor_gqa"}          # the dry run has one geometry
    assert all(v.startswith("done") for v in stages.values()), stages
    assert all(r.get("tokens_equal") and r["max_logit_err"] < 1e-4 for r in rep["correctness"])
    assert [r["config"]["prompt_len"] for r in rep["speed"]] == [32, 64]
    assert "dense_hf_static" in rep["speed"][0]["systems"] and "dense_hf_static" not in rep["speed"][1]["systems"]
    assert rep["command"] == fs["command"] == (f"python -m lowrank_lib.bench gpu-session --dry-run --out {tmp_path} "
                                               f"--repeats 1 --budget-s 100000")
    assert "## Targets" in (tmp_path / "gpu_checks_dry-run.md").read_text()
    assert all(c["ok"] for c in fs["correctness"].values()) and fs["ok"]
    eg = fs["engine_graphs"]
    assert set(eg) == {"none", "whole-step"} and all(eg["whole-step"]["tokens_equal_eager"])
    assert max(eg["whole-step"]["logit_rel_err"]) < 1e-5
    # prompts 290 and 300 round to the same bucketed layout under a backend that reads the layout from device
    # tensors (the fused kernel, AVX-512 or AVX2): the second reuses the capture, the third (400) re-captures; a
    # host-slicing backend (the portable path) captures for each layout
    ws = eg["whole-step"]
    from lowrank_lib.kv.tiers import reads_device_layout
    assert ws["tier_backend"] is not None and ws["device_layout"] == reads_device_layout(ws["tier_backend"])
    cap = ws["capture_s"]
    assert cap[0] > 0 and cap[2] > 0 and (cap[1] == 0.0) == ws["device_layout"], ws
    ratios = fs["runs"]["gqa_small_eager"]["ratios"]
    assert {(r["context"], r["rank"]) for r in ratios} == {(256, 64), (256, 32), (512, 64), (512, 32)}


def test_gpu_session_skips_what_no_longer_fits_the_budget(tmp_path):
    """A stage whose estimated need exceeds what is left is recorded as skipped (the device call returns
    in time); a subset of stages can be rerun by name."""
    assert main(["gpu-session", "--dry-run", "--out", str(tmp_path), "--budget-s", "45",
                 "--stages", "correctness", "factor_correctness"]) == 1        # nothing verified: not ok
    rep = json.loads((tmp_path / "gpu_checks_dry-run.json").read_text())
    fs = json.loads((tmp_path / "factor_space_gpu_dry-run.json").read_text())
    assert rep["stages"]["correctness"].startswith("skipped: ") and "needs ~60 s" in rep["stages"]["correctness"]
    assert fs["stages"]["factor_correctness"].startswith("done")               # needs ~30 s: it fits
    assert set(rep["stages"]) | set(fs["stages"]) == {"correctness", "factor_correctness"}


GPU_IMAGE = """
import sys
# what the GPU machine's image lacks (its package list: /work/.library/device/KINDS.md): the session must
# not need any of them
for m in ("gguf", "llama_cpp", "ipywidgets", "papermill", "jupyterlab", "playwright", "ray", "flash_attn"):
    sys.modules[m] = None
from lowrank_lib.bench.cli import main
sys.exit(main(["gpu-session", "--dry-run", "--out", sys.argv[1], "--stages", "correctness", "--budget-s", "1000"]))
"""


def test_gpu_session_needs_only_what_the_gpu_image_has(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", GPU_IMAGE, str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 1, r.stderr[-2000:]           # 1: only correctness ran, the session is not all verified
    rep = json.loads((tmp_path / "gpu_checks_dry-run.json").read_text())
    assert rep["stages"]["correctness"].startswith("done") and all(c["tokens_equal"] for c in rep["correctness"])


def test_verdicts_logic():
    row = lambda ms, n, rx=1.5: {"decode_ms_per_token": ms, "per_token_count": n, "roofline_x": rx}
    res = [{"config": {"prompt_len": 512, "gen_len": 32},
            "systems": {"hf_static": row(30.0, 1100), "engine": row(20.0, 300), "engine_layer": row(9.0, 40, 2.4),
                        "engine_step": row(11.0, 6), "dense_hf_compiled": row(10.0, 8)}},
           {"config": {"prompt_len": 2048, "gen_len": 128}, "error": "boom"}]
    v = {x["target"]: x for x in verdicts(res, 32)}
    sp = v["engine decode >= 3x hf_static"]
    assert sp["system"] == "engine_layer" and abs(sp["value"] - 30 / 9) < 1e-9 and sp["met"]
    gf = v["engine faster than the compiled dense baseline (gpt-fast style)"]
    assert abs(gf["value"] - 10 / 9) < 1e-9 and gf["met"]
    rf = v["engine within 2x of the weight-bytes roofline"]
    assert rf["value"] == 2.4 and not rf["met"]                       # the best system's own roofline ratio
    assert v["engine_layer launches/token <= 42"]["met"] and not v["engine_step launches/token <= 5"]["met"]
    assert len(v) == 5                                                # the errored setting gives no verdict


def test_gpu_session_isolates_each_stage_in_a_child(tmp_path):
    """On the GPU every stage runs in a child process of its own (a CUDA fault poisons its process): the
    stage's results come back through bench.child and are filed where the in-process run files them."""
    from lowrank_lib.bench.gpu import gpu_session

    res = gpu_session(tmp_path, 1000, dry_run=True, repeats=1, progress=False, isolate=True,
                      stages=("factor_correctness", "factor_llama7b"))
    fs = res["factor_space"]
    assert all(v.startswith("done") for v in fs["stages"].values()) and set(fs["stages"]) == {
        "factor_correctness", "factor_llama7b"}
    assert all(c["ok"] for c in fs["correctness"].values()) and "gqa_small_eager" in fs["runs"]
    assert "## gqa_small_eager" in (tmp_path / "factor_space_gpu_dry-run.md").read_text()
