"""The adversarial corpus: hostile and malformed files for every weakness class and every family reader.

Each case asserts the exception type (CheckpointError or its subclass UnsafePickleError, never an
UnclassifiedCheckpointError and never anything else), that the message names the file and, where one
is at fault, the tensor, and for code-execution attempts that the payload's marker file was never
created. The resource-exhaustion cases run in a child process under a 2 GiB data-segment limit and
a wall-clock limit (test_unbounded_work_is_bounded), so a regression fails the test instead of
hanging or swapping the machine. Files are generated in tmp_path at test time.

Classes (issue 10): 1 accepting code, 2 seeing a different file than torch, 3 unnamed errors,
4 unbounded work, 5 silent acceptance.
"""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from hostile import (P2, binint, dict_of, floats, glob, legacy_bytes, pickle_bytes, rebuild,
                     rewrite_zip_record, safetensors_bytes, storage_pid, torch_zip, uni)
from legacy_checkpoints import impersonating, standin, svdllm_pickle

from lowrank_lib import detect_format, families, load_checkpoint, models
from lowrank_lib.compress import collect_stats
from lowrank_lib.data import random_token_batches
from lowrank_lib.formats import CheckpointError, UnclassifiedCheckpointError, UnsafePickleError, write_native
from lowrank_lib.formats.safe_pickle import pickle_globals, safe_torch_load
from lowrank_lib.formats.safetensors_file import check_safetensors
from lowrank_lib.formats.torchfile import container_kind

ROOT = Path(__file__).resolve().parents[1]


def refused(fn, *args, match: str = "", key: str | None = None, cls=CheckpointError, path=None, **kw):
    """Call ``fn`` and return the CheckpointError it must raise (``cls``), checked for file and key names."""
    with pytest.raises(cls) as ei:
        fn(*args, **kw)
    e = ei.value
    assert not isinstance(e, UnclassifiedCheckpointError), f"unclassified: {e}"
    msg = str(e)
    target = Path(path if path is not None else args[0])
    assert str(target) in msg or target.name in msg, f"file not named: {msg}"
    if key is not None:
        assert key in msg, f"tensor {key!r} not named: {msg}"
    if match:
        import re

        assert re.search(match, msg), f"{match!r} not in {msg}"
    return e


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """One small checkpoint of every family (native writers), plus a transformers-4.35-style SVD-LLM pickle."""
    d = tmp_path_factory.mktemp("ck")
    m = models.tiny_model("tiny-gqa", seed=0)
    mha = models.tiny_model("tiny-mha", seed=0)
    stats = collect_stats(m, random_token_batches(256, 4, 32), progress=False)
    out = {}
    for fam in ("asvd", "basis_sharing", "palu", "svdllm", "dobi", "dobi-remap"):
        kw = {"align": 4} if fam == "palu" else {}
        cm = families.get(fam).compress(m, stats, 0.6, progress=False, **kw)
        out[fam] = write_native(cm, fam, d / fam)
    out["lowrank"] = write_native(families.get("svd").compress(m, None, 0.6), "lowrank", d / "own")
    mstats = collect_stats(mha, random_token_batches(256, 4, 32), progress=False)
    out["legacy_svdllm"] = svdllm_pickle(families.get("svdllm").compress(mha, mstats, 0.6, progress=False),
                                         d / "legacy")[0]
    return out


def copy(src: Path, dst: Path) -> Path:
    return Path(shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst))


def edit_json(p: Path, fn) -> None:
    d = json.loads(p.read_text())
    fn(d)
    p.write_text(json.dumps(d))


def edit_safetensors(p: Path, fn) -> None:
    """Re-save ``p`` after ``fn(tensors dict)`` (a valid file with different content)."""
    from safetensors.torch import load_file, save_file

    sd = load_file(str(p))
    fn(sd)
    save_file({k: v.contiguous() for k, v in sd.items()}, str(p), metadata={"format": "pt"})


def st_parts(p: Path) -> tuple[dict, bytes]:
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


# =========================================================================== 1. accepting code
class _Reduce:
    def __init__(self, fn, args):
        self.fn, self.args = fn, args

    def __reduce__(self):
        return self.fn, self.args


def _payload_function(modname: str):
    """A function ``<modname>.setup(path)`` that creates a marker file: what a malicious pickle would call."""
    import types

    ns = types.ModuleType(modname).__dict__
    exec("def setup(p):\n    open(p, 'w').close()\n", ns)
    return ns["setup"]


@pytest.mark.parametrize("modname", ["component.svd_llama", "modules.module", "transformers.models.llama.modeling_llama",
                                     "tokenizers"])
def test_a_function_under_an_allowed_module_is_refused(tmp_path, modname):
    """The old reader stubbed ANY global under 'component.', 'transformers.', ...: a function there loaded."""
    marker = tmp_path / "pwned"
    setup = _payload_function(modname)
    attn = standin("component.svd_llama.SVD_LlamaAttention")
    p = tmp_path / "model_whitening_only_0.8.pt"
    with impersonating([attn, setup]):
        torch.save({"model": attn(), "tokenizer": _Reduce(setup, (str(marker),))}, p)
    assert f"{modname}.setup" in pickle_globals(p)
    e = refused(load_checkpoint, p, cls=UnsafePickleError, match=rf"'{modname}\.setup'")
    assert e.key == f"{modname}.setup"
    assert not marker.exists()
    with impersonating([attn, setup]):          # the payload is real: torch.load(weights_only=False) runs it
        torch.load(p, weights_only=False)
    assert marker.exists()


