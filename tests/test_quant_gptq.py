"""GPTQ codes for quantized factors (issue 30): ``quant.gptq`` and ``quantize_factors(..., stats=...)``.

The storage is the spec's (``quant.quantize``'s): only which codes are stored changes, so every kernel, the file
format and the engine serve them unchanged. What would catch a real bug: with a diagonal input moment nothing is
spread and the codes equal rounding to nearest, bit for bit; with correlated inputs the output error is smaller;
a shared factor uses its layers' summed moments; hostile arguments are refused by name."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from lowrank_lib import LowRankLinear, factorize, models, quantize_factors, replace_with_factors
from lowrank_lib.compress.calib import collect_stats
from lowrank_lib.quant import QMAX, QuantizedTensor, dequantize, gptq, quantize


def _correlated(n: int, d: int, seed: int) -> torch.Tensor:
    """[n, d] inputs with correlated channels and a few outlier channels, as a projection's inputs have."""
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d, generator=g) @ torch.randn(d, d, generator=g) * 0.4 + torch.randn(n, d, generator=g)
    X[:, torch.randperm(d, generator=g)[:3]] *= 8
    return X


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("shape,group", [((40, 100), 32), ((17, 64), 64), ((9, 300), 128), ((5, 257), 256)])
def test_a_diagonal_moment_gives_the_codes_of_rounding_to_nearest(bits, shape, group):
    g = torch.Generator().manual_seed(shape[1])
    W = torch.randn(*shape, generator=g)
    H = torch.diag(torch.rand(shape[1], generator=g) + 0.5)
    a, b = quantize(W, bits, group), gptq(W, H, bits, group)
    assert torch.equal(a.data, b.data) and torch.equal(a.scale, b.scale)
    assert (b.bits, b.group, tuple(b.shape)) == (bits, group, shape)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_correlated_inputs_get_a_smaller_output_error_than_rounding(bits, seed):
    """The objective GPTQ minimises, ||(W - deq) X^T||, on held-out inputs of the same distribution; the codes are
    valid spec codes (in [-qmax, qmax], fp16 scales) that decode as :func:`dequantize` says."""
    d, out = 96, 48
    X, Xt = _correlated(6000, d, seed).split([4000, 2000])
    W = torch.randn(out, d, generator=torch.Generator().manual_seed(seed))
    q = gptq(W, X.T @ X, bits, 32)
    err_g = ((W - dequantize(q)) @ Xt.T).norm()
    err_r = ((W - dequantize(quantize(W, bits, 32))) @ Xt.T).norm()
    assert err_g < 0.9 * err_r, (float(err_g), float(err_r))
    codes = q.codes()
    assert codes.abs().max() <= QMAX[bits] and q.scale.dtype == torch.float16
    want = (codes.float().view(out, -1, 32) * q.scale.float()[..., None]).view(out, -1)[:, :d]
    assert torch.equal(dequantize(q), want)


def test_an_input_never_seen_and_an_indefinite_moment_are_handled():
    W = torch.randn(8, 64)
    X = torch.randn(200, 64)
    X[:, 5] = 0                                   # a dead channel: its weights meet only zeros
    q = gptq(W, X.T @ X, 4, 32)
    assert torch.isfinite(dequantize(q)).all() and int(q.codes()[:, 5].abs().max()) == 0
    H = 1001 * torch.eye(64) - 1000               # positive diagonal, far from positive definite: refused
    with pytest.raises(ValueError, match="positive definite"):
        gptq(W, H, 8, 32)


def test_hostile_arguments_are_refused_by_name():
    W, H = torch.randn(8, 64), torch.eye(64)
    with pytest.raises(ValueError, match=r"H \[in, in\]"):
        gptq(W, torch.eye(63), 8, 32)
    with pytest.raises(ValueError, match="bits=3"):
        gptq(W, H, 3, 32)
    with pytest.raises(ValueError, match="group=48"):
        gptq(W, H, 8, 48)
    bad = W.clone()
    bad[2, 7] = float("nan")
    with pytest.raises(ValueError, match=r"NaN / Inf entries \(first at \[2, 7\]\)"):
        gptq(bad, H, 8, 32)
    Hn = H.clone()
    Hn[3, 3] = float("inf")
    with pytest.raises(ValueError, match="H has NaN"):
        gptq(W, Hn, 8, 32)
    with pytest.raises(ValueError, match="2-D float"):
        gptq(W.to(torch.int32), H, 8, 32)


@pytest.fixture
def lr_model():
    return factorize(models.tiny_model("tiny-mha", seed=0), keep=0.6)


