"""Quantized factors in the ONE representation (issue 30): ``quantize_factors`` on a LowRankLinear model, its
forward (the portable qmatmul on both stages), shared bases, byte accounting, and the normalised format's round
trip (identical logits, codes never widened)."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import lowrank_lib
from lowrank_lib import LowRankLinear, account, factorize, quantize_factors, replace_with_factors, shared_groups
from lowrank_lib.quant import QuantizedTensor, dequantize, qmatmul, quantized_nbytes


@pytest.fixture
def lr_model():
    from lowrank_lib import models

    m = models.tiny_model("tiny-mha", seed=0)
    return factorize(m, keep=0.6)


def _shared_basis_model():
    """tiny-mha with q_proj of layers 0 and 1 sharing one V (a Basis Sharing group)."""
    from lowrank_lib import models

    m = models.tiny_model("tiny-mha", seed=1)
    q0 = m.model.layers[0].self_attn.q_proj
    r, d = 24, q0.in_features
    basis = nn.Parameter(torch.randn(r, d) * 0.2, requires_grad=False)
    lr0 = LowRankLinear(torch.randn(q0.out_features, r) * 0.2, basis)
    lr1 = LowRankLinear(torch.randn(q0.out_features, r) * 0.2, basis)
    return replace_with_factors(m, {"model.layers.0.self_attn.q_proj": lr0, "model.layers.1.self_attn.q_proj": lr1},
                                {"family": "test"})


def test_package_exports_quantize_factors():
    assert lowrank_lib.quantize_factors is quantize_factors and lowrank_lib.QuantizedTensor is QuantizedTensor
    assert "quantize_factors" in lowrank_lib.__all__


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_forward_is_qmatmul_on_both_stages(lr_model, bits):
    ref = copy.deepcopy(lr_model)
    quantize_factors(lr_model, bits, 32)
    assert lr_model.lowrank_meta["quant"] == {"bits": bits, "group": 32}
    m = lr_model.model.layers[1].mlp.down_proj
    assert isinstance(m, LowRankLinear) and m.quantized
    assert isinstance(m.U, QuantizedTensor) and isinstance(m.V, QuantizedTensor) and m.U.bits == bits
    x = torch.randn(2, 5, m.in_features)
    assert torch.equal(m(x), qmatmul(qmatmul(x, m.V), m.U))
    bx = x.to(torch.bfloat16)
    assert m(bx).dtype == torch.bfloat16 and torch.equal(m(bx), qmatmul(qmatmul(bx, m.V), m.U))
    # close to the unquantized factors, and the same map as the dequantized ones
    r = ref.model.layers[1].mlp.down_proj
    dense = x @ (dequantize(m.U) @ dequantize(m.V)).t()
    assert torch.allclose(m(x), dense, rtol=1e-3, atol=1e-4 * float(dense.abs().max()))
    assert torch.allclose(m.dense_weight(), r.dense_weight(), atol=(0.02 if bits == 8 else 0.3) *
                          float(r.dense_weight().abs().max()))
    ids = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        a, b = ref(ids).logits, lr_model(ids).logits
    err = float((a - b).abs().max() / a.abs().max())
    assert err < (0.02 if bits == 8 else 0.6), err


def test_quantize_factors_keeps_a_shared_basis_one_object_and_counts_real_bytes():
    m = _shared_basis_model()
    before = account(m)
    quantize_factors(m, 8, 32)
    q0, q1 = m.model.layers[0].self_attn.q_proj, m.model.layers[1].self_attn.q_proj
    assert isinstance(q0.V, QuantizedTensor) and q0.V is q1.V
    assert shared_groups(m) == [["model.layers.0.self_attn.q_proj.V", "model.layers.1.self_attn.q_proj.V"]]
    after = account(m)
    assert after.linear_params == before.linear_params and after.shared_params_saved == before.shared_params_saved
    lr = [mod for mod in m.modules() if isinstance(mod, LowRankLinear)]
    factors = {id(f): f for mod in lr for f in (mod.U, mod.V)}.values()
    assert len(factors) == 2 * len(lr) - 1                       # the shared V once
    want = sum(quantized_nbytes(*f.shape, 8, 32) for f in factors)
    dense = [mod for n, mod in m.named_modules() if isinstance(mod, nn.Linear) and n.rsplit(".", 1)[-1] in
             lowrank_lib.LLAMA_PROJ]
    want += sum(d.weight.numel() * d.weight.element_size() for d in dense)
    assert after.linear_bytes == want
    assert before.total_bytes - after.total_bytes == before.linear_bytes - after.linear_bytes
    # the shared quantized basis drives both layers
    with torch.no_grad():
        q0.V.scale.zero_()
    assert q1(torch.randn(1, 3, q1.in_features)).abs().max() == 0


def test_quantize_factors_refuses_twice_and_bad_arguments(lr_model):
    with pytest.raises(ValueError, match="bits=5"):
        quantize_factors(lr_model, 5, 32)
    assert not any(m.quantized for m in lr_model.modules() if isinstance(m, LowRankLinear))   # unchanged
    quantize_factors(lr_model, 4, 64)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_factors(lr_model, 8, 32)


def test_quantize_factors_names_the_unquantizable_factor(lr_model):
    lr_model.model.layers[1].self_attn.o_proj.U.data[3, 2] = float("nan")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.o_proj\.U: .*NaN"):
        quantize_factors(lr_model, 8, 32)
    assert not isinstance(lr_model.model.layers[0].self_attn.q_proj.U, QuantizedTensor)   # nothing half-done


def test_quantized_model_moves_and_casts_without_touching_codes(lr_model):
    quantize_factors(lr_model, 4, 32)
    m = lr_model.to(torch.bfloat16)
    q = m.model.layers[0].mlp.up_proj.U
    assert q.scale.dtype == torch.float16 and q.data.dtype == torch.uint8
    assert m(torch.randint(0, 256, (1, 6))).logits.dtype == torch.bfloat16


# --------------------------------------------------------------------------- the normalised format
@pytest.mark.parametrize("bits, group", [(8, 32), (4, 64)])
def test_saved_and_loaded_quantized_model_gives_identical_logits(tmp_path, bits, group):
    from lowrank_lib.formats import lowrank as fmt

    m = _shared_basis_model()
    factorize(m, keep=0.5, targets=("k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    quantize_factors(m, bits, group)
    fmt.save(m, tmp_path / "q")
    back = fmt.read(tmp_path / "q")
    ids = torch.randint(0, 256, (2, 9))
    assert torch.equal(m(ids).logits, back(ids).logits)
    for name, mod in m.named_modules():
        if isinstance(mod, LowRankLinear):
            b = back.get_submodule(name)
            for side in ("U", "V"):
                a, c = getattr(mod, side), getattr(b, side)
                assert isinstance(c, QuantizedTensor) and (c.bits, c.group, c.shape) == (a.bits, a.group, a.shape)
                assert c.data.dtype == a.data.dtype and torch.equal(c.data, a.data)     # never widened
                assert c.scale.dtype == torch.float16 and torch.equal(c.scale, a.scale)
    q0, q1 = back.model.layers[0].self_attn.q_proj, back.model.layers[1].self_attn.q_proj
    assert q0.V is q1.V                                           # the shared basis is one object again
    assert back.lowrank_meta["quant"] == {"bits": bits, "group": group}
    assert account(back).linear_bytes == account(m).linear_bytes
    # a dtype asked for at load casts the dense tensors only
    half = fmt.read(tmp_path / "q", dtype=torch.bfloat16)
    assert half.model.layers[0].mlp.up_proj.U.data.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert half.model.layers[0].mlp.up_proj.U.scale.dtype == torch.float16


def test_quantized_file_stores_codes_and_scales_as_their_own_tensors(tmp_path):
    import json

    from safetensors import safe_open

    from lowrank_lib.formats import lowrank as fmt

    m = factorize(copy.deepcopy(_shared_basis_model()), keep=0.5, targets=("down_proj",))
    quantize_factors(m, 4, 32)
    fmt.save(m, tmp_path / "q")
    man = json.loads((tmp_path / "q" / fmt.MANIFEST).read_text())
    f = man["factors"]["model.layers.1.mlp.down_proj"]
    assert f["quant"]["U"]["bits"] == 4 and f["quant"]["U"]["group"] == 32
    with safe_open(str(tmp_path / "q" / fmt.WEIGHTS), "pt") as sf:
        assert sf.get_slice(f["U"]).get_dtype() == "U8" and sf.get_slice(f["quant"]["U"]["scale"]).get_dtype() == "F16"
    # a scale tensor of the wrong dtype / shape is refused by name
    f["quant"]["V"]["group"] = 64
    (tmp_path / "q" / fmt.MANIFEST).write_text(json.dumps(man))
    from lowrank_lib.formats.errors import CheckpointError

    with pytest.raises(CheckpointError, match="down_proj"):
        fmt.read(tmp_path / "q")


# --------------------------------------------------------------------------- quality measurement
def test_quant_rows_on_a_tiny_model(lr_model):
    from lowrank_lib.eval.quant_quality import dequantized, pick_group, quant_rows, rounded_factors

    U = lr_model.model.layers[0].mlp.up_proj.U
    R = rounded_factors(lr_model).model.layers[0].mlp.up_proj.U
    assert R.dtype == U.dtype and torch.equal(R, U.bfloat16().float()) and not torch.equal(R, U)

    ids = torch.randint(0, 256, (2 * 48,), generator=torch.Generator().manual_seed(0))
    rows = quant_rows(lr_model, ids, [(8, 32), (4, 32)], seq_len=48, windows=2, check_tokens=24)
    assert [r["factors"] for r in rows] == ["fp32", "bf16", "int8_g32", "int4_g32"]
    by = {r["factors"]: r for r in rows}
    assert by["bf16"]["rel_to_bf16"] == 0 and abs(by["fp32"]["rel_to_bf16"]) < 0.01
    assert abs(by["int8_g32"]["rel_to_bf16"]) < abs(by["int4_g32"]["rel_to_bf16"])
    assert by["int8_g32"]["linear_bytes"] < by["bf16"]["linear_bytes"] and by["fp32"]["linear_bytes"] == \
        2 * by["bf16"]["linear_bytes"]
    for r in rows[2:]:        # the spec's product and the dequantized prefill math: the same perplexity
        c = r["check"]
        assert abs(c["ppl_qmatmul"] / c["ppl_dequantized"] - 1) < 1e-3
    assert pick_group(rows, 8, 1.0) == 32 and pick_group(rows, 4, -1.0) is None
    # the dequantized copy keeps the model's own factors quantized and a shared factor shared
    q = quantize_factors(copy.deepcopy(lr_model), 8, 32)
    d = dequantized(q)
    assert isinstance(q.model.layers[0].mlp.up_proj.U, QuantizedTensor)
    assert torch.equal(d.model.layers[0].mlp.up_proj.U, dequantize(q.model.layers[0].mlp.up_proj.U))


def test_head_rows_score_the_copy_the_approximate_head_serves(lr_model):
    """``head_rows``: the exact head first (agreement 1, +0 %), then q8 / q4 with fewer head bytes and an agreement
    that falls with the bits; the replaced head is the one ``Engine(lm_head="q8")`` decodes with (its logits within
    the activation rounding of the copy's, the same argmax), and the model passed in keeps its own head."""
    from lowrank_lib.eval.quant_quality import head_rows, with_head
    from lowrank_lib.quant import dequantize, quantize
    from lowrank_lib.runtime import Engine, EngineConfig, run_generation

    ids = torch.randint(0, 256, (2 * 48,), generator=torch.Generator().manual_seed(0))
    W0 = lr_model.get_output_embeddings().weight.detach().clone()
    rows = head_rows(lr_model, ids, seq_len=48, windows=2)
    assert [r["head"] for r in rows] == ["exact", "q8", "q4"]
    assert rows[0]["argmax_agreement"] == 1.0 and rows[0]["rel_to_exact"] == 0
    assert rows[0]["head_bytes"] > rows[1]["head_bytes"] > rows[2]["head_bytes"]
    assert 1.0 >= rows[1]["argmax_agreement"] >= rows[2]["argmax_agreement"] > 0
    assert abs(rows[1]["rel_to_exact"]) < abs(rows[2]["rel_to_exact"]) + 1e-9
    assert torch.equal(lr_model.get_output_embeddings().weight, W0)
    # the copy scored is what the q8 head serves at decode
    m8 = with_head(lr_model, dequantize(quantize(W0.float(), 8, 64)))
    prompt = ids[:16][None]
    g = run_generation(Engine(lr_model, EngineConfig(max_batch=1, max_seq_len=32, lm_head="q8")), prompt, 3,
                       return_logits=True)
    with torch.no_grad():
        ref = m8(torch.cat([prompt, g.tokens[:, :2]], 1)).logits[0, -2:]
    got = torch.cat(g.logits[1:])
    assert torch.allclose(got, ref, atol=2e-3 * ref.abs().max().item()), (got - ref).abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def _newest_quant_quality():
    """The newest sitting of the README's quant-quality run (``ResultFiles`` numbers a rerun ``_2``, ``_3``, ...)."""
    from pathlib import Path

    found = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob(
        "quant_quality_smollm2_keep0.8_w4x2048*.json"), key=lambda p: (len(p.name), p.name))
    assert found, "no committed quant_quality_smollm2_keep0.8_w4x2048*.json"
    return found[-1]


