"""Restricted unpickling and clear errors: malicious pickles never run, bad files are named and refused."""
from __future__ import annotations

import builtins
import json
import os
import subprocess

import pytest
import torch

from lowrank_lib import detect_format, load_checkpoint, models
from lowrank_lib.compress import COMPRESSORS, collect_stats
from lowrank_lib.data import random_token_batches
from lowrank_lib.formats import CheckpointError, UnsafePickleError, write_native
from lowrank_lib.formats.common import fake_class, registered
from lowrank_lib.formats.safe_pickle import Stub, safe_torch_load


class _Evil:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payloads(flag):
    cmd = f"touch {flag}"
    return {
        "posix.system": (os.system, (cmd,)),
        "builtins.eval": (builtins.eval, (f"open({str(flag)!r}, 'w')",)),
        "builtins.exec": (builtins.exec, (f"open({str(flag)!r}, 'w')",)),
        "builtins.getattr": (builtins.getattr, (os, "system")),
        "subprocess.Popen": (subprocess.Popen, (["touch", str(flag)],)),
        "subprocess.call": (subprocess.call, (["touch", str(flag)],)),
    }


@pytest.mark.parametrize("name", list(_payloads("x")))
@pytest.mark.parametrize("protocol", [2, 4])
def test_malicious_pickle_is_refused_and_never_runs(tmp_path, name, protocol):
    flag = tmp_path / "pwned"
    fn, args = _payloads(flag)[name]
    p = tmp_path / "evil.pt"
    if fn is builtins.getattr:
        args = ("text", "upper")     # the global itself is what must be refused
    torch.save({"model": torch.zeros(2), "tokenizer": _Evil(fn, args)}, p, pickle_protocol=protocol)
    mod, _, attr = name.rpartition(".")
    expected = {"builtins": ("builtins", "__builtin__"), "subprocess": ("subprocess", "commands")}.get(mod, (mod,))
    with pytest.raises(UnsafePickleError) as ei:
        safe_torch_load(p)
    assert any(f"'{m}.{attr}'" in str(ei.value) for m in expected), str(ei.value)
    assert str(p) in str(ei.value)
    assert not flag.exists()


def test_malicious_payload_inside_a_real_looking_svdllm_file(tmp_path):
    flag = tmp_path / "pwned"
    attn = fake_class("component.svd_llama.SVD_LlamaAttention")
    p = tmp_path / "model_whitening_only_0.8.pt"
    with registered([attn]):
        torch.save({"model": attn(), "tokenizer": _Evil(os.system, (f"touch {flag}",))}, p)
    assert detect_format(p) == "svdllm"            # detection reads opcodes only: nothing runs
    with pytest.raises(UnsafePickleError, match="posix.system"):
        load_checkpoint(p)
    assert not flag.exists()


def test_codecs_encode_only_latin1(tmp_path):
    import _codecs

    p = tmp_path / "c.pt"
    torch.save({"x": _Evil(_codecs.encode, ("abc", "rot13"))}, p)
    with pytest.raises(UnsafePickleError, match="latin1"):
        safe_torch_load(p)
    torch.save({"b": b"\x00\xffbytes"}, p)          # protocol 2 stores bytes via _codecs.encode(.., 'latin1')
    assert safe_torch_load(p) == {"b": b"\x00\xffbytes"}


def test_known_classes_become_inert_stubs(tmp_path):
    m = models.tiny_model("tiny-gqa")
    p = tmp_path / "m.pt"
    torch.save({"model": m, "tokenizer": None, "s": {1, 2}}, p)
    obj = safe_torch_load(p)
    root = obj["model"]
    assert isinstance(root, Stub) and root.stub_path.endswith("modeling_llama.LlamaForCausalLM")
    assert not isinstance(root, torch.nn.Module) and obj["s"] == {1, 2}
    w = root._modules["lm_head"]._parameters["weight"]
    assert torch.equal(w, m.lm_head.weight.detach())


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    m = models.tiny_model("tiny-gqa", seed=0)
    stats = collect_stats(m, random_token_batches(256, 4, 32), progress=False)
    out = {}
    for fam in ("asvd", "basis_sharing", "palu", "svdllm", "dobi-remap"):
        kw = {"align": 4} if fam == "palu" else {}
        out[fam] = write_native(COMPRESSORS[fam](m, stats, 0.6, progress=False, **kw), fam, d / fam)
    out["lowrank"] = write_native(COMPRESSORS["asvd"](m, stats, 0.6, progress=False), "lowrank", d / "own")
    return out


def _copy(src, dst):
    import shutil

    return shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)


