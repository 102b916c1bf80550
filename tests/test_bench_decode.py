"""The decode benchmark CLI and its pieces (tiny model; no speed assertions)."""
import json

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.bench.cli import main
from lowrank_lib.bench.decode import copy_bandwidth, model_weight_bytes_per_token
from lowrank_lib.bench.models import random_lowrank
from lowrank_lib.compress import compress_svd
from lowrank_lib.factorized import LowRankLinear
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.profiling import DispatchCounter, op_class


def test_cli_writes_json_and_table(tmp_path, capsys):
    argv = ["decode", "--model", "tiny-gqa", "--prompt-len", "16", "--gen-len", "4", "--repeats", "1",
            "--systems", "hf_static,engine,naive", "--out-dir", str(tmp_path), "--threads", "1"]
    assert main(argv) == 0
    assert main(argv) == 0                                  # second run: a new file, never overwritten
    files = sorted(tmp_path.glob("decode_tiny-gqa_svd_k0.5_fp32_p16_g4_b1*.json"))
    assert len(files) == 2
    res = json.loads(files[0].read_text())
    out = capsys.readouterr().out
    assert "decode ms/tok" in out and "hf_static" in out
    rows = res["systems"]
    assert set(rows) == {"hf_static", "engine", "naive"} and res["copy_bandwidth_GBps"] > 0
    for r in rows.values():
        assert r["decode_ms_per_token"] > 0 and r["per_token_count"] > 0 and "tokens_match_hf_dynamic" not in r
        assert r["achieved_GBps"] == pytest.approx(r["weight_bytes_per_token"] / r["decode_ms_per_token"] / 1e6)
    assert rows["hf_static"]["decode_speedup_vs_hf_static"] == 1.0
    assert rows["engine"]["per_token_count"] < rows["naive"]["per_token_count"] < rows["hf_static"]["per_token_count"]
    with pytest.raises(SystemExit):
        main(["decode", "--systems", "nope"])


def test_weight_bytes_agree_between_engine_and_model():
    model = compress_svd(models.tiny_model("tiny-mha", seed=0), 0.5)
    unfolded = Engine(model, EngineConfig(max_seq_len=8, fold_rope=False, fold_norm=False))
    assert unfolded.weight_bytes_per_token() == model_weight_bytes_per_token(model)
    # RoPE folding stores [U; P U] for q and k: exactly their U bytes more
    extra = sum(L.self_attn.q_proj.U.numel() + L.self_attn.k_proj.U.numel() for L in model.model.layers) * 4
    assert Engine(model, EngineConfig(max_seq_len=8)).weight_bytes_per_token() == unfolded.weight_bytes_per_token() + extra


def test_random_lowrank_shapes_and_bandwidth():
    from lowrank_lib.ranks import keep_rank

    m = random_lowrank(models.tiny_model("tiny-gqa"), 0.5)
    q = m.model.layers[0].self_attn.q_proj
    assert isinstance(q, LowRankLinear) and q.rank == keep_rank(64, 64, 0.5)
    assert copy_bandwidth(torch.device("cpu"), nbytes=1 << 22, repeats=2) > 0


def test_op_classes_and_counter():
    assert op_class("aten.mm.default") == "gemm" and op_class("aten.view.default") == "view"
    assert op_class("aten._scaled_dot_product_flash_attention_for_cpu.default") == "attention"
    assert op_class("aten.index_copy_.default") == "copy/index" and op_class("aten.silu.default") == "elementwise"
    a = torch.ones(2, 2)
    with DispatchCounter() as c:
        torch.mm(a, a).relu()
    assert c.counts == {"aten.mm.default": 1, "aten.relu.default": 1} and c.by_class() == {"gemm": 1, "elementwise": 1}


def test_layout_bench_counts_every_operand(tmp_path, capsys):
    from lowrank_lib.bench.layout import engine_operand_shapes

    model = compress_svd(models.tiny_model("tiny-gqa", seed=0), 0.5)
    eng = Engine(model, EngineConfig(max_seq_len=8, weight_layout="out_major"))
    shapes = engine_operand_shapes(eng)
    L = model.config.num_hidden_layers
    # per layer: packed qkv S + 3 U, o V + U, packed gate/up S + 2 U, down V + U; plus lm_head
    assert sum(shapes.values()) == 11 * L + 1
    assert shapes[(model.config.vocab_size, model.config.hidden_size)] == 1
    assert main(["layout", "--model", "tiny-gqa", "--working-set-mb", "2", "--repeats", "1",
                 "--out-dir", str(tmp_path)]) == 0
    res = json.loads(next(tmp_path.glob("layout_*.json")).read_text())
    assert {r["auto"] for r in res["rows"]} <= {"out_major", "in_major"}
    assert all(r["GBps"]["out_major"] > 0 and r["GBps"]["in_major"] > 0 for r in res["rows"])
    assert res["ms_per_token"]["best"] <= min(res["ms_per_token"]["out_major"], res["ms_per_token"]["in_major"])
    assert "fastest" in capsys.readouterr().out
