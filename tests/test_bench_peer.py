"""The peer benchmark: GGUF export of the same weights, llama.cpp runner, rows / JSON schema.

The export and schema tests always run; the llama.cpp tests need the optional ``peer`` extra
(``llama-cpp-python``) and are skipped with the reason when it is not importable.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from lowrank_lib import models
from lowrank_lib.bench import gguf_export as ge
from lowrank_lib.bench import peer
from lowrank_lib.bench.llamacpp import available

LLAMA_OK, LLAMA_WHY = available()
needs_llama = pytest.mark.skipif(not LLAMA_OK, reason=LLAMA_WHY)


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model("tiny-smol", seed=3)


# --------------------------------------------------------------------------- the q/k permutation
@pytest.mark.parametrize("heads,D,cols", [(3, 64, 5), (1, 8, 3), (4, 16, 1)])
def test_permute_qk_inverse_and_matches_transformers(heads, D, cols):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    W = np.random.default_rng(0).standard_normal((heads * D, cols)).astype(np.float32)
    P = ge.permute_qk(W, heads)
    assert not np.array_equal(P, W)
    np.testing.assert_array_equal(ge.unpermute_qk(P, heads), W)
    # transformers undoes llama.cpp's permutation with its own code: ours must be its inverse
    np.testing.assert_array_equal(LlamaTensorProcessor()._reverse_permute_weights(P, heads, heads), W)
    assert torch.equal(ge.permute_qk(torch.from_numpy(W), heads), torch.from_numpy(P))


def test_permute_interleaves_rope_halves():
    # one head of 4 dims: HF rows [x0, x1 | y0, y1] (halves) -> llama.cpp rows [x0, y0, x1, y1] (pairs)
    W = np.arange(4, dtype=np.float32)[:, None]
    assert ge.permute_qk(W, 1)[:, 0].tolist() == [0, 2, 1, 3]


# --------------------------------------------------------------------------- export round trips
def test_hf_gguf_round_trip_exact_and_transformers_agrees(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    p = ge.write_hf_gguf(tiny, tmp_path / "t.gguf", "F32")
    sd = ge.gguf_state_dict(p)
    ref = tiny.state_dict()
    assert set(sd) == set(ref) - {"lm_head.weight"}            # tied head: not stored
    for k, v in sd.items():
        assert torch.equal(v, ref[k]), k
    # an independent reader (transformers' GGUF loader) sees the same model
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="t.gguf", dtype=torch.float32)
    for k, v in hf.state_dict().items():
        assert torch.equal(v, ref[k]), k
    assert ge.verify_gguf(p, ref, "fp32")["exact"]


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_export_from_quantised_gguf(tiny, tmp_path, dtype):
    """The real pipeline on a tiny model: a Q4_1 file -> dequantised F32 / BF16 file, every tensor equal
    to the dequantised weights (bf16: torch's rounding of them), metadata copied, file type updated."""
    import gguf

    src = ge.write_hf_gguf(tiny, tmp_path / "q.gguf", "Q4_1")
    deq = ge.gguf_state_dict(src)                               # what our model cache would hold
    assert not torch.equal(deq["model.layers.0.self_attn.q_proj.weight"],
                           tiny.state_dict()["model.layers.0.self_attn.q_proj.weight"])  # really quantised
    dst = ge.export_gguf(src, tmp_path / f"{dtype}.gguf", dtype)
    res = ge.verify_gguf(dst, deq, dtype)
    assert res["exact"] and res["tensors"] == len(deq)
    r_src, r_dst = gguf.GGUFReader(str(src)), gguf.GGUFReader(str(dst))
    keys = lambda r: {k for k in r.fields if not k.startswith("GGUF.")}
    assert keys(r_src) == keys(r_dst)
    for k in keys(r_src) - {"general.file_type"}:
        assert r_src.fields[k].contents() == r_dst.fields[k].contents(), k
    want_ft, want_t = {"fp32": (0, "F32"), "bf16": (32, "BF16")}[dtype]
    assert r_dst.fields["general.file_type"].contents() == want_ft
    types = {t.name: t.tensor_type.name for t in r_dst.tensors}
    assert types["blk.0.attn_q.weight"] == want_t and types["token_embd.weight"] == want_t
    assert types["blk.0.attn_norm.weight"] == "F32"             # 1-D tensors stay F32, as llama.cpp keeps them
    assert [t.name for t in r_src.tensors] == [t.name for t in r_dst.tensors]


def test_verify_names_the_tensor_that_differs(tiny, tmp_path):
    p = ge.write_hf_gguf(tiny, tmp_path / "t.gguf", "F32")
    ref = {k: v.clone() for k, v in tiny.state_dict().items()}
    ref["model.layers.1.self_attn.k_proj.weight"][3, 5] += 1e-3
    with pytest.raises(ge.GGUFExportError, match="model.layers.1.self_attn.k_proj.weight"):
        ge.verify_gguf(p, ref, "fp32")
    ref = {k: v for k, v in tiny.state_dict().items() if k != "model.norm.weight"}
    with pytest.raises(ge.GGUFExportError, match="unexpected"):
        ge.verify_gguf(p, ref, "fp32")


def test_bf16_verify_is_strict(tiny, tmp_path):
    """A BF16 file equals torch's round-to-nearest-even of the fp32 weights, not merely something close."""
    p = ge.write_hf_gguf(tiny, tmp_path / "b.gguf", "BF16")
    ref = tiny.state_dict()
    assert ge.verify_gguf(p, ref, "bf16")["exact"]
    with pytest.raises(ge.GGUFExportError):
        ge.verify_gguf(p, ref, "fp32")                          # bf16 values are not the fp32 ones


def test_export_refuses_unknown_dtype(tiny, tmp_path):
    p = ge.write_hf_gguf(tiny, tmp_path / "t.gguf", "F32")
    with pytest.raises(ValueError, match="dtype"):
        ge.export_gguf(p, tmp_path / "x.gguf", "fp16")


def test_gguf_bytes_per_token_counts_the_tied_head(tiny, tmp_path):
    from lowrank_lib.bench.decode import model_weight_bytes_per_token

    p = ge.write_hf_gguf(tiny, tmp_path / "t.gguf", "F32")
    assert peer.gguf_bytes_per_token(p) == model_weight_bytes_per_token(tiny)


# --------------------------------------------------------------------------- rows, comparisons, JSON
def _row(system, dtype, threads, ms, wb, pre=100.0, bw=25.0):
    return {"system": system, "dtype": dtype, "threads": threads, "decode_ms_per_token": ms, "prefill_ms": pre,
            "weight_bytes_per_token": wb, "roofline_x": ms / 1e3 / (wb / (bw * 1e9))}


def test_comparisons_and_targets():
    rows = [_row("llamacpp_dense", "bf16", 1, 14.0, 270e6), _row("lowrank_lib_dense", "bf16", 1, 15.0, 270e6),
            _row("lowrank_lib_lowrank", "bf16", 1, 9.0, 168e6), _row("llamacpp_dense", "bf16", 2, 10.0, 270e6),
            _row("lowrank_lib_lowrank", "bf16", 2, 8.0, 168e6)]
    comps = peer.comparisons(rows)
    c1 = next(c for c in comps if c["threads"] == 1)
    assert c1["lowrank_speedup_vs_llamacpp"] == pytest.approx(14 / 9)
    assert c1["dense_ratio_vs_llamacpp"] == pytest.approx(15 / 14)
    assert c1["lowrank_bytes_vs_dense"] == pytest.approx(168 / 270)
    c2 = next(c for c in comps if c["threads"] == 2)
    assert "dense_ratio_vs_llamacpp" not in c2                   # no dense row at 2 threads
    t = {x["target"]: x for x in peer.targets(comps)}
    assert all(x["threads"] == 1 for x in peer.targets(comps))
    assert t["lowrank_speedup_vs_llamacpp"]["met"] and t["dense_ratio_vs_llamacpp"]["met"]
    assert t["lowrank_roofline_x"]["measured"] == pytest.approx(9e-3 / (168e6 / 25e9))
    assert not t["lowrank_roofline_x"]["met"]


def test_compare_greedy_reports_first_divergence():
    from lowrank_lib.runtime.engine import GenerateOutput

    V = 7
    la = [torch.eye(V)[i % V][None] * 3 for i in range(5)]
    lb = [x.clone() for x in la]
    lb[3] = torch.eye(V)[6][None] * 3 + 0.1
    ta = torch.tensor([[l.argmax().item() for l in la]])
    tb = torch.tensor([[l.argmax().item() for l in lb]])
    a, b = GenerateOutput(ta, 0.0, [], 0.0, la), GenerateOutput(tb, 0.0, [], 0.0, lb)
    r = peer.compare_greedy(a, b)
    assert not r["tokens_equal"] and r["first_divergence"] == 3 and r["n_equal_before_divergence"] == 3
    assert r["tokens_a"] == 3 and r["tokens_b"] == 6
    assert peer.compare_greedy(a, a)["tokens_equal"]


def test_result_path_never_overwrites(tmp_path):
    p1 = peer.save({"rows": []}, tmp_path)
    p2 = peer.save({"rows": [1]}, tmp_path)
    assert p1.name == "peer_cpu.json" and p2.name == "peer_cpu_2.json"
    assert json.loads(p1.read_text()) == {"rows": []}


def test_cli_parses_and_refuses_unknown_systems():
    import argparse

    ap = argparse.ArgumentParser()
    peer.add_arguments(ap)
    cfg = peer.config_from_args(ap.parse_args(["--threads", "1", "--dtypes", "bf16", "--out", "x"]))
    assert cfg.threads == (1,) and cfg.dtypes == ("bf16",) and cfg.out == "x" and cfg.prompt_len == 512
    with pytest.raises(SystemExit):
        peer.config_from_args(ap.parse_args(["--systems", "llamacpp_dense,vllm"]))
    with pytest.raises(SystemExit):
        peer.config_from_args(ap.parse_args(["--dtypes", "fp16"]))


def _committed():
    from pathlib import Path

    return sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("peer_cpu*.json"))


