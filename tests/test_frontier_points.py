"""The frontier's points: their human labels, the hybrid points (quantized factors), and the speed phase's
``--points`` choice (issue 31)."""
from __future__ import annotations

import argparse

import pytest
import torch

from lowrank_lib.eval import frontier as fr

SEQ, WIN = 32, 2


def _p(i, system="lowrank_lib", method="svdllm", keep=0.8, weights="bf16", **kw):
    return {"id": i, "system": system, "method": method, "keep": keep, "weights": weights, "ppl": 2.0,
            "weight_bytes_per_token": 10, **kw}


def test_labels_name_the_system_family_keep_and_storage():
    assert fr.make_label(_p("a", "llama.cpp", "Q4_K_M", None, "q4_k_m")) == "llama.cpp Q4_K_M"
    assert fr.make_label(_p("b", method="dense", keep=1.0)) == "dense bf16"
    assert fr.make_label(_p("c")) == "SVD-LLM v1 keep 0.8 bf16"
    assert fr.make_label(_p("d", method="basis_sharing", keep=0.6, weights="int8")) == "Basis Sharing keep 0.6 int8"
    assert fr.make_label(_p("e", method="dobi-remap", keep=0.9)) == "Dobi-SVD (remap) keep 0.9 bf16"
    assert fr.make_label(_p("f", method="svdllm_v2", keep=0.6, weights="int4")) == "SVD-LLM v2 keep 0.6 int4"
    # the stored label wins; a point of an older file (none stored) gets the computed one
    assert fr.label(_p("g", label="mine")) == "mine" and fr.label(_p("h")) == "SVD-LLM v1 keep 0.8 bf16"
    assert "| SVD-LLM v1 keep 0.8 bf16 | 2.00 |" in fr.format_table([_p("h")])


def test_select_points_by_label_or_id_and_refuses_an_unknown_name():
    pts = [_p("llama.cpp:q4_k_m", "llama.cpp", "Q4_K_M", None, "q4_k_m"), _p("lowrank_lib:svdllm@0.8:bf16"),
           _p("lowrank_lib:svdllm@0.8:int8", weights="int8")]
    assert fr.select_points(pts, None) == pts
    got = fr.select_points(pts, ["svd-llm v1 keep 0.8 INT8", "llama.cpp:q4_k_m"])
    assert [p["id"] for p in got] == ["llama.cpp:q4_k_m", "lowrank_lib:svdllm@0.8:int8"]     # the points' order
    with pytest.raises(ValueError, match="Q5_K_M"):
        fr.select_points(pts, ["llama.cpp Q4_K_M", "Q5_K_M"])


@pytest.fixture(scope="module")
def tiny():
    from lowrank_lib import models

    return models.tiny_model("tiny-smol", seed=3)


@pytest.fixture(scope="module")
def ids(tiny):
    return torch.randint(0, tiny.config.vocab_size, (WIN * SEQ + 1,), generator=torch.Generator().manual_seed(0))


def _run(tiny, ids, weights, save_dir, done=(), log=None):
    return fr.lowrank_points(tiny, None, ids, families=("svdllm",), keeps=(0.6,), weights=weights, seq_len=SEQ,
                             windows=WIN, calib_samples=2, calib_len=32, done=done, save_dir=save_dir,
                             log=log or (lambda s: None))


def test_quantized_factor_points_read_fewer_bytes_and_resume_from_the_saved_bf16_model(tiny, ids, tmp_path):
    from lowrank_lib.factorized import lowrank_modules

    pts = {p["id"]: p for p in _run(tiny, ids, ("bf16", "int8", "int4"), tmp_path, done={"lowrank_lib:dense:bf16"})}
    b16, i8, i4 = (pts[f"lowrank_lib:svdllm@0.6:{w}"] for w in ("bf16", "int8", "int4"))
    assert (i8["label"], i8["factor_bits"], i8["factor_group"]) == ("SVD-LLM v1 keep 0.6 int8", 8, 32)
    assert i4["weight_bytes_per_token"] < i8["weight_bytes_per_token"] < b16["weight_bytes_per_token"]
    assert i8["ppl"] == pytest.approx(b16["ppl"], rel=0.02) and i8["ppl"] != b16["ppl"]
    saved = torch.load(i8["file"], weights_only=False)
    assert all(m.quantized for m in lowrank_modules(saved).values()) and saved.lowrank_meta["quant"]["bits"] == 8
    # a later run wants int8 again with the bf16 point done: it starts from the saved bf16 file (no calibration,
    # no compression) and measures exactly what the first run measured
    logs = []
    again = _run(tiny, ids, ("bf16", "int8"), tmp_path, done={"lowrank_lib:dense:bf16", b16["id"]}, log=logs.append)
    assert [p["id"] for p in again] == [i8["id"]] and again[0]["ppl"] == i8["ppl"]
    assert not any("calibration" in s for s in logs) and any("the bf16 model from" in s for s in logs)
    assert again[0]["weight_bytes_per_token"] == i8["weight_bytes_per_token"] and "compress_s" not in again[0]


