"""llama.cpp's side of the frontier (lowrank_lib.eval.llamacpp, lowrank_lib.eval.frontier): its perplexity through
OUR protocol is llama.cpp's own logits on the same tokens, its F32 file agrees with our HF forward, the
llama-perplexity protocol scores the second half of each chunk, and the frontier command runs, resumes and times."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("llama_cpp")

from lowrank_lib import models  # noqa: E402
from lowrank_lib.eval import llamacpp as L  # noqa: E402
from lowrank_lib.eval.perplexity import perplexity  # noqa: E402
from lowrank_lib.formats.gguf import write_hf_gguf  # noqa: E402

SEQ, WIN = 64, 3


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model("tiny-smol", seed=3)


@pytest.fixture(scope="module")
def files(tiny, tmp_path_factory):
    d = tmp_path_factory.mktemp("frontier_gguf")
    f32 = write_hf_gguf(tiny, d / "t.F32.gguf", "F32")
    return {"f32": f32, "q8_0": L.quantize(f32, d / "t.Q8_0.gguf", "q8_0")}


@pytest.fixture(scope="module")
def ids(tiny):
    return torch.randint(0, tiny.config.vocab_size, (WIN * SEQ + 7,), generator=torch.Generator().manual_seed(0))


def direct_logits(path, toks: list[int]) -> np.ndarray:
    """llama.cpp's logits of every position, straight from llama-cpp-python (no lowrank_lib code; the settings
    GGUFLogits uses: f32 cache, fused attention, one batch)."""
    from llama_cpp import Llama

    llm = Llama(model_path=str(path), n_ctx=len(toks), n_batch=len(toks), n_ubatch=len(toks), logits_all=True,
                verbose=False, n_threads=1, type_k=0, type_v=0, flash_attn=True)
    llm.eval(toks)
    out = np.array(llm.scores[:len(toks)], dtype=np.float64)
    llm.close()
    return out


def nll_sum(logits: np.ndarray, targets) -> float:
    m = logits.max(-1, keepdims=True)
    lse = (m + np.log(np.exp(logits - m).sum(-1, keepdims=True)))[:, 0]
    return float((lse - logits[np.arange(len(targets)), targets]).sum())


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
def test_our_protocol_is_llamacpps_own_logits_on_the_same_tokens(files, ids, qtype):
    got = L.gguf_perplexity(files[qtype], ids, seq_len=SEQ, max_windows=WIN)
    total = 0.0
    for w in range(WIN):                     # our windows: non-overlapping, first token of each not predicted
        toks = ids[w * SEQ:(w + 1) * SEQ].tolist()
        total += nll_sum(direct_logits(files[qtype], toks)[:-1], toks[1:])
    want = math.exp(total / (WIN * (SEQ - 1)))
    assert got.tokens == WIN * (SEQ - 1) and got.windows == WIN
    assert got.ppl == pytest.approx(want, rel=1e-6)            # ours: fp32 log-softmax; here: float64


def test_the_f32_file_agrees_with_our_hf_forward(tiny, files, ids):
    ours = perplexity(tiny, ids, seq_len=SEQ, max_windows=WIN, progress=False)
    theirs = L.gguf_perplexity(files["f32"], ids, seq_len=SEQ, max_windows=WIN)
    assert theirs.ppl == pytest.approx(ours.ppl, rel=1e-3)
    q8 = L.gguf_perplexity(files["q8_0"], ids, seq_len=SEQ, max_windows=WIN)
    assert q8.ppl != theirs.ppl                                   # the quantized file is a different point


def test_llama_perplexity_scores_the_second_half_of_each_chunk(files, ids):
    n_ctx = 32
    r = L.llama_perplexity(files["f32"], ids, n_ctx=n_ctx, chunks=4, bos=None, kv_type="f32")
    total = 0.0
    for c in range(4):
        toks = ids[c * n_ctx:(c + 1) * n_ctx].tolist()
        total += nll_sum(direct_logits(files["f32"], toks)[n_ctx // 2:n_ctx - 1], toks[n_ctx // 2 + 1:])
    assert r["tokens"] == 4 * (n_ctx - 1 - n_ctx // 2) and r["chunks"] == 4
    assert r["ppl"] == pytest.approx(math.exp(total / r["tokens"]), rel=1e-9)
    assert len(r["chunk_ppl"]) == 4 and r["chunk_ppl"][-1] == r["ppl"]
    # a BOS replaces each chunk's first token (the context changes; the scored targets do not)
    rb = L.llama_perplexity(files["f32"], ids, n_ctx=n_ctx, chunks=4, bos=5, kv_type="f32")
    toks = [5] + ids[1:n_ctx].tolist()
    one = nll_sum(direct_logits(files["f32"], toks)[n_ctx // 2:n_ctx - 1], ids[n_ctx // 2 + 1:n_ctx].tolist())
    assert rb["chunk_ppl"][0] == pytest.approx(math.exp(one / (n_ctx - 1 - n_ctx // 2)), rel=1e-9)
    assert rb["ppl"] != r["ppl"]


def test_quantize_types_and_the_bench_reexport(files, tmp_path):
    from lowrank_lib.bench import llamacpp as B

    assert B.quantize is L.quantize and B.QUANT_TYPES is L.QUANT_TYPES and B.available is L.available
    with pytest.raises(ValueError, match="q9_9"):
        L.quantize(files["f32"], tmp_path / "x.gguf", "q9_9")
    assert L.QUANT_TYPES["q4_k_m"] == 15 and L.QUANT_TYPES["q6_k"] == 18 and L.QUANT_TYPES["q2_k"] == 10
    assert files["q8_0"].stat().st_size < 0.4 * files["f32"].stat().st_size


def test_the_requantize_caveat_sees_a_grid(tmp_path):
    from lowrank_lib.eval.frontier import requantize_caveat

    preset = models.TinyPreset(hidden_size=256, intermediate_size=256, num_hidden_layers=1, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=512, max_position_embeddings=64,
                               tie_word_embeddings=True)
    r = requantize_caveat(preset, seq_len=64, windows=2, workdir=tmp_path)
    # Q4_K_M on weights already on a Q4_1 grid loses less than on weights of no grid
    assert 0 < r["on_grid"]["kl_per_token"] < r["off_grid"]["kl_per_token"]
    assert r["ratio_off_over_on"] > 2
    same = requantize_caveat(preset, seq_len=64, windows=2, workdir=tmp_path, grid="f32")
    assert same["ratio_off_over_on"] == pytest.approx(1.0, rel=1e-6)      # "grid" F32: the same weights


def test_the_frontier_command_runs_resumes_and_times(tmp_path):
    from lowrank_lib.bench import cli

    common = ["--model", "tiny-smol", "--windows", "1", "--prompt-len", "64", "--calib-samples", "2", "--calib-len",
              "32", "--workdir", str(tmp_path / "wd"), "--out", str(tmp_path / "out")]
    assert cli.main(["frontier", *common, "--threads", "1", "--keep", "0.8", "--families", "svdllm", "--quants", "f32",
                     "q8_0"]) == 0
    path = tmp_path / "out" / "frontier_tiny-smol.json"
    res = json.loads(path.read_text())
    ids = [p["id"] for p in res["points"]]
    assert ids == ["llama.cpp:f32", "llama.cpp:q8_0", "lowrank_lib:dense:bf16", "lowrank_lib:svdllm@0.8:bf16"]
    first = {p["id"]: p["ppl"] for p in res["points"]}
    # resume: the measured points are kept as they are, only the new keep is measured
    assert cli.main(["frontier", *common, "--threads", "1", "--keep", "0.8", "0.6", "--families", "svdllm",
                     "--quants", "f32", "q8_0", "--resume", str(path)]) == 0
    res = json.loads(path.read_text())
    assert [p["id"] for p in res["points"]] == ids + ["lowrank_lib:svdllm@0.6:bf16"]
    assert all(first[p["id"]] == p["ppl"] for p in res["points"] if p["id"] in first)
    assert len(res["commands"]) == 2
    # merge: a separate run's points join the file (its own points are not measured again)
    assert cli.main(["frontier", *common, "--threads", "1", "--families", "none", "--no-dense", "--quants",
                     "q4_1"]) == 0
    other = tmp_path / "out" / "frontier_tiny-smol_2.json"
    assert [p["id"] for p in json.loads(other.read_text())["points"]] == ["llama.cpp:q4_1"]
    assert cli.main(["frontier", *common, "--threads", "1", "--families", "none", "--no-dense", "--quants", "none",
                     "--resume", str(path), "--merge", str(other)]) == 0
    res = json.loads(path.read_text())
    assert [p["id"] for p in res["points"]] == ids + ["lowrank_lib:svdllm@0.6:bf16", "llama.cpp:q4_1"]
    # speed: one child per point with a file, ms/token at each thread count, the child's peak RSS
    assert cli.main(["frontier", "--speed", "--resume", str(path), "--prompt-len", "8", "--gen-len", "4",
                     "--threads", "1", "--repeats", "1", "--graph", "none", "--out", str(tmp_path / "out")]) == 0
    res = json.loads(path.read_text())
    for p in res["points"]:
        assert p["speed"]["1"]["ms_per_token"] > 0 and p["peak_rss"] > 0, p["id"]
    # long context: the named points with their KV cache at 48 tokens (llama.cpp f16 / q8_0, ours dense + composed),
    # resumable; a name that is not a point is refused
    lc = ["frontier", "--model", "tiny-smol", "--longctx", "--prompt-len", "48", "--gen-len", "9", "--windows", "1",
          "--threads", "1", "--budget", "0.5", "--resume", str(path), "--workdir", str(tmp_path / "wd"), "--out", str(tmp_path / "out"), "--points",
          "llama.cpp F32", "lowrank_lib:dense:bf16", "lowrank_lib:svdllm@0.8:bf16"]
    assert cli.main(lc) == 0
    got = json.loads(path.read_text())["long_context"]
    assert got["context"] == 48 and got["cont"] == 9 and got["budgets"] == [0.5]
    assert [(p["id"].split("+")[0], p["kv"]) for p in got["points"]] == [
        ("lowrank_lib:dense:bf16", "dense-bf16"), ("lowrank_lib:dense:bf16", "composed-kvzip-q8:0.5"),
        ("lowrank_lib:svdllm@0.8:bf16", "dense-bf16"), ("lowrank_lib:svdllm@0.8:bf16", "composed-kvzip-q8:0.5"),
        ("llama.cpp:f32", "f16"), ("llama.cpp:f32", "q8_0")]
    by = {(p["id"].split("+")[0], p["kv"]): p for p in got["points"]}
    # the svdllm point is its saved file: the same perplexity model as the quality phase scored, not the dense one
    assert by[("lowrank_lib:svdllm@0.8:bf16", "dense-bf16")]["ppl"] != by[("lowrank_lib:dense:bf16", "dense-bf16")]["ppl"]
    # llama.cpp's f32 file with an f16 cache is within the cache's rounding of our dense model (same windows)
    assert by[("llama.cpp:f32", "f16")]["ppl"] == pytest.approx(by[("lowrank_lib:dense:bf16", "dense-bf16")]["ppl"],
                                                                 rel=0.02)
    assert cli.main(lc) == 0 and len(json.loads(path.read_text())["long_context"]["points"]) == 6
    with pytest.raises(SystemExit, match="no point named"):
        cli.main([*lc[:-4], "--points", "nope"])
    with pytest.raises(SystemExit, match="measured on 'tiny-smol'"):
        cli.main([*lc[:1], *lc[3:]])                        # the default model is not the one the file was made from