@pytest.mark.parametrize("p", _committed(), ids=lambda p: p.name)
def test_committed_result_has_the_schema(p):
    """Every committed benchmarks/results/peer_cpu*.json (from a real run) holds what the issue asks for."""
    res = json.loads(p.read_text())
    assert res["rows"] and isinstance(res["copy_bandwidth_GBps"], float) and res["command"].startswith("python -m")
    for r in res["rows"]:
        assert set(peer.ROW_KEYS) <= set(r)
        assert r["system"] in peer.SYSTEMS and r["dtype"] in ("fp32", "bf16") and r["threads"] >= 1
        assert r["decode_ms_per_token"] > 0 and r["prefill_ms"] > 0 and r["weight_bytes_per_token"] > 0
    assert {r["system"] for r in res["rows"]} == set(peer.SYSTEMS)
    assert "tokens_equal" in res["equivalence"]


# --------------------------------------------------------------------------- llama.cpp itself
def test_missing_llama_cpp_is_reported_not_raised(monkeypatch, tiny, tmp_path):
    import importlib.util

    from lowrank_lib.bench import llamacpp

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llama_cpp" else None)
    ok, why = llamacpp.available()
    assert not ok and "pip install" in why and "[peer]" in why
    with pytest.raises(RuntimeError, match="llama-cpp-python"):
        llamacpp.LlamaCppRunner(tmp_path / "none.gguf", n_ctx=8)
    with pytest.raises(SystemExit, match="llama-cpp-python"):
        peer.run_peer(peer.PeerConfig(model="tiny-smol", threads=(1,), prompt_len=8, gen_len=2, repeats=1),
                      progress=False, log=lambda *_: None)