@pytest.mark.parametrize("module,name", [("tokenizersX", "Tokenizer"), ("tokenizers_evil", "Tokenizer"),
                                         ("transformers.models.llama.modeling_llamaX", "LlamaModel"),
                                         ("component.svd_llama_x", "SVD_LlamaAttention"),
                                         ("transformers.models.llama.modeling_llama", "LlamaForSequenceClassification"),
                                         ("builtins", "getattr"), ("posix", "system"), ("subprocess", "Popen"),
                                         ("torch", "load"), ("torch._utils", "_rebuild_device_tensor_from_numpy"),
                                         ("torch", "ComplexFloatStorage")])
def test_only_exact_allow_listed_globals(tmp_path, module, name):
    """Prefix matching respects module boundaries; classes not on the list and functions are refused by name."""
    p = torch_zip(tmp_path / "x.pt", pickle_bytes(glob(module, name) + b")R"))
    refused(safe_torch_load, p, cls=UnsafePickleError, match=rf"'{module}\.{name}'")


def test_family_allow_lists_are_separate(ckpts, tmp_path):
    """An SVD-LLM file read as Dobi is refused at its first SVD-LLM class: each family stubs only its own."""
    p = copy(ckpts["legacy_svdllm"], tmp_path / "s.pt")
    refused(load_checkpoint, p, family="dobi", cls=UnsafePickleError, match=r"'component\.svd_llama\.")
    assert safe_torch_load(p, "svdllm")["model"] is not None


def test_protocol0_inst_and_ext_opcodes_go_through_the_allow_list(tmp_path):
    marker = tmp_path / "pwned"
    inst = b"(S'touch " + str(marker).encode() + b"'\nios\nsystem\n."        # INST os.system (protocol 0)
    refused(safe_torch_load, torch_zip(tmp_path / "i.pt", inst), cls=UnsafePickleError, match=r"'os\.system'")
    ext = P2 + b"\x82\xf0)R."                                                # EXT1 of an unregistered code
    refused(safe_torch_load, torch_zip(tmp_path / "e.pt", ext), match="corrupt pickle")
    pers = P2 + b"P" + b"storage\n."                                         # text PERSID
    refused(safe_torch_load, torch_zip(tmp_path / "p.pt", pers), cls=UnsafePickleError, match="persistent id")
    assert not marker.exists()


def test_no_opcode_reaches_a_tensor_method(tmp_path):
    """BUILD on a rebuilt tensor would call Tensor.__setstate__ (set_ / hooks): refused."""
    t = rebuild(storage_pid(), 0, (4,), (1,))
    body = t + b"(" + uni("x") + binint(1) + binint(2) + binint(3) + b"tb"
    p = torch_zip(tmp_path / "b.pt", pickle_bytes(body), {"data/0": floats(1, 2, 3, 4)})
    refused(safe_torch_load, p, cls=UnsafePickleError, match="set state on a tensor")
    setitem = t + binint(0) + binint(7) + b"s"                               # SETITEM into a tensor
    p = torch_zip(tmp_path / "s.pt", pickle_bytes(setitem), {"data/0": floats(1, 2, 3, 4)})
    refused(safe_torch_load, p, match="corrupt pickle")


def test_codecs_encode_is_latin1_only(tmp_path):
    import _codecs

    p = tmp_path / "c.pt"
    torch.save({"x": _Reduce(_codecs.encode, ("abc", "rot13"))}, p)
    refused(safe_torch_load, p, cls=UnsafePickleError, match="latin1")


def test_plain_data_globals_stay_data(tmp_path):
    p = tmp_path / "d.pt"
    torch.save({"d": torch.device("cuda", 0), "s": torch.Size([2, 3]), "set": {1, 2}, "b": b"\x00x"}, p)
    assert safe_torch_load(p) == {"d": ("device", "cuda", 0), "s": torch.Size([2, 3]), "set": {1, 2}, "b": b"\x00x"}
    bad = torch_zip(tmp_path / "dev.pt", pickle_bytes(glob("torch", "device") + b"(" + binint(3) + b"tR"))
    refused(safe_torch_load, bad, cls=UnsafePickleError, match="torch.device")


def test_hf_kernels_function_wrapper_stays_data(tmp_path):
    """transformers >= 5.25 pickles LlamaAttention.rotary_pos_emb as kernels' _rebuild_kernel_func(module, name)
    (bytes as torch.save writes them there): an inert stub, nothing imported; anything but two dotted names refused."""
    call = lambda *args: glob("kernels._internals.layer.layer", "_rebuild_kernel_func") + b"(" + b"".join(args) + b"tR"  # noqa: E731
    ok = torch_zip(tmp_path / "k.pt", pickle_bytes(dict_of(
        f=call(uni("transformers.models.llama.modeling_llama"), uni("apply_rotary_pos_emb"))
        + b"}(" + uni("training") + b"\x88ub")))                      # then BUILD with nn.Module state
    f = safe_torch_load(ok)["f"]
    assert f.stub_path == "kernels.KernelFunction" and not callable(f) and f.training is True
    assert f.stub_args == ("transformers.models.llama.modeling_llama", "apply_rotary_pos_emb")
    for i, args in enumerate([(uni("os"),), (uni("os"), binint(1)), (uni("os; import x"), uni("system")),
                              (uni("os"), uni("system"), uni("extra")), (uni(""), uni("f"))]):
        bad = torch_zip(tmp_path / f"k{i}.pt", pickle_bytes(dict_of(f=call(*args))))
        refused(safe_torch_load, bad, cls=UnsafePickleError, match="_rebuild_kernel_func")


