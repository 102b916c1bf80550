"""The benchmark CLI, its result writer, and the decode / layout benchmarks' arithmetic (tiny model).

No speed assertions: every timing-derived number is checked against the raw times it came from, and
the bandwidth formulas against a clock that ticks a known amount."""
import json
import statistics

import pytest
import torch

from lowrank_lib import models
from lowrank_lib import timing
from lowrank_lib.bench.cli import COMMANDS, main, parser
from lowrank_lib.runtime.decode_bench import model_weight_bytes_per_token
from lowrank_lib.host import copy_bandwidth
from lowrank_lib.models import random_lowrank
from lowrank_lib.bench.results import ResultFiles, slug, write_result
from lowrank_lib.compress import compress_svd
from lowrank_lib.factorized import LowRankLinear
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.packing import pick_layout
from lowrank_lib.runtime.profiling import DispatchCounter, op_class


def test_cli_writes_json_and_table(tmp_path, capsys):
    argv = ["decode", "--model", "tiny-gqa", "--prompt-len", "16", "--gen-len", "4", "--repeats", "1",
            "--systems", "hf_static", "engine", "naive", "--out", str(tmp_path), "--threads", "1"]
    assert main(argv) == 0
    assert main(argv) == 0                                  # second run: a new file, never overwritten
    files = sorted(p.name for p in tmp_path.glob("decode_*.json"))
    assert files == ["decode_tiny-gqa_svd_k0.5_fp32_p16_g4_b1.json", "decode_tiny-gqa_svd_k0.5_fp32_p16_g4_b1_2.json"]
    assert (tmp_path / "decode_tiny-gqa_svd_k0.5_fp32_p16_g4_b1_2.md").exists()
    res = json.loads((tmp_path / files[0]).read_text())
    out = capsys.readouterr().out
    assert "decode ms/tok" in out and "hf_static" in out
    rows = res["systems"]
    assert set(rows) == {"hf_static", "engine", "naive"} and res["command"] == "python -m lowrank_lib.bench " + " ".join(argv)
    for r in rows.values():
        # every derived figure is the arithmetic of the raw step times of this run (1 repeat x 3 steps)
        assert len(r["step_ms"]) == 3 and "tokens_match_hf_dynamic" not in r
        assert r["decode_ms_per_token"] == pytest.approx(statistics.median(r["step_ms"]))
        assert r["decode_ms_q1"] <= r["decode_ms_per_token"] <= r["decode_ms_q3"]
        assert r["decode_tokens_per_s"] == pytest.approx(1e3 / r["decode_ms_per_token"])
        assert r["achieved_GBps"] == pytest.approx(r["weight_bytes_per_token"] / r["decode_ms_per_token"] / 1e6)
        assert r["roofline_x"] == pytest.approx(r["decode_ms_per_token"] / 1e3 /
                                                (r["weight_bytes_per_token"] / (res["copy_bandwidth_GBps"] * 1e9)))
        assert r["tokens_per_s"] == pytest.approx(4 / r["e2e_s"])
    assert rows["hf_static"]["decode_speedup_vs_hf_static"] == 1.0
    assert rows["engine"]["per_token_count"] < rows["naive"]["per_token_count"] < rows["hf_static"]["per_token_count"]
    with pytest.raises(SystemExit):
        main(["decode", "--systems", "nope"])


def test_one_cli_for_every_benchmark():
    """Every command is a module with add_arguments / run; --out is a folder everywhere."""
    ap = parser()
    assert set(COMMANDS) >= {"decode", "fidelity", "layout", "ablation", "factor-space", "attsvd", "quality", "sweep",
                             "gpu-session", "peer"}
    for name in COMMANDS:
        a = ap.parse_args([name])
        assert a.out == "benchmarks/results" and hasattr(a.command_module, "run")


def test_result_writer_never_overwrites(tmp_path):
    assert slug("smollm2", None, "k0.5", "", "a b/c") == "smollm2_k0.5_a-b-c"
    p1 = write_result(tmp_path, "x", "cfg", {"a": 1}, md="table")
    p2 = write_result(tmp_path, "x", "cfg", {"a": 2})
    (tmp_path / "x_cfg_3.txt").write_text("someone else's")     # any suffix claims the stem
    p4 = write_result(tmp_path, "x", "cfg", {"a": 4})
    assert [p.name for p in (p1, p2, p4)] == ["x_cfg.json", "x_cfg_2.json", "x_cfg_4.json"]
    assert json.loads(p1.read_text())["a"] == 1 and (tmp_path / "x_cfg.md").read_text() == "table\n"
    run = ResultFiles(tmp_path, "y", "cfg")                     # a long run rewrites its own files only
    run.write({"stage": 1})
    run.write({"stage": 2}, txt="done")
    assert json.loads(run.path.read_text())["stage"] == 2 and sorted(p.name for p in tmp_path.glob("y_*")) == \
        ["y_cfg.json", "y_cfg.txt"]
    with pytest.raises(ValueError, match="folder"):
        ResultFiles(tmp_path / "file.json", "z")