@needs_llama
def test_llamacpp_runner_matches_engine_on_tiny_model(tiny, tmp_path):
    """Same prompt ids, same 24 greedy tokens, logits within fp32 noise: both runtimes do the same work
    (a wrong q/k permutation would break RoPE and the tokens)."""
    from lowrank_lib.bench.llamacpp import LlamaCppRunner
    from lowrank_lib.runtime import Engine, EngineConfig, run_generation

    p = ge.write_hf_gguf(tiny, tmp_path / "t.gguf", "F32")
    ids = torch.randint(0, tiny.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(1))
    r = LlamaCppRunner(p, n_ctx=64, threads=1, kv_type="f32", flash_attn=False)
    e = Engine(tiny, EngineConfig(max_seq_len=64))
    a = run_generation(r, ids, 24, return_logits=True)
    b = run_generation(e, ids, 24, return_logits=True)
    cmp = peer.compare_greedy(a, b)
    assert cmp["tokens_equal"], cmp
    assert cmp["max_abs_logit_diff"] < 1e-3 * max(1.0, cmp["logit_scale"])
    assert len(r.eval_s) == 23 and r.prefill_eval_s > 0
    perf = r.perf()
    assert perf["n_eval"] == 23 and perf["n_p_eval"] == 40
    # a second request starts from an empty cache
    c = run_generation(r, ids, 24)
    assert torch.equal(c.tokens, a.tokens)
    r.close()


@needs_llama
def test_peer_benchmark_end_to_end_on_tiny_model(tmp_path):
    res = peer.run_peer(peer.PeerConfig(model="tiny-smol", dtypes=("fp32", "bf16"), threads=(1,), prompt_len=32,
                                        gen_len=8, repeats=1, graph="none", llama_flash_attn="off",
                                        prompt="random", out=str(tmp_path)), progress=False, log=lambda *_: None)
    assert res["equivalence"]["tokens_equal"]
    assert {(r["system"], r["dtype"]) for r in res["rows"]} == {(s, d) for s in peer.SYSTEMS for d in ("fp32", "bf16")}
    for r in res["rows"]:
        assert r["decode_steps"] == 7 and r["decode_ms_per_token"] > 0
        assert 0 < r["decode_cpu_ms_per_token"] <= 1.5 * r["decode_ms_per_token"]   # 1 thread: CPU ~ wall
    assert peer.format_table(res).count("\n") >= 8
    p = peer.save(res, tmp_path)
    assert json.loads(p.read_text())["rows"]


def test_figures_are_redrawn_from_a_result(tmp_path):
    """`bench peer --replot JSON` draws decode-vs-bytes and the thread-scaling figure without running."""
    from lowrank_lib.bench.cli import main

    rows = [_row(s, d, t, ms / t ** 0.3, wb) for t in (1, 2) for d, f in (("fp32", 2), ("bf16", 1))
            for s, ms, wb in (("llamacpp_dense", 14.0 * f, 270e6 * f), ("lowrank_lib_dense", 13.0 * f, 270e6 * f),
                              ("lowrank_lib_lowrank", 9.0 * f, 168e6 * f))]
    src = tmp_path / "r.json"
    src.write_text(json.dumps({"rows": rows, "copy_bandwidth_GBps_by_threads": {"1": 30.0, "2": 31.0}}))
    assert main(["peer", "--replot", str(src), "--figures", str(tmp_path / "fig")]) == 0
    for name in ("peer_decode_vs_bytes", "peer_thread_scaling"):
        assert (tmp_path / "fig" / f"{name}.png").stat().st_size > 10_000