# =========================================================================== 2. seeing the file as torch does
def test_legacy_pickle_with_a_zip_appended_is_the_legacy_pickle(ckpts, tmp_path):
    """torch.load decides by the leading bytes: such a file IS the legacy pickle; the old reader certified the zip."""
    p = tmp_path / "poly.pt"
    p.write_bytes(legacy_bytes({"w": torch.ones(2)}) + ckpts["legacy_svdllm"].read_bytes())
    assert zipfile.is_zipfile(p)                                  # Python's zipfile sees a valid zip at the end ...
    assert torch.load(p, weights_only=True)["w"].shape == (2,)    # ... torch sees the legacy pickle
    assert container_kind(p) == "legacy"
    refused(detect_format, p, match="without SVD-LLM")            # what torch would load holds no SVD-LLM classes
    refused(load_checkpoint, p, family="svdllm", match="bytes trail the last storage")


def test_zip_archives_need_one_reading(ckpts, tmp_path):
    src = ckpts["legacy_svdllm"]
    junk = tmp_path / "junk.pt"                                   # data before the archive: torch reads legacy
    junk.write_bytes(b"\x00" * 64 + src.read_bytes())
    refused(load_checkpoint, junk, family="svdllm", match="not a torch.save file|corrupt")
    dup = tmp_path / "dup.pt"
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dup, "w") as zout:
        for i in zin.infolist():
            zout.writestr(i.filename, zin.read(i.filename))
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            zout.writestr(zin.infolist()[0].filename, b"\x80\x02}.")
    refused(safe_torch_load, dup, match="appears twice")
    ts = torch_zip(tmp_path / "ts.pt", pickle_bytes(b"}"), {"constants.pkl": pickle_bytes(b")")})
    refused(safe_torch_load, ts, match="TorchScript")
    other = torch_zip(tmp_path / "o.pt", pickle_bytes(b"}"), {"../evil": b"x"})
    refused(safe_torch_load, other, match="unexpected zip record")
    two = tmp_path / "two.pt"
    with zipfile.ZipFile(two, "w") as zf:
        zf.writestr("archive/data.pkl", pickle_bytes(b"}"))
        zf.writestr("other/data.pkl", pickle_bytes(b"}"))
    refused(safe_torch_load, two, match="outside the archive folder")
    big_endian = torch_zip(tmp_path / "be.pt", pickle_bytes(b"}"))
    rewrite_zip_record(big_endian, "byteorder", lambda b: b"big")
    refused(safe_torch_load, big_endian, match="little-endian")


def test_overlapping_zip_records_are_refused(tmp_path):
    """Two directory entries describing one byte range (the overlapping-entries zip trick) have two readings."""
    p = torch_zip(tmp_path / "ov.pt", pickle_bytes(b"}"), {"data/0": b"\x00" * 64})
    raw = bytearray(p.read_bytes())
    with zipfile.ZipFile(p) as zf:
        pkl_offset = zf.getinfo("archive/data.pkl").header_offset
    at = raw.find(b"PK\x01\x02")
    while at >= 0:                                   # walk the central directory
        n = struct.unpack_from("<H", raw, at + 28)[0]
        if raw[at + 46:at + 46 + n] == b"archive/version":
            struct.pack_into("<L", raw, at + 42, pkl_offset)
        at = raw.find(b"PK\x01\x02", at + 4)
    p.write_bytes(bytes(raw))
    refused(safe_torch_load, p, match="overlap|differ|corrupt")


def test_other_containers_torch_would_not_read_as_a_pickle(tmp_path):
    import tarfile

    t = tmp_path / "old.tar"
    with tarfile.open(t, "w") as tf:
        info = tarfile.TarInfo("storages")
        info.size = 0
        tf.addfile(info, None)
    refused(safe_torch_load, t, match=r"\.tar")
    st = tmp_path / "model.safetensors"
    st.write_bytes(legacy_bytes({"w": torch.ones(1)}))
    refused(safe_torch_load, st, match="safetensors")


# =========================================================================== 3. unnamed errors
@pytest.mark.parametrize("case,match", [
    ("odd_bytes", r"data/0.*holds 7 bytes.*expects 8"),
    ("missing_record", r"data/0.*missing"),
    ("negative_offset", r"offset -1"),
    ("negative_stride", r"non-negative|negative strides"),
    ("out_of_bounds", r"needs 9 elements but its storage holds 4"),
    ("size_stride_mismatch", r"not matching"),
    ("huge_numel", r"numel|holds 16 bytes"),
    ("dtype_mismatch", r"referenced as"),
    ("bare_storage", r"bare storage|expected a state dict|corrupt"),
])
def test_storage_and_tensor_errors_name_the_record(tmp_path, case, match):
    pid, records, body = storage_pid(numel=2), {"data/0": floats(1, 2)}, None
    if case == "odd_bytes":
        records = {"data/0": b"\x00" * 7}
    elif case == "missing_record":
        records = {}
    elif case == "negative_offset":
        body = rebuild(storage_pid(numel=4), -1, (2,), (1,))
    elif case == "negative_stride":
        body = rebuild(storage_pid(numel=4), 3, (2,), (-1,))
    elif case == "out_of_bounds":
        body = rebuild(storage_pid(numel=4), 0, (3, 3), (3, 1))
    elif case == "size_stride_mismatch":
        body = rebuild(storage_pid(numel=4), 0, (2, 2), (1,))
    elif case == "huge_numel":
        body = rebuild(storage_pid(numel=1 << 40), 0, (1,), (1,))
    elif case == "dtype_mismatch":
        body = b"(" + rebuild(storage_pid(numel=4), 0, (4,), (1,)) + rebuild(storage_pid("IntStorage", numel=4), 0,
                                                                            (4,), (1,)) + b"t"
    elif case == "bare_storage":
        body = dict_of(w=storage_pid(numel=4))
    if case in ("negative_offset", "negative_stride", "out_of_bounds", "size_stride_mismatch", "huge_numel",
                "dtype_mismatch", "bare_storage"):
        records = {"data/0": floats(1, 2, 3, 4)}
    body = body if body is not None else dict_of(w=rebuild(pid, 0, (2,), (1,)))
    p = torch_zip(tmp_path / f"{case}.pt", pickle_bytes(body), records)
    refused(safe_torch_load, p, match=match)