def test_weight_bytes_agree_between_engine_and_model():
    model = compress_svd(models.tiny_model("tiny-mha", seed=0), 0.5)
    unfolded = Engine(model, EngineConfig(max_seq_len=8, fold_rope=False, fold_norm=False))
    assert unfolded.weight_bytes_per_token() == model_weight_bytes_per_token(model)
    # RoPE folding stores [U; P U] for q and k: exactly their U bytes more
    extra = sum(L.self_attn.q_proj.U.numel() + L.self_attn.k_proj.U.numel() for L in model.model.layers) * 4
    assert Engine(model, EngineConfig(max_seq_len=8)).weight_bytes_per_token() == unfolded.weight_bytes_per_token() + extra


class _Clock:
    """time.perf_counter that advances ``dt`` per call."""

    def __init__(self, dt):
        self.t, self.dt = 0.0, dt

    def __call__(self):
        self.t += self.dt
        return self.t


def test_random_lowrank_shapes_and_bandwidth(monkeypatch):
    from lowrank_lib.ranks import keep_rank

    m = random_lowrank(models.tiny_model("tiny-gqa"), 0.5)
    q = m.model.layers[0].self_attn.q_proj
    assert isinstance(q, LowRankLinear) and q.rank == keep_rank(64, 64, 0.5)
    # read + write bytes over the median copy time: each copy_ takes one tick of 2 ms here
    monkeypatch.setattr(timing.time, "perf_counter", _Clock(2e-3))
    n = 1 << 22
    assert copy_bandwidth(torch.device("cpu"), nbytes=n, repeats=3) == pytest.approx(2 * n / 2e-3 / 1e9)


def test_op_classes_and_counter():
    assert op_class("aten.mm.default") == "gemm" and op_class("aten.view.default") == "view"
    assert op_class("aten._scaled_dot_product_flash_attention_for_cpu.default") == "attention"
    assert op_class("aten.index_copy_.default") == "copy/index" and op_class("aten.silu.default") == "elementwise"
    a = torch.ones(2, 2)
    with DispatchCounter() as c:
        torch.mm(a, a).relu()
    assert c.counts == {"aten.mm.default": 1, "aten.relu.default": 1} and c.by_class() == {"gemm": 1, "elementwise": 1}


def test_layout_bench_counts_every_operand(tmp_path, capsys):
    from lowrank_lib.runtime.bandwidth import engine_operand_shapes

    model = compress_svd(models.tiny_model("tiny-gqa", seed=0), 0.5)
    eng = Engine(model, EngineConfig(max_seq_len=8, weight_layout="out_major"))
    shapes = engine_operand_shapes(eng)
    L = model.config.num_hidden_layers
    # per layer: packed qkv S + 3 U, o V + U, packed gate/up S + 2 U, down V + U; plus lm_head
    assert sum(shapes.values()) == 11 * L + 1
    assert shapes[(model.config.vocab_size, model.config.hidden_size)] == 1
    assert main(["layout", "--model", "tiny-gqa", "--working-set-mb", "2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    res = json.loads(next(tmp_path.glob("layout_tiny-gqa_k0.5_float32.json")).read_text())
    assert {(r["out"], r["in"]): r["per_token"] for r in res["rows"]} == dict(shapes)
    tot = {k: 0.0 for k in ("out_major", "in_major", "auto", "best")}
    for r in res["rows"]:
        # the rule the engine uses, the measured fastest, and the bandwidth arithmetic of each row
        assert r["auto"] == pick_layout(r["out"], r["in"], torch.device("cpu"), "auto", torch.float32)
        assert r["best"] == min(r["us"], key=r["us"].get)
        for lay in ("out_major", "in_major"):
            assert r["GBps"][lay] == pytest.approx(r["bytes"] / r["us"][lay] / 1e3)
            assert r["us_q1"][lay] <= r["us"][lay] <= r["us_q3"][lay]          # the spread of the interleaved rounds
            tot[lay] += r["us"][lay] * r["per_token"] / 1e3
        tot["auto"] += r["us"][r["auto"]] * r["per_token"] / 1e3
        tot["best"] += r["us"][r["best"]] * r["per_token"] / 1e3
    assert res["ms_per_token"] == pytest.approx(tot)
    assert "fastest" in capsys.readouterr().out