def test_quantize_factors_with_stats_is_gptq_per_factor_v_first(lr_model):
    """Each V from its input moment, each U from deq(V) H deq(V)^T; the metadata says so; the forward is the spec's
    product of the stored codes (every kernel serves them: same storage)."""
    ids = torch.randint(0, 256, (4, 48), generator=torch.Generator().manual_seed(0))
    st = collect_stats(lr_model, ids, progress=False)
    q = quantize_factors(copy.deepcopy(lr_model), 4, 32, stats=st)
    assert q.lowrank_meta["quant"] == {"bits": 4, "group": 32, "method": "gptq"}
    name = "model.layers.1.mlp.down_proj"
    m, m0 = q.get_submodule(name), lr_model.get_submodule(name)
    H = st[name].xtx
    Vq = gptq(m0.V.detach(), H, 4, 32)
    assert torch.equal(m.V.data, Vq.data) and torch.equal(m.V.scale, Vq.scale)
    Vd = Vq.dequantize(torch.float64)
    Uq = gptq(m0.U.detach(), Vd @ H.double() @ Vd.T, 4, 32)
    assert torch.equal(m.U.data, Uq.data) and torch.equal(m.U.scale, Uq.scale)
    # different codes from rounding to nearest somewhere (the moments are not diagonal)
    r = quantize_factors(copy.deepcopy(lr_model), 4, 32)
    assert not torch.equal(r.get_submodule(name).U.data, m.U.data)


def test_a_shared_factor_is_quantized_once_for_its_layers_summed_moment():
    base = models.tiny_model("tiny-mha", seed=1)
    q0 = base.model.layers[0].self_attn.q_proj
    r, d = 24, q0.in_features
    g = torch.Generator().manual_seed(1)
    basis = nn.Parameter(torch.randn(r, d, generator=g) * 0.2, requires_grad=False)
    lr0 = LowRankLinear(torch.randn(q0.out_features, r, generator=g) * 0.2, basis)
    lr1 = LowRankLinear(torch.randn(q0.out_features, r, generator=g) * 0.2, basis)
    names = ["model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"]
    m = replace_with_factors(base, dict(zip(names, (lr0, lr1))), {"family": "test"})
    st = collect_stats(m, torch.randint(0, 256, (2, 32), generator=g), progress=False)
    quantize_factors(m, 8, 32, stats=st)
    a, b = (m.get_submodule(n) for n in names)
    assert isinstance(a.V, QuantizedTensor) and a.V is b.V
    want = gptq(basis.detach(), st[names[0]].xtx.double() + st[names[1]].xtx.double(), 8, 32)
    assert torch.equal(a.V.data, want.data) and torch.equal(a.V.scale, want.scale)


