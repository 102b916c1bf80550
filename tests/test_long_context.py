"""The frontier at long context (lowrank_lib.eval.long_context): every point scores the same continuation tokens
of the same windows, the cache's bytes are counted beside the weights', llama.cpp's continuation NLL is its own
logits, and an f32 llama.cpp cache agrees with our dense cache on the same weights."""
from __future__ import annotations

import math

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.eval import long_context as lc

CTX, CONT, WIN = 48, 9, 2


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model("tiny-smol", seed=3)


def hf_continuation_nll(model, W: torch.Tensor) -> list[float]:
    """Mean NLL of tokens CTX+1 ... of each window from ONE plain forward over the window (no cache code)."""
    with torch.no_grad():
        return [float(torch.nn.functional.cross_entropy(model(w[None]).logits[0, CTX:-1].double(), w[CTX + 1:]))
                for w in W]


def dense_point(model) -> dict:
    from lowrank_lib.eval.frontier import weight_bytes_per_token

    return {"id": "lowrank_lib:dense:bf16", "label": "lowrank_lib dense bf16", "system": "lowrank_lib",
            "method": "dense", "keep": None, "weights": "bf16", "weight_bytes_per_token": weight_bytes_per_token(model)}


def test_kv_values_per_position_of_smollm2_and_a_tiny_model(tiny):
    from lowrank_lib.models import shape_config

    assert lc.kv_values_per_position(shape_config("llama3.2-1b")) == 2 * 16 * 8 * 64
    c = tiny.config
    assert lc.kv_values_per_position(c) == 2 * c.num_hidden_layers * c.num_key_value_heads * (
        c.hidden_size // c.num_attention_heads)


def test_our_points_count_the_cache_and_score_the_continuation(tiny):
    from lowrank_lib.data import random_token_batches

    pts = lc.long_context_points(tiny.config, None, [(dense_point(tiny), tiny)], [], context=CTX, cont=CONT,
                                 windows=WIN, policies=("composed-kvzip-q8",), budgets=(0.5, 0.25), progress=False,
                                 log=lambda *_: None)
    assert [p["kv"] for p in pts] == ["dense-bf16", "composed-kvzip-q8:0.5", "composed-kvzip-q8:0.25"]
    dense = pts[0]
    assert dense["kv_bytes"] == lc.kv_values_per_position(tiny.config) * CTX * 2
    for p in pts:
        assert p["bytes_per_token"] == p["weight_bytes_per_token"] + p["kv_bytes"] and p["context"] == CTX
        assert len(p["window_nll"]) == WIN and p["ppl"] == pytest.approx(math.exp(sum(p["window_nll"]) / WIN))
    assert pts[2]["kv_bytes"] < pts[1]["kv_bytes"] < dense["kv_bytes"]
    # the dense-cache point is the plain forward's continuation NLL on the same windows
    W = random_token_batches(tiny.config.vocab_size, WIN, CTX + CONT, 0)
    assert dense["window_nll"] == pytest.approx(hf_continuation_nll(tiny, W), rel=1e-4)
    # points already measured are not measured again
    again = lc.long_context_points(tiny.config, None, [(dense_point(tiny), tiny)], [], context=CTX, cont=CONT,
                                   windows=WIN, policies=("composed-kvzip-q8",), budgets=(0.5, 0.25),
                                   done={p["id"] for p in pts}, progress=False, log=lambda *_: None)
    assert again == []
    table = lc.long_context_table(pts)
    assert table.count("\n") == 4 and "**yes**" in table


def test_llamacpp_continuation_is_its_logits_and_its_f32_cache_agrees_with_ours(tiny, tmp_path):
    pytest.importorskip("llama_cpp")
    from lowrank_lib.data import random_token_batches
    from lowrank_lib.eval import llamacpp as L
    from lowrank_lib.formats.gguf import decode_bytes_per_token, write_hf_gguf

    f32 = write_hf_gguf(tiny, tmp_path / "t.F32.gguf", "F32")
    W = random_token_batches(tiny.config.vocab_size, WIN, CTX + CONT, 0)
    theirs = lc.llamacpp_continuation_nll(f32, W, CTX, kv="f32")
    with L.GGUFLogits(f32, n_ctx=CTX + CONT, kv_type="f32") as m:       # llama.cpp's logits, scored here
        direct = [float(torch.nn.functional.cross_entropy(torch.from_numpy(m.row_logits(w.tolist())).double()[CTX:-1],
                                                          w[CTX + 1:])) for w in W]
    assert theirs == pytest.approx(direct, rel=1e-12)
    assert theirs == pytest.approx(hf_continuation_nll(tiny, W), rel=1e-3)
    point = {"id": "llama.cpp:f32", "label": "llama.cpp F32", "system": "llama.cpp", "method": "F32", "keep": None,
             "weights": "f32", "weight_bytes_per_token": decode_bytes_per_token(f32)}
    pts = lc.long_context_points(tiny.config, None, [(dense_point(tiny), tiny)], [(point, f32)], context=CTX,
                                 cont=CONT, windows=WIN, llama_kv=("f32", "q8_0"), policies=(), progress=False,
                                 log=lambda *_: None)
    by = {p["kv"]: p for p in pts}
    assert by["f32"]["ppl"] == pytest.approx(by["dense-bf16"]["ppl"], rel=1e-3)   # same windows, same tokens
    assert by["q8_0"]["kv_bytes"] == pytest.approx(by["f32"]["kv_bytes"] * (34 / 32) / 4)
    assert by["q8_0"]["ppl"] != by["f32"]["ppl"]
