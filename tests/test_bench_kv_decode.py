"""``python -m lowrank_lib.bench kv-decode --quick``: every system its own engine on the same context, the rows the
issue asks for (step mode, attention kernel and why, ms/token and attention ms against dense, bytes held)."""
from __future__ import annotations

import json

import torch

from lowrank_lib.bench.cli import COMMANDS, main
from lowrank_lib.kv.tiers import lrk_tiers_unavailable


def test_quick_run_writes_every_system_row(tmp_path):
    assert "kv-decode" in COMMANDS
    assert main(["kv-decode", "--quick", "--methods", "composed-kvzip-q8", "attsvd", "--budget", "0.5",
                 "--graph", "none", "--out", str(tmp_path), "--threads", "1"]) == 0
    res = json.loads((tmp_path / "kv_decode.json").read_text())
    rows = res["rows"]
    assert {(r["system"], r["budget"], r["context"]) for r in rows} == {
        (s, b, c) for c in (96, 192) for s, b in (("dense", None), ("composed-kvzip-q8", 0.5), ("attsvd", 0.5))}
    for r in rows:
        assert r["graph"] == "none" and r["threads"] == 1 and r["attention_kernel"] and r["attention_reason"]
        assert r["dtype"] == "float32"                  # no --dtype: the model's own
        assert r["decode_ms_per_token"] > 0 and r["attn_ms_per_token"] > 0 and r["attn_cold_ms_per_token"] > 0
        assert r["system"] != "dense" or r["attn_cold_ratio_vs_dense"] == 1.0
        assert r["decode_iqr_ms"][0] <= r["decode_ms_per_token"] <= r["decode_iqr_ms"][1]
        if r["system"] == "dense":
            assert r["ratio_vs_dense"] == 1.0 and r["bytes_ratio"] == 1.0
        else:
            assert 0 < r["bytes_ratio"] <= 0.5 * 1.05 or r["system"] == "attsvd"   # AttSVD keeps its window exact
            # attention "auto": the fused tier kernel wherever it can run (the row says which ran)
            fused = lrk_tiers_unavailable(torch.device("cpu"), 64, torch.float32) is None
            assert r["attention_kernel"] == ("lrk_tiers" if fused else "portable"), r
        # one fused op per layer for the dense store and for a method that appends exact rows (AttSVD folds its
        # tokens in: per-op, and says why)
        fused = lrk_tiers_unavailable(torch.device("cpu"), 64, torch.float32) is None
        assert r["fused_layer"] == ("lrk_decode_layer" if fused and r["system"] != "attsvd" else "per-op"), r
        assert r["system"] != "attsvd" or "appends tokens its own way" in r["fused_layer_reason"], r
    assert res["config"]["graph"] == "none" and res["copy_gbs"] > 0 and res["machine"]["cpu"] and (tmp_path / "kv_decode.txt").exists()
    # the kernel features the engines ran with, and the $LOWRANK_LIB_ISA limit when one is set
    import os

    from lowrank_lib.runtime.kernels import build
    flags, limit = build.status().get("isa"), os.environ.get("LOWRANK_LIB_ISA")
    assert res["kernel_isa"] == {**({"limit": limit} if limit else {}), **({"flags": flags} if flags is not None else {})}


def test_quick_run_in_bf16_runs_every_engine_in_bf16(tmp_path):
    """``--dtype bf16``: the dense store and the composed cache both run bf16 (what ``bench peer`` measures), and
    each row and the config say so; the default is the model's own dtype (fp32 here)."""
    assert main(["kv-decode", "--quick", "--methods", "composed-kvzip-q8", "--budget", "0.5", "--dtype", "bf16",
                 "--out", str(tmp_path), "--threads", "1"]) == 0
    res = json.loads((tmp_path / "kv_decode.json").read_text())
    assert res["config"]["dtype"] == "bf16"
    assert {r["system"] for r in res["rows"]} == {"dense", "composed-kvzip-q8"}
    assert all(r["dtype"] == "bfloat16" and r["decode_ms_per_token"] > 0 for r in res["rows"])
    dense = [r for r in res["rows"] if r["system"] == "dense"]
    assert all(r["kv_bytes_held"] > 0 for r in dense)
