"""Dobi-SVD remap served from its 8-bit codes (issue 30): ``load_checkpoint(path, factor_bits=8)`` requantizes each
factor from the file's codes while streaming. Every served factor must be exactly ``quantize`` of the factor Dobi's
own loader widens to fp16, the model must equal the widened model quantized afterwards, the engine must serve it
like any quantized model, a rewrite must give back the file's codes byte for byte, and bad requests must fail
clearly."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import families, load_checkpoint, models, quantize_factors
from lowrank_lib.compress import collect_stats
from lowrank_lib.data import random_token_batches
from lowrank_lib.factorized import lowrank_modules
from lowrank_lib.formats import CheckpointError, write_native
from lowrank_lib.quant import QuantizedTensor, quantize
from lowrank_lib.runtime import Engine, EngineConfig, run_generation
from lowrank_lib.runtime.baselines import HFRunner


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Dobi remap (a GQA model: tall, wide and square projections, so both kinds of tail) and SVD-LLM files."""
    d = tmp_path_factory.mktemp("dobi_served")
    m = models.tiny_model("tiny-gqa", seed=0)
    stats = collect_stats(m, random_token_batches(256, 4, 32), progress=False)
    return {fam: write_native(families.get(fam).compress(m, stats, 0.6, progress=False), fam, d / fam)
            for fam in ("dobi-remap", "svdllm")}


@pytest.mark.parametrize("bits, group", [(8, 32), (8, 128), (4, 64)])
def test_every_served_factor_is_quantize_of_the_widened_factor(files, bits, group):
    widened = load_checkpoint(files["dobi-remap"], progress=False)
    served = load_checkpoint(files["dobi-remap"], progress=False, factor_bits=bits, factor_group=group)
    assert served.lowrank_meta["quant"] == {"bits": bits, "group": group, "from": "dobi-remap codes"}
    wm, sm = lowrank_modules(widened), lowrank_modules(served)
    assert wm.keys() == sm.keys() and len(sm) == 7 * widened.config.num_hidden_layers
    tails = set()
    for name, lr in sm.items():
        for side in ("U", "V"):
            f, ref = getattr(lr, side), quantize(getattr(wm[name], side).detach(), bits, group)
            assert isinstance(f, QuantizedTensor) and (f.bits, f.group, f.shape) == (bits, group, ref.shape)
            assert torch.equal(f.data, ref.data) and torch.equal(f.scale, ref.scale), (name, side)
        tails.add((lr.out_features > lr.in_features) - (lr.out_features < lr.in_features))
    assert tails == {-1, 0, 1}, "the fixture must hold tall, wide and square projections"
    # the rest of the model is the widened model's, tensor for tensor
    fact = {f"{n}.{s}" for n in sm for s in ("U", "V", "U.data", "U.scale", "V.data", "V.scale")}
    wsd = {k: v for k, v in widened.state_dict().items() if k not in fact}
    ssd = {k: v for k, v in served.state_dict().items() if k not in fact}
    assert wsd.keys() == ssd.keys() and all(torch.equal(wsd[k], ssd[k]) for k in wsd)


def test_served_logits_equal_the_widened_model_quantized_after_loading(files):
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    served = load_checkpoint(files["dobi-remap"], progress=False, factor_bits=8, dtype=torch.float32)
    after = quantize_factors(load_checkpoint(files["dobi-remap"], progress=False, dtype=torch.float32), 8, 32)
    with torch.no_grad():
        assert torch.equal(served(ids).logits, after(ids).logits)


def test_the_engine_serves_the_requantized_model_as_transformers_does(files):
    model = load_checkpoint(files["dobi-remap"], progress=False, factor_bits=8, dtype=torch.float32)
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    ref = run_generation(HFRunner(model, "dynamic"), ids, 8, None, return_logits=True)
    for kernels in ("portable", "auto"):
        out = run_generation(Engine(model, EngineConfig(max_seq_len=32, kernels=kernels)), ids, 8, None,
                             return_logits=True)
        assert torch.equal(out.tokens, ref.tokens), kernels
        err = max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits))
        assert err < 1e-3 * max(float(a.abs().max()) for a in ref.logits), (kernels, err)


def test_a_served_model_rewrites_the_files_codes_byte_for_byte(files, tmp_path):
    served = load_checkpoint(files["dobi-remap"], progress=False, factor_bits=8)
    again = write_native(served, "dobi-remap", tmp_path / "again")
    a = torch.load(files["dobi-remap"] / "remapping_weight.pt", weights_only=True, map_location="cpu")
    b = torch.load(again / "remapping_weight.pt", weights_only=True, map_location="cpu")
    assert a.keys() == b.keys()
    for name in a:
        for k in ("us_quan", "vt_quan", "us_absmax", "vt_absmax"):
            assert torch.equal(a[name][k], b[name][k]), (name, k)
        ta, tb = a[name]["tuple_info"], b[name]["tuple_info"]
        assert (ta is None) == (tb is None) and (ta is None or (ta[0] == tb[0] and torch.equal(ta[1], tb[1])))
    # without the codes (dropped from the modules) the served factors are encoded from their dequantized values
    for lr in lowrank_modules(served).values():
        del lr.dobi_remap
    encoded = load_checkpoint(write_native(served, "dobi-remap", tmp_path / "encoded"), progress=False)
    assert set(lowrank_modules(encoded)) == set(lowrank_modules(served))


def test_other_families_are_read_then_quantized(files):
    served = load_checkpoint(files["svdllm"], progress=False, factor_bits=4, factor_group=32)
    ref = quantize_factors(load_checkpoint(files["svdllm"], progress=False), 4, 32)
    assert served.lowrank_meta["quant"] == {"bits": 4, "group": 32}
    for (n, a), (_, b) in zip(lowrank_modules(served).items(), lowrank_modules(ref).items()):
        for side in ("U", "V"):
            assert torch.equal(getattr(a, side).data, getattr(b, side).data), (n, side)


@pytest.mark.parametrize("kw, says", [({"factor_bits": 5}, "factor_bits=5"),
                                      ({"factor_bits": 8, "factor_group": 48}, "factor_group=48"),
                                      ({"factor_bits": True}, "factor_bits=True")])
def test_bad_bits_or_group_fail_before_reading(files, kw, says):
    with pytest.raises(CheckpointError, match=says):
        load_checkpoint(files["dobi-remap"], progress=False, **kw)
    with pytest.raises(CheckpointError, match=says) as e:               # the reader called directly says the same
        families.get("dobi-remap").read(files["dobi-remap"], **kw)
    assert "bug" not in str(e.value)


def test_a_non_finite_tail_fails_naming_the_entry(files, tmp_path):
    import shutil

    bad = tmp_path / files["dobi-remap"].name
    shutil.copytree(files["dobi-remap"], bad)
    entries = torch.load(bad / "remapping_weight.pt", weights_only=True, map_location="cpu")
    name = next(n for n, e in entries.items() if e["tuple_info"] is not None)
    kind, tail = entries[name]["tuple_info"]
    tail = tail.clone()
    tail[0, 0] = float("nan")
    entries[name]["tuple_info"] = (kind, tail)
    torch.save(entries, bad / "remapping_weight.pt")
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_checkpoint(bad, progress=False, factor_bits=8)