def test_missing_tensor_is_named(ckpts, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(ckpts["asvd"], tmp_path / "a")
    sd = load_file(str(d / "model.safetensors"))
    del sd["model.layers.1.mlp.up_proj.BLinear.weight"]
    save_file(sd, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.BLinear\.weight.*missing"):
        load_checkpoint(d)


def test_rank_mismatch_names_tensor_and_shapes(ckpts, tmp_path):
    d = _copy(ckpts["asvd"], tmp_path / "a")
    cfg = json.loads((d / "config.json").read_text())
    cfg["truncation_ranks"]["model.layers.0.self_attn.q_proj"] += 1
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"q_proj.*ALinear \(64, \d+\).*truncation_ranks says rank"):
        load_checkpoint(d)
    d = _copy(ckpts["palu"], tmp_path / "p")
    cfg = json.loads((d / "config.json").read_text())
    cfg["head_wise_ranks"]["model.layers.1.self_attn.v_proj"][0] += 4
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"v_proj\.VT\.weight' has shape \(\d+, 64\), expected"):
        load_checkpoint(d)


def test_wrong_dense_shape_is_named(ckpts, tmp_path):
    d = _copy(ckpts["palu"], tmp_path / "p")
    cfg = json.loads((d / "config.json").read_text())
    cfg["vocab_size"] = 300
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"embed_tokens\.weight' has shape \(256, 64\), expected \(300, 64\)"):
        load_checkpoint(d)


def test_truncated_files_are_refused(ckpts, tmp_path):
    for fam, target in (("asvd", "model.safetensors"), ("lowrank", "model.safetensors"),
                        ("basis_sharing", "pytorch_model.bin")):
        d = _copy(ckpts[fam], tmp_path / fam)
        f = d / target
        f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
        with pytest.raises((CheckpointError, ValueError), match="truncated|corrupt"):
            load_checkpoint(d)
    f = _copy(ckpts["svdllm"], tmp_path / "s.pt")
    with open(f, "r+b") as fh:
        fh.truncate(os.path.getsize(f) // 2)
    with pytest.raises((CheckpointError, ValueError)):
        load_checkpoint(f, family="svdllm")


def test_basis_alias_mismatch_is_refused(ckpts, tmp_path):
    d = _copy(ckpts["basis_sharing"], tmp_path / "b")
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    sd["model.q_basis.1.weight"] = sd["model.q_basis.1.weight"].clone() + 1e-3
    torch.save(sd, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"model\.q_basis\.1\.weight.*differ.*refusing"):
        load_checkpoint(d)
    sd["model.q_basis.1.weight"] = sd["model.layers.0.self_attn.q_basis.weight"].clone()   # equal copy: fine
    torch.save(sd, d / "pytorch_model.bin")
    r = load_checkpoint(d)
    assert r.model.layers[0].self_attn.q_proj.V is r.model.layers[1].self_attn.q_proj.V


def test_dobi_remap_bad_entry(ckpts, tmp_path):
    d = _copy(ckpts["dobi-remap"], tmp_path / "r")
    e = torch.load(d / "remapping_weight.pt", weights_only=True, map_location="cpu")
    e["model.layers.0.mlp.down_proj"]["vt_absmax"] = e["model.layers.0.mlp.down_proj"]["vt_absmax"][:-1]
    torch.save(e, d / "remapping_weight.pt")
    with pytest.raises(CheckpointError, match=r"down_proj.*components"):
        load_checkpoint(d)


def test_unknown_layouts(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "x" / "weights.npy").write_bytes(b"\x93NUMPY")
    with pytest.raises(CheckpointError, match="unknown layout"):
        detect_format(tmp_path / "x")
    p = tmp_path / "plain.pt"
    torch.save({"w": torch.zeros(2)}, p)
    with pytest.raises(CheckpointError, match="without SVD-LLM"):
        detect_format(p)
    with pytest.raises(CheckpointError, match="no such file"):
        load_checkpoint(tmp_path / "nope")


def test_restricted_loader_equals_torch_weights_only(tmp_path):
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=g)
    obj = {"a": base, "view": base[2:, 1::2], "t": base.T, "h": torch.randn(5, generator=g).half(),
           "u8": torch.randint(0, 255, (7,), generator=g, dtype=torch.uint8), "i": torch.arange(4),
           "p": torch.nn.Parameter(torch.ones(3)), "nested": [("x", torch.zeros(2, 0)), None, 1.5, "s"]}
    p = tmp_path / "sd.pt"
    torch.save(obj, p)
    ours, ref = safe_torch_load(p), torch.load(p, weights_only=True)
    for k in ("a", "view", "t", "h", "u8", "i", "p"):
        assert ours[k].dtype == ref[k].dtype and torch.equal(ours[k], ref[k]), k
        assert ours[k].stride() == ref[k].stride(), k
    assert ours["view"].untyped_storage().data_ptr() == ours["a"].untyped_storage().data_ptr()  # sharing kept
    assert ours["nested"][0][0] == "x" and ours["nested"][1:] == [None, 1.5, "s"]


def test_fake_class_registration_never_shadows(tmp_path):
    import transformers.models.llama.modeling_llama as ml

    clash = fake_class("transformers.models.llama.modeling_llama.LlamaModel")
    with pytest.raises(RuntimeError, match="refusing to shadow"):
        with registered([clash]):
            pass
    assert ml.LlamaModel is not clash