def test_default_group_is_the_measured_choice():
    import json

    from lowrank_lib.quant import DEFAULT_GROUP

    res = json.loads(_newest_quant_quality().read_text())
    assert res["complete"] and res["chosen_group"]["int8"] == DEFAULT_GROUP
    rows = {r["factors"]: r for r in res["rows"]}
    assert rows[f"int8_g{DEFAULT_GROUP}"]["rel_to_bf16"] <= res["target_int8"]


def test_readme_quant_table_equals_the_json():
    import json
    import re
    from pathlib import Path

    from lowrank_lib.eval.quant_quality import label

    root = Path(__file__).resolve().parents[1]
    res = json.loads(_newest_quant_quality().read_text())
    text = (root / "README.md").read_text()
    sec = text[text.index("### Quantized factors (issue 30)"):]
    sec = sec[:sec.index("Mixed widths (")]                 # its own run: test_quant_gptq.py
    table = [ln for ln in sec.splitlines() if re.match(r"\| (fp32|bf16|int)", ln)]
    assert len(table) == len(res["rows"])
    for ln, r in zip(table, res["rows"]):
        cells = [c.strip() for c in ln.strip("|").split("|")]
        name = label(r)
        assert cells[0].startswith(name), (cells[0], name)
        ppl = float(cells[1])
        assert abs(ppl - r["ppl"]) <= 0.5 * 10 ** -(len(cells[1].split(".")[1]) if "." in cells[1] else 0) + 1e-9
        assert cells[3] == f"{r['linear_bytes'] / 1e6:.1f} MB"
        if cells[2]:
            pct = float(cells[2].strip("*").replace(" %", ""))
            digits = len(cells[2].strip("*").replace(" %", "").split(".")[1]) if "." in cells[2] else 0
            assert abs(pct - 100 * r["rel_to_bf16"]) <= 0.5 * 10 ** -digits + 1e-9, (cells, r)