@pytest.mark.parametrize("case,match,key", [
    ("short", "truncated: 5 bytes", None),
    ("header_len_zero", "header length 0", None),
    ("header_past_end", "does not fit", None),
    ("not_utf8", "not UTF-8 JSON", None),
    ("not_json", "not UTF-8 JSON", None),
    ("json_list", "JSON list", None),
    ("duplicate_key", "twice", "w"),
    ("unknown_dtype", "unknown dtype 'F7'", "w"),
    ("complex_dtype", "unknown dtype 'C64'", "w"),
    ("shape_strings", "shape", "w"),
    ("shape_negative", "shape", "w"),
    ("shape_bool", "shape", "w"),
    ("offsets_reversed", "data_offsets", "w"),
    ("size_mismatch", "needs 8 bytes but data_offsets", "w"),
    ("overlap", "overlap", "b"),
    ("hole", "hole", "b"),
    ("trailing", "trailing bytes", None),
    ("truncated_data", "truncated", None),
    ("extra_field", "exactly dtype, shape, data_offsets", "w"),
    ("metadata_not_str", "__metadata__", None),
    ("deep_json", "nested too deeply|not UTF-8 JSON", None),
])
def test_safetensors_header_rules(tmp_path, case, match, key):
    w = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}
    b = {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}
    hdr, data, hl = {"w": w, "b": b}, floats(1, 2, 3, 4), None
    raw_header = None
    if case == "short":
        raw = b"\x01\x00\x00\x00\x00"
    else:
        if case == "header_len_zero":
            hl = 0
        elif case == "header_past_end":
            hl = 10 ** 6
        elif case == "not_utf8":
            raw_header = b"\xff\xfe{}"
        elif case == "not_json":
            raw_header = b"{'w': 1}"
        elif case == "json_list":
            raw_header = b"[1, 2]"
        elif case == "duplicate_key":
            raw_header = (b'{"w": ' + json.dumps(w).encode() + b', "w": ' + json.dumps(w).encode() + b"}")
            data = floats(1, 2)
        elif case == "unknown_dtype":
            hdr["w"] = dict(w, dtype="F7")
        elif case == "complex_dtype":
            hdr["w"] = dict(w, dtype="C64")
        elif case == "shape_strings":
            hdr["w"] = dict(w, shape=["2"])
        elif case == "shape_negative":
            hdr["w"] = dict(w, shape=[-2])
        elif case == "shape_bool":
            hdr["w"] = dict(w, shape=[True, 2])
        elif case == "offsets_reversed":
            hdr["w"] = dict(w, data_offsets=[8, 0])
        elif case == "size_mismatch":
            hdr["w"] = dict(w, data_offsets=[0, 4])
            hdr["b"] = dict(b, data_offsets=[4, 12])
            data = floats(1, 2, 3)
        elif case == "overlap":
            hdr["b"] = dict(b, data_offsets=[4, 12])
            data = floats(1, 2, 3)
        elif case == "hole":
            hdr["b"] = dict(b, data_offsets=[12, 20])
            data = floats(1, 2, 3, 4, 5)
        elif case == "trailing":
            data = floats(1, 2, 3, 4, 5)
        elif case == "truncated_data":
            data = floats(1, 2, 3)
        elif case == "extra_field":
            hdr["w"] = dict(w, extra=1)
        elif case == "metadata_not_str":
            hdr["__metadata__"] = {"format": 1}
        elif case == "deep_json":
            raw_header = b"[" * 100_000 + b"]" * 100_000
        raw = safetensors_bytes(raw_header if raw_header is not None else hdr, data, hl)
    p = tmp_path / "model.safetensors"
    p.write_bytes(raw)
    refused(check_safetensors, p, match=match, key=key)


def test_unexpected_containers_and_keys(tmp_path, ckpts):
    attn = standin("component.svd_llama.SVD_LlamaAttention")
    cases = {
        "list_top": ([1, 2], "expected a pickled"),
        "model_int": ({"model": 3, "tokenizer": None}, "expected a pickled"),
        "mixed_keys": ({1: "a", "1": "b", (2,): None}, "expected a pickled"),
    }
    for name, (obj, match) in cases.items():
        p = tmp_path / f"{name}_whitening_only_0.8.pt"
        with impersonating([attn]):
            torch.save(obj, p)
        refused(load_checkpoint, p, family="svdllm", match=match)
    # a module whose _parameters is a list / whose _modules holds an int / whose config has colliding keys
    for name, mutate, match in (
            ("params_list", lambda m: m.model.norm.__dict__.__setitem__("_parameters", [1]), "expected a dict"),
            ("modules_int", lambda m: m.model._modules.__setitem__("x", 5), "expected a pickled nn.Module"),
            ("config_keys", lambda m: m.config.__dict__.update({1: 0, "1": 1}), "collide")):
        refused(load_checkpoint, _svdllm_with(tmp_path, mutate, name), match=match)