def test_gptq_and_mixed_points_store_what_their_names_say(tiny, ids, tmp_path):
    """``-gptq`` storages hold GPTQ codes for the bf16 model's own moments (collected once per family and keep),
    ``mixed`` holds MIXED_4_8's widths per projection; each perplexity is that of the saved model's factors."""
    from lowrank_lib import MIXED_4_8
    from lowrank_lib.eval.perplexity import perplexity
    from lowrank_lib.eval.quant_quality import dequantized
    from lowrank_lib.factorized import lowrank_modules

    logs = []
    pts = {p["weights"]: p for p in _run(tiny, ids, ("bf16", "int4", "int4-gptq", "mixed", "mixed-gptq"), tmp_path,
                                         done={"lowrank_lib:dense:bf16"}, log=logs.append)}
    assert sum("GPTQ moments" in s for s in logs) == 1
    assert pts["int4-gptq"]["label"] == "SVD-LLM v1 keep 0.6 int4 GPTQ" and pts["mixed"]["factor_bits"] == MIXED_4_8
    assert [pts[w]["factor_method"] for w in ("int4", "int4-gptq", "mixed", "mixed-gptq")] == ["rtn", "gptq"] * 2
    b = {w: p["weight_bytes_per_token"] for w, p in pts.items()}
    assert b["int4"] == b["int4-gptq"] < b["mixed"] == b["mixed-gptq"] < b["bf16"]
    models = {w: torch.load(pts[w]["file"], weights_only=False) for w in pts}
    assert models["int4-gptq"].lowrank_meta["quant"]["method"] == "gptq"
    rtn, gq = (lowrank_modules(models[w]) for w in ("int4", "int4-gptq"))
    assert any(not torch.equal(rtn[n].V.data, gq[n].V.data) for n in rtn)           # other codes, same storage
    for name, lr in lowrank_modules(models["mixed-gptq"]).items():
        want = MIXED_4_8.get(name.rsplit(".", 1)[-1], MIXED_4_8["*"])
        assert lr.U.bits == lr.V.bits == want, name
    m = dequantized(models["int4-gptq"].float())
    assert perplexity(m, ids, seq_len=SEQ, max_windows=WIN, progress=False).ppl == pytest.approx(pts["int4-gptq"]["ppl"],
                                                                                      rel=1e-3)