def test_stats_that_do_not_fit_the_model_are_refused_by_name_and_nothing_changes(lr_model):
    """A projection without statistics, and one whose moment has another width (statistics of another model), are
    ValueErrors naming the projection; the model keeps its unquantized factors either way."""
    from lowrank_lib.compress.calib import LayerStats

    before = copy.deepcopy(lr_model.state_dict())
    st = collect_stats(lr_model, torch.randint(0, 256, (1, 16)), progress=False)
    del st.stats["model.layers.0.self_attn.q_proj"]
    with pytest.raises(ValueError, match=r"no entry for \['model\.layers\.0\.self_attn\.q_proj'"):
        quantize_factors(lr_model, 8, 32, stats=st)
    st = collect_stats(lr_model, torch.randint(0, 256, (1, 16)), progress=False)
    st.stats["model.layers.1.mlp.down_proj"] = LayerStats(torch.eye(7, dtype=torch.float64),
                                                           torch.zeros(7, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.V: gptq needs H \[in, in\]"):
        quantize_factors(lr_model, 8, 32, stats=st)
    assert not any(isinstance(f, QuantizedTensor) for mod in lr_model.modules() if isinstance(mod, LowRankLinear)
                   for f in (mod.U, mod.V))
    after = lr_model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_a_gptq_model_round_trips_through_the_normalised_format(lr_model, tmp_path):
    from lowrank_lib.formats import lowrank as fmt

    st = collect_stats(lr_model, torch.randint(0, 256, (2, 32)), progress=False)
    q = quantize_factors(lr_model, 4, 64, stats=st)
    fmt.save(q, tmp_path / "q")
    back = fmt.read(tmp_path / "q")
    assert back.lowrank_meta["quant"] == {"bits": 4, "group": 64, "method": "gptq"}
    ids = torch.randint(0, 256, (1, 20))
    with torch.no_grad():
        assert torch.equal(q(ids).logits, back(ids).logits)


def test_quant_rows_add_a_gptq_row_per_config_and_the_group_choice_stays_on_plain_rounding(lr_model):
    from lowrank_lib.eval.quant_quality import label, pick_group, quant_rows

    ids = torch.randint(0, 256, (2 * 32,), generator=torch.Generator().manual_seed(0))
    st = collect_stats(lr_model, ids.view(2, 32), progress=False)
    rows = quant_rows(lr_model, ids, [(8, 32), ("mixed", 32)], seq_len=32, windows=2, stats=st)
    assert [r["factors"] for r in rows] == ["fp32", "bf16", "int8_g32", "int8_g32_gptq", "mixed_g32", "mixed_g32_gptq"]
    assert [label(r) for r in rows[2:]] == ["int8, group 32", "int8, group 32, GPTQ", "int4 / int8 mixed, group 32",
                                            "int4 / int8 mixed, group 32, GPTQ"]
    assert rows[5]["linear_bytes"] < rows[2]["linear_bytes"]     # mixed: fewer bytes than int8 everywhere
    rows = rows[:4]
    assert [r["method"] for r in rows[2:]] == ["rtn", "gptq"] and rows[2]["linear_bytes"] == rows[3]["linear_bytes"]
    rows[2]["rel_to_bf16"] = 1.0                    # plain rounding misses the target: GPTQ's row does not count
    assert pick_group(rows, 8, 0.5) is None and pick_group(rows, 8, 10.0, method="gptq") == 32


def test_widths_per_projection_type(lr_model):
    """``bits`` as ``{type or "*": bits}``: each factor at its type's width, recorded in the metadata; unknown types,
    a projection without a width, a shared factor given two widths and a bad width are refused by name."""
    from lowrank_lib import MIXED_4_8

    q = quantize_factors(copy.deepcopy(lr_model), MIXED_4_8, 32)
    assert q.lowrank_meta["quant"] == {"bits": MIXED_4_8, "group": 32}
    for name, mod in q.named_modules():
        if isinstance(mod, LowRankLinear):
            want = 8 if name.rsplit(".", 1)[-1] in ("q_proj", "k_proj", "v_proj", "down_proj") else 4
            assert mod.U.bits == mod.V.bits == want, name
    with pytest.raises(ValueError, match=r"bits keys \['qproj'\]"):
        quantize_factors(copy.deepcopy(lr_model), {"qproj": 8, "*": 4}, 32)
    with pytest.raises(ValueError, match=r"no width for model\.layers\.0\.self_attn\.k_proj"):
        quantize_factors(copy.deepcopy(lr_model), {"q_proj": 8, "v_proj": 8, "o_proj": 4, "gate_proj": 4,
                                                   "up_proj": 4, "down_proj": 4}, 32)
    with pytest.raises(ValueError, match=r"o_proj\.V: bits=5"):
        quantize_factors(copy.deepcopy(lr_model), {"o_proj": 5, "*": 4}, 32)
    base = models.tiny_model("tiny-mha", seed=1)
    basis = nn.Parameter(torch.randn(16, base.config.hidden_size) * 0.2, requires_grad=False)
    out = base.model.layers[0].self_attn.q_proj.out_features
    m = replace_with_factors(base, {"model.layers.0.self_attn.q_proj": LowRankLinear(torch.randn(out, 16), basis),
                                    "model.layers.0.self_attn.k_proj": LowRankLinear(torch.randn(out, 16), basis)},
                             {"family": "test"})
    with pytest.raises(ValueError, match="shared by projections given different bits"):
        quantize_factors(m, {"q_proj": 8, "*": 4}, 32)


def test_readme_mixed_rows_equal_the_json():
    import json
    import re
    from pathlib import Path

    from lowrank_lib.eval.quant_quality import label

    root = Path(__file__).resolve().parents[1]
    res = json.loads((root / "benchmarks/results/quant_quality_smollm2_bitsmixed_keep0.8_w4x2048.json").read_text())
    text = (root / "README.md").read_text()
    sec = text[text.index("Mixed widths (`quantize_factors("):]
    rows = [ln for ln in sec[:sec.index("\n\nSo between")].splitlines() if ln.startswith("| int4 / int8 mixed")]
    want = [r for r in res["rows"] if r.get("bits") == "mixed"]
    assert res["complete"] and len(rows) == len(want) == 2
    for ln, r in zip(rows, want):
        cells = [c.strip().strip("*") for c in ln.strip("|").split("|")]
        assert cells[0] == label(r) and cells[1] == f"{r['ppl']:.2f}"
        assert cells[3] == f"{r['linear_bytes'] / 1e6:.1f} MB"
        assert re.fullmatch(r"\+[\d.]+ %", cells[2]) and float(cells[2][1:-2]) == round(100 * r["rel_to_bf16"], 1)


def test_a_group_whose_scale_overflows_fp16_is_named():
    W = torch.randn(4, 64)
    W[2, 40] = 1e6                                # 1e6 / 7 > fp16's 65504: group 1 of row 2
    with pytest.raises(ValueError, match=r"row 2 group 1 has max \|W\| = 1e\+06 .*overflows fp16"):
        gptq(W, torch.eye(64), 4, 32)
    with pytest.raises(ValueError, match=r"row 2 group 1 .*overflows fp16"):   # rounding to nearest says the same
        quantize(W, 4, 32)