@pytest.mark.parametrize("content,match", [
    (b'{"vocab_size": 1', "not valid JSON"), (b"\xff\xfe\x00", "not valid JSON"), (b"[1]", "JSON list"),
    (b'{"num_basis_q": 2, "hidden_size": NaN}', "lacks"),
])
def test_bad_config_json(tmp_path, ckpts, content, match):
    d = copy(ckpts["basis_sharing"], tmp_path / "b")
    (d / "config.json").write_bytes(content)
    f = load_checkpoint if b"num_basis_q" in content else detect_format
    refused(f, d, match=match, path=d / "config.json")


@pytest.mark.parametrize("field,value,match", [
    ("num_hidden_layers", "2", "expected an int"), ("hidden_size", 64.0, "expected an int"),
    ("rms_norm_eps", -1, "finite non-negative"), ("tie_word_embeddings", "yes", "true or false"),
    ("hidden_act", "os.system", "activation"), ("rope_theta", float("inf"), "positive number"),
    ("rope_scaling", {"rope_type": "nope", "factor": 2.0}, "rope|rejected"), ("eos_token_id", [-1], "token id"),
    ("num_key_value_heads", 3, "geometry|divide"),
])
def test_config_values_are_validated(tmp_path, ckpts, field, value, match):
    d = copy(ckpts["basis_sharing"], tmp_path / "b")
    edit_json(d / "config.json", lambda c: (c.pop("rope_parameters", None), c.__setitem__(field, value)))
    refused(load_checkpoint, d, match=match, path=d / "config.json")


# =========================================================================== 5. silent acceptance
def test_nonfinite_factors_are_refused_by_name_unless_asked(ckpts, tmp_path):
    d = copy(ckpts["asvd"], tmp_path / "a")
    key = "model.layers.1.self_attn.q_proj.ALinear.weight"
    edit_safetensors(d / "model.safetensors", lambda sd: sd[key].__setitem__((3, 1), float("nan")))
    refused(load_checkpoint, d, key=key, match="1 NaN and 0 Inf.*allow_nonfinite=True")
    with pytest.warns(UserWarning, match="non-finite"):
        m = load_checkpoint(d, allow_nonfinite=True)
    assert m.lowrank_meta["nonfinite"][key]["nan"] == 1
    d2 = copy(ckpts["lowrank"], tmp_path / "o")
    edit_safetensors(d2 / "model.safetensors", lambda sd: sd["model.norm.weight"].__setitem__(0, float("inf")))
    refused(load_checkpoint, d2, key="model.norm.weight", match="0 NaN and 1 Inf")
    d3 = copy(ckpts["lowrank"], tmp_path / "big")
    edit_safetensors(d3 / "model.safetensors", lambda sd: sd["model.norm.weight"].__setitem__(0, 1e6))
    assert load_checkpoint(d3).model.norm.weight[0] == 1e6
    refused(load_checkpoint, d3, dtype=torch.float16, key="model.norm.weight", match="after casting to torch.float16")


def test_nonfinite_in_a_legacy_pickle_names_the_native_key(ckpts, tmp_path):
    p = _svdllm_with(tmp_path, lambda model: model.model.layers[0].self_attn.q_u_proj.weight.data.__setitem__(
        (0, 0), float("inf")))
    refused(load_checkpoint, p, key="model.layers.0.self_attn.q_u_proj.weight", match="Inf")


def _svdllm_with(tmp_path, mutate, name="m"):
    """A transformers-4.35-style SVD-LLM pickle whose model object ``mutate`` altered just before saving."""
    import legacy_checkpoints as lc

    mha = models.tiny_model("tiny-mha", seed=0)
    stats = collect_stats(mha, random_token_batches(256, 2, 16), progress=False)
    cm = families.get("svdllm").compress(mha, stats, 0.6, progress=False)
    real = lc._save

    def save(obj, path, *a, **k):
        mutate(obj["model"])
        real(obj, path, *a, **k)

    lc._save = save
    try:
        return svdllm_pickle(cm, tmp_path / name)[0]
    finally:
        lc._save = real


def test_ranks_outside_1_to_min_are_refused(ckpts, tmp_path):
    d = copy(ckpts["asvd"], tmp_path / "a")
    name = "model.layers.0.mlp.up_proj"
    edit_safetensors(d / "model.safetensors", lambda sd: (sd.__setitem__(f"{name}.ALinear.weight", torch.zeros(160, 0)),
                                                         sd.__setitem__(f"{name}.BLinear.weight", torch.zeros(0, 64))))
    edit_json(d / "config.json", lambda c: c["truncation_ranks"].__setitem__(name, 0))
    refused(load_checkpoint, d, key=f"{name}.ALinear.weight", match="rank 0")
    d2 = copy(ckpts["lowrank"], tmp_path / "o")
    q = "model.layers.0.self_attn.q_proj"
    g = torch.Generator().manual_seed(0)
    edit_safetensors(d2 / "model.safetensors", lambda sd: (sd.__setitem__(f"{q}.U", torch.randn(64, 80, generator=g)),
                                                          sd.__setitem__(f"{q}.V", torch.randn(80, 64, generator=g))))
    edit_json(d2 / "lowrank_manifest.json", lambda m: m["factors"][q].__setitem__("rank", 80))
    refused(load_checkpoint, d2, key=f"{q}.U", match=r"rank 80 > min\(out, in\) = 64")