def test_dobi_remap_int_points_are_its_codes_served_not_its_bf16_factors_requantized(tiny, ids, tmp_path):
    """A family whose file holds codes (Dobi remap): the int8 point's factors are ``quantize`` of the factors decoded
    from its codes, what ``load_checkpoint(factor_bits=8)`` serves (``tests/test_dobi_served.py``), also when its bf16
    point was measured before (it compresses again rather than requantize the saved bf16 model)."""
    from lowrank_lib.codecs import remap_us, remap_vt
    from lowrank_lib.factorized import lowrank_modules
    from lowrank_lib.quant import quantize

    def run(weights, done, log):
        return fr.lowrank_points(tiny, None, ids, families=("dobi-remap",), keeps=(0.6,), weights=weights,
                                 seq_len=SEQ, windows=WIN, calib_samples=2, calib_len=32, done=done,
                                 save_dir=tmp_path, log=log)

    first = {p["id"]: p for p in run(("bf16", "int8"), {"lowrank_lib:dense:bf16"}, lambda s: None)}
    logs = []
    again = run(("bf16", "int8"), {"lowrank_lib:dense:bf16", "lowrank_lib:dobi-remap@0.6:bf16"}, logs.append)
    assert any("calibration" in s for s in logs) and not any("the bf16 model from" in s for s in logs)
    assert [p["id"] for p in again] == ["lowrank_lib:dobi-remap@0.6:int8"]
    assert again[0]["ppl"] == first["lowrank_lib:dobi-remap@0.6:int8"]["ppl"]
    saved = torch.load(again[0]["file"], weights_only=False)
    n = 0
    for name, lr in lowrank_modules(saved).items():
        for f, ref in ((lr.U, remap_us(lr.dobi_remap)), (lr.V, remap_vt(lr.dobi_remap))):
            q = quantize(ref, 8, 32)
            assert torch.equal(f.data, q.data) and torch.equal(f.scale, q.scale), name
            n += 1
    assert n == 2 * 7 * tiny.config.num_hidden_layers


def test_weights_other_than_bf16_int8_int4_are_refused(tiny, ids):
    with pytest.raises(ValueError, match="int2"):
        _run(tiny, ids, ("bf16", "int2"), None)


def test_factor_bits_flag_and_the_speed_phase_times_only_the_chosen_points(monkeypatch, tmp_path):
    from lowrank_lib.bench import child
    from lowrank_lib.bench.commands import frontier as cmd

    assert cmd.factor_weights([0]) == ("bf16",) and cmd.factor_weights([8, 4, 8]) == ("bf16", "int8", "int4")
    assert cmd.factor_weights([4, "mixed"], gptq=True) == ("bf16", "int4-gptq", "mixed-gptq")
    with pytest.raises(SystemExit):
        cmd.factor_weights([3])
    f = tmp_path / "m.pt"
    f.write_bytes(b"x")
    res = {"points": [_p("llama.cpp:q4_k_m", "llama.cpp", "Q4_K_M", None, "q4_k_m", file=str(f)),
                      _p("lowrank_lib:svdllm@0.8:bf16", file=str(f)),
                      _p("lowrank_lib:svdllm@0.8:int8", weights="int8", file=str(f))]}
    timed = []

    def fake_child(target, point, **kw):
        timed.append(point["id"])
        return {"result": {"1": {"ms_per_token": 1.0}}, "peak_rss": 1, "wall_s": 0.1}

    monkeypatch.setattr(child, "run_child", fake_child)
    a = argparse.Namespace(prompt_len=None, gen_len=[4], threads=[1], repeats=1, graph="none", command_line="c1",
                           points=["SVD-LLM v1 keep 0.8 int8", "llama.cpp Q4_K_M"])
    cmd.speed(a, res, lambda r: None)
    assert timed == ["llama.cpp:q4_k_m", "lowrank_lib:svdllm@0.8:int8"]
    assert "speed" not in res["points"][1] and res["points"][2]["speed"]["1"]["ms_per_token"] == 1.0
    (s1,) = res["sittings"]
    assert s1["id"] == 1 and s1["command"] == "c1" and s1["reference"] == "llama.cpp:q4_k_m" and s1["threads"] == [1]
    assert s1["points"] == ["llama.cpp:q4_k_m", "lowrank_lib:svdllm@0.8:int8"] and s1["reference_speed"]
    # a second sitting: its reference is timed first even though not asked for, and only as the sitting's reference
    timed.clear()
    a.points, a.command_line = ["SVD-LLM v1 keep 0.8 bf16"], "c2"
    cmd.speed(a, res, lambda r: None)
    assert timed == ["llama.cpp:q4_k_m", "lowrank_lib:svdllm@0.8:bf16"]
    s2 = res["sittings"][1]
    assert s2["id"] == 2 and s2["points"] == ["lowrank_lib:svdllm@0.8:bf16"] and s2["reference_speed"]
    assert [p.get("sitting") for p in res["points"]] == [1, 2, 1]
    a.points = ["no such point"]
    with pytest.raises(SystemExit, match="no such point"):
        cmd.speed(a, res, lambda r: None)
    assert len(res["sittings"]) == 2                    # a refused run opens no sitting