def test_shard_entries_must_stay_in_the_folder(ckpts, tmp_path):
    d = copy(ckpts["asvd"], tmp_path / "a")
    outside = tmp_path / "outside.safetensors"
    shutil.move(d / "model.safetensors", outside)
    for entry in ("../outside.safetensors", str(outside), "sub/../../outside.safetensors"):
        (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": entry}}))
        refused(load_checkpoint, d, match="outside the checkpoint folder", path=d)
    (d / "link.safetensors").symlink_to(outside)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "link.safetensors"}}))
    refused(load_checkpoint, d, match="resolves to .*outside", path=d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": 3}}))
    refused(load_checkpoint, d, match=r"weight_map\['w'\]", path=d / "model.safetensors.index.json")


def test_hf_cache_snapshot_symlinks_are_followed(ckpts, tmp_path):
    """The one allowed way out of the folder: HF hub cache snapshots -> the same repository's blobs/."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for f in ckpts["asvd"].iterdir():
        shutil.copy(f, blobs / f.name)
        (snap / f.name).symlink_to(Path("../../blobs") / f.name)
    assert load_checkpoint(snap).lowrank_meta["family"] == "asvd"


def test_own_format_overlapping_spans_are_refused(ckpts, tmp_path):
    d = copy(ckpts["lowrank"], tmp_path / "o")
    p = d / "model.safetensors"
    hdr, data = st_parts(p)
    names = [k for k in hdr if k != "__metadata__"]
    a, b = names[0], names[1]
    hdr[b] = dict(hdr[b], data_offsets=hdr[a]["data_offsets"], shape=hdr[a]["shape"], dtype=hdr[a]["dtype"])
    p.write_bytes(safetensors_bytes(hdr, data))
    refused(load_checkpoint, d, match="overlap|hole", path=p)


def test_readers_write_nothing(ckpts):
    """Loading (and failing to load) leaves every checkpoint byte-for-byte and file-for-file as it was."""
    def snapshot():
        out = {}
        for root in ckpts.values():
            for p in ([root] if root.is_file() else sorted(root.parent.rglob("*") if root.suffix == ".pt" else
                                                                 root.rglob("*"))):
                if p.is_file():
                    st = p.stat()
                    out[str(p)] = (st.st_size, st.st_mtime_ns, p.read_bytes())
        return out

    before = snapshot()
    for name, root in ckpts.items():
        load_checkpoint(root)
        for fam in ("svdllm", "dobi", "asvd", "lowrank"):
            try:
                load_checkpoint(root, family=fam)
            except CheckpointError:
                pass
    assert snapshot() == before


# =========================================================================== every family reader
def test_svdllm_reader_cases(ckpts, tmp_path):
    src = ckpts["legacy_svdllm"]
    bad_theta = _svdllm_with(tmp_path, lambda m: m.config.__dict__.__setitem__("rope_theta", 500000.0), "theta")
    e = refused(load_checkpoint, bad_theta, match="does not match the config's RoPE|is not the cos table")
    assert "rotary_emb" in e.key
    extra = _svdllm_with(tmp_path, lambda m: m.model.layers[0].self_attn.rotary_emb.register_buffer(
        "bogus", torch.zeros(2)), "extra")
    refused(load_checkpoint, extra, key="model.layers.0.self_attn.rotary_emb.bogus", match="unexpected tensor")
    as_param = _svdllm_with(tmp_path, lambda m: m.model.layers[0].self_attn.rotary_emb.__dict__["_parameters"].update(
        {"inv_freq2": torch.nn.Parameter(torch.zeros(8))}), "param")
    refused(load_checkpoint, as_param, key="model.layers.0.self_attn.rotary_emb.inv_freq2")
    unpaired = _svdllm_with(tmp_path, lambda m: delattr(m.model.layers[1].mlp, "up_v_proj"), "unpaired")
    refused(load_checkpoint, unpaired, key="model.layers.1.mlp.up_u_proj.weight", match="no partner")
    refused(load_checkpoint, copy(src, tmp_path / "t.pt"), family="palu", match="config.json")


def test_dobi_reader_cases(ckpts, tmp_path):
    p = copy(ckpts["dobi"].parent, tmp_path / "DobiSVD_Noremapping-tiny-0.6")
    torch_file = p / "DobiSVD_Model.pt"
    assert pickle_globals(torch_file) >= {"modules.module.SVDTransformLayer", "torch.HalfStorage"}
    with open(torch_file, "r+b") as f:
        f.truncate(os.path.getsize(torch_file) - 200)
    refused(load_checkpoint, p, path=torch_file, match="zip|truncated|corrupt")


def test_dobi_remap_reader_cases(ckpts, tmp_path):
    d = copy(ckpts["dobi-remap"], tmp_path / "r")
    e = torch.load(d / "remapping_weight.pt", weights_only=True, map_location="cpu")
    name = "model.layers.0.mlp.down_proj"
    e[name]["us_quan"] = e[name]["us_quan"].float()
    torch.save(e, d / "remapping_weight.pt")
    refused(load_checkpoint, d, key=f"{name}[us_quan]", match="expected a 2-D torch.uint8", path=d / "remapping_weight.pt")
    e[name]["us_quan"] = e[name]["us_quan"].to(torch.uint8)
    e[name]["tuple_info"] = ("zz", torch.zeros(2, 2))
    torch.save(e, d / "remapping_weight.pt")
    refused(load_checkpoint, d, key=f"{name}[tuple_info]", path=d / "remapping_weight.pt")
    torch.save([1, 2], d / "remapping_weight.pt")
    refused(load_checkpoint, d, match="expected {module: entry}", path=d / "remapping_weight.pt")


def test_basis_sharing_reader_cases(ckpts, tmp_path):
    d = copy(ckpts["basis_sharing"], tmp_path / "b")
    edit_json(d / "config.json", lambda c: c.__setitem__("q_groups", [[0, 0]]))
    refused(load_checkpoint, d, match="q_groups.*cover", path=d / "config.json")
    d = copy(ckpts["basis_sharing"], tmp_path / "b2")
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    sd["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64)
    sd["extra"] = 3
    torch.save(sd, d / "pytorch_model.bin")
    refused(load_checkpoint, d, key="extra", match="expected a tensor", path=d / "pytorch_model.bin")
    del sd["extra"]
    torch.save(sd, d / "pytorch_model.bin")
    refused(load_checkpoint, d, key="model.layers.0.self_attn.o_proj.weight", path=d / "pytorch_model.bin")


def test_asvd_reader_cases(ckpts, tmp_path):
    d = copy(ckpts["asvd"], tmp_path / "a")
    edit_json(d / "config.json", lambda c: c["truncation_ranks"].__setitem__("model.layers.0.mlp.up_proj", "12"))
    refused(load_checkpoint, d, key="model.layers.0.mlp.up_proj", match="expected an int", path=d / "config.json")
    d = copy(ckpts["asvd"], tmp_path / "a2")
    edit_json(d / "config.json", lambda c: c.__setitem__("hidden_size", 1 << 40))
    refused(load_checkpoint, d, key="hidden_size", match="expected an int in", path=d / "config.json")


def test_palu_reader_cases(ckpts, tmp_path):
    d = copy(ckpts["palu"], tmp_path / "p")
    edit_json(d / "config.json", lambda c: c["head_wise_ranks"].__setitem__("model.layers.0.self_attn.k_proj", ["4"]))
    refused(load_checkpoint, d, key="model.layers.0.self_attn.k_proj", path=d / "config.json")
    d = copy(ckpts["palu"], tmp_path / "p2")
    edit_json(d / "config.json", lambda c: c["head_wise_ranks"].__setitem__(
        "model.layers.0.mlp.up_proj", c["head_wise_ranks"].pop("model.layers.0.self_attn.k_proj")))
    refused(load_checkpoint, d, key="model.layers.0.mlp.up_proj.VT.weight", match="missing")


def test_lowrank_reader_cases(ckpts, tmp_path):
    d = copy(ckpts["lowrank"], tmp_path / "o")
    edit_json(d / "lowrank_manifest.json", lambda m: m["factors"]["model.layers.0.mlp.up_proj"].__setitem__("U", "nope"))
    refused(load_checkpoint, d, key="nope", match="not stored", path=d / "model.safetensors")
    d = copy(ckpts["lowrank"], tmp_path / "o2")
    edit_json(d / "lowrank_manifest.json", lambda m: m.__setitem__("factors", []))
    refused(load_checkpoint, d, key="factors", path=d / "lowrank_manifest.json")
    d = copy(ckpts["lowrank"], tmp_path / "o3")
    edit_safetensors(d / "model.safetensors", lambda sd: sd.__setitem__("stowaway", torch.zeros(1)))
    refused(load_checkpoint, d, key="stowaway", match="does not use", path=d / "model.safetensors")


def test_unknown_family_names_and_bad_arguments(ckpts):
    refused(load_checkpoint, ckpts["asvd"], family="nope", match="unknown family 'nope'")
    assert load_checkpoint(ckpts["dobi-remap"], family="dobi_remap").lowrank_meta["family"] == "dobi-remap"
    refused(load_checkpoint, ckpts["asvd"], dtype="float16", match="not a floating torch.dtype")
    with pytest.raises(CheckpointError, match="not a path") as ei:
        load_checkpoint(12)
    assert not isinstance(ei.value, UnclassifiedCheckpointError)


# =========================================================================== 4. unbounded work (child process)
_CHILD = r'''
import json, resource, sys, time, traceback
resource.setrlimit(resource.RLIMIT_DATA, (2 << 30, 2 << 30))
from lowrank_lib import detect_format, load_checkpoint
from lowrank_lib.formats import CheckpointError, UnclassifiedCheckpointError
from lowrank_lib.formats.safe_pickle import safe_torch_load
out = {}
for name, fn, path, kw in json.loads(sys.argv[1]):
    f = {"load": load_checkpoint, "detect": detect_format, "raw": safe_torch_load}[fn]
    t0 = time.perf_counter()
    try:
        f(path, **kw)
        res = ("ok", "")
    except CheckpointError as e:
        res = (type(e).__name__, str(e)[:400])
    except BaseException as e:
        res = ("ESCAPED " + type(e).__name__, traceback.format_exc()[-600:])
    out[name] = res + (round(time.perf_counter() - t0, 2),)
    print(json.dumps({name: out[name]}), flush=True)
'''


def _hostile_resource_files(d: Path, ckpts) -> list[tuple[str, str, str, dict, str]]:
    """(name, entry point, path, kwargs, expected message regex) for each resource-exhaustion attempt."""
    cases = []
    # memo growth: LONG_BINPUT 0xFFFFFFF0 asks the C unpickler for a 64 GB memo
    p = torch_zip(d / "memo.pt", P2 + b"}r\xf0\xff\xff\xff.")
    cases.append(("memo_growth", "raw", p, {}, "memo index"))
    # a huge data.pkl of 3M tiny opcodes (never a real checkpoint): stopped by the opcode budget
    p = torch_zip(d / "ops.pt", P2 + b"N0" * 1_500_000 + b"N.")
    cases.append(("opcode_flood", "raw", p, {}, "more than .* opcodes"))
    # self-referential and 200k-deep containers
    p = torch_zip(d / "deep.pt", P2 + b"]" * 200_000 + b"a" * 199_999 + b".")
    cases.append(("deep_nesting", "raw", p, {}, "nested deeper"))
    p = torch_zip(d / "cycle.pt", P2 + b"]q\x00h\x00a.")
    cases.append(("self_list", "raw", p, {}, "ok"))
    # decompression bomb: a deflated record declaring 2 GiB from a few bytes (patched sizes, as a bomb would)
    p = d / "bomb.pt"
    claim = (1 << 31) - 1
    with zipfile.ZipFile(p, "w") as zf:
        zf.writestr("archive/data.pkl", pickle_bytes(dict_of(w=rebuild(storage_pid("ByteStorage", numel=claim), 0,
                                                                       (claim,), (1,)))))
        zf.writestr(zipfile.ZipInfo("archive/data/0"), b"\x00" * 4096, compress_type=zipfile.ZIP_DEFLATED)
    raw = bytearray(p.read_bytes())
    for sig, size_at in ((b"PK\x03\x04", 22), (b"PK\x01\x02", 24)):   # local header and directory entry
        at = raw.find(sig)
        while at >= 0:
            n = struct.unpack_from("<H", raw, at + (26 if sig == b"PK\x03\x04" else 28))[0]
            name_at = at + (30 if sig == b"PK\x03\x04" else 46)
            if raw[name_at:name_at + n] == b"archive/data/0":
                struct.pack_into("<L", raw, at + size_at, claim)
            at = raw.find(sig, at + 4)
    p.write_bytes(bytes(raw))
    cases.append(("deflate_bomb", "raw", p, {}, "decompression bomb"))
    # module graph: a 40-level DAG (2^40 paths) and a cycle
    attn = standin("component.svd_llama.SVD_LlamaAttention")
    with impersonating([attn]):
        root = attn()
        node = root
        for _ in range(40):
            child = attn()
            node.a = child
            node.b = child
            node = child
        torch.save({"model": root, "tokenizer": None}, d / "dag_whitening_only_0.6.pt")
        cyc = attn()
        cyc.loop = cyc
        torch.save({"model": cyc, "tokenizer": None}, d / "cycle_whitening_only_0.6.pt")
    cases.append(("module_dag", "load", d / "dag_whitening_only_0.6.pt", {}, "same object"))
    cases.append(("module_cycle", "load", d / "cycle_whitening_only_0.6.pt", {}, "same object"))
    # configs claiming huge sizes: refused, or validated against the tensors before any allocation
    for name, field, value, match in (("cfg_layers", "num_hidden_layers", 10 ** 9, "expected an int in"),
                                      ("cfg_at_limits", "vocab_size", 1 << 22, "shape"),
                                      ("cfg_hidden", "hidden_size", 1 << 16, "expected")):
        q = copy(ckpts["asvd"], d / name)
        edit_json(q / "config.json", lambda c, f=field, v=value: c.__setitem__(f, v))
        cases.append((name, "load", q, {}, match))
    # a legacy stream whose storages claim more bytes than the file holds (2^40 floats in a tiny file)
    from hostile import legacy_stream

    main = pickle_bytes(dict_of(w=rebuild(storage_pid(numel=1 << 40, legacy=True), 0, (4,), (1,))))
    lp = d / "legacy_claim.pt"
    lp.write_bytes(legacy_stream(main, ["0"], [(4, floats(1, 2, 3, 4))]))
    cases.append(("legacy_claim", "raw", lp, {}, "more than the .*-byte file holds"))
    # non-regular files given as config.json: a FIFO (open would block) and /dev/zero (never ends)
    for name, make in (("fifo_config", lambda t: os.mkfifo(t)), ("devzero_config", lambda t: t.symlink_to("/dev/zero")),
                       ("dir_config", lambda t: t.mkdir())):
        q = copy(ckpts["asvd"], d / name)
        (q / "config.json").unlink()
        make(q / "config.json")
        cases.append((name, "detect", q, {}, "FIFO|character device|directory"))
    # a JSON bomb in config.json
    q = copy(ckpts["asvd"], d / "json_bomb")
    (q / "config.json").write_bytes(b"[" * 1_000_000 + b"]" * 1_000_000)
    cases.append(("json_bomb", "detect", q, {}, "nested too deeply|JSON list"))
    return [(n, fn, str(p), kw, m) for n, fn, p, kw, m in cases]


def test_unbounded_work_is_bounded(ckpts, tmp_path):
    cases = _hostile_resource_files(tmp_path, ckpts)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    spec = json.dumps([(n, fn, p, kw) for n, fn, p, kw, _ in cases])
    proc = subprocess.run([sys.executable, "-c", _CHILD, spec], capture_output=True, text=True, timeout=240, env=env,
                          cwd=ROOT)
    results = {}
    for line in proc.stdout.splitlines():
        results.update(json.loads(line))
    assert proc.returncode == 0, proc.stderr[-2000:]
    import re

    for name, _, path, _, match in cases:
        kind, msg, _secs = results[name]
        if match == "ok":
            assert kind == "ok", (name, kind, msg)
            continue
        assert kind in ("CheckpointError", "UnsafePickleError"), (name, kind, msg)
        assert Path(path).name in msg, (name, msg)
        assert re.search(match, msg), (name, match, msg)
