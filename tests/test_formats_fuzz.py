"""Property-based fuzzing of the restricted unpickler and every reader (hypothesis).

Property: whatever the bytes, a reader either returns a valid model (a LlamaForCausalLM whose every
tensor is finite) or raises CheckpointError, and never an UnclassifiedCheckpointError (a failure the
readers did not classify) or any other exception; and it never hangs (each example has a deadline,
and the number of examples is bounded). Inputs: random and mutated opcode streams fed to the
unpickler inside a valid torch.save archive, and real checkpoints of every family truncated,
bit-flipped or overwritten in places (the whole file, or the pickle / JSON inside it so the outer
checks pass and the inner readers are reached), and random config.json values. Examples are
derandomized so CI runs the same ones; LOWRANK_FUZZ_EXAMPLES=N runs N random examples per test.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import zipfile
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from hostile import P2, binint, floats, glob, rebuild, storage_pid, torch_zip, uni
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowrank_lib import families, load_checkpoint, models
from lowrank_lib.formats import CheckpointError, UnclassifiedCheckpointError, detect_format, write_native
from lowrank_lib.formats.safe_pickle import safe_torch_load

#: ``LOWRANK_FUZZ_EXAMPLES=2000 pytest tests/test_formats_fuzz.py`` runs a longer, randomized hunt.
_N = int(os.environ.get("LOWRANK_FUZZ_EXAMPLES", "0") or 0)
FUZZ = settings(max_examples=_N or 60, deadline=timedelta(seconds=20), derandomize=not _N, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def outcome(fn, *args, **kw):
    """Run a reader: the value, or the CheckpointError; anything else fails the property."""
    try:
        return fn(*args, **kw)
    except UnclassifiedCheckpointError as e:     # a hole in the readers' own checks
        pytest.fail(f"unclassified failure: {e}")
    except CheckpointError as e:
        return e


def valid_model(m) -> None:
    from transformers import LlamaForCausalLM

    assert isinstance(m, LlamaForCausalLM), type(m)
    for k, t in list(m.named_parameters()) + list(m.named_buffers()):
        assert not t.is_meta and bool(torch.isfinite(t).all()), k


# --------------------------------------------------------------------------- the unpickler
_PIECES = [
    P2, b"\x80\x04", b"\x80\x05", b"}", b"]", b")", b"(", b"t", b"u", b"s", b"a", b"e", b"b", b"R", b"\x81",
    b"\x85", b"\x86", b"\x87", b"N", b"\x88", b"\x89", b"0", b"1", b"2", b".", b"\x94", b"Q",
    binint(0), binint(3), binint(-1), binint(1 << 20), b"K\x00", b"K\x07", b"q\x00", b"q\x01", b"h\x00", b"h\x01",
    b"r\x05\x00\x00\x00", b"j\x00\x00\x00\x00", uni("storage"), uni("0"), uni("cpu"), uni("cuda:0"), uni("x"),
    glob("torch", "FloatStorage"), glob("torch", "HalfStorage"), glob("torch._utils", "_rebuild_tensor_v2"),
    glob("torch._utils", "_rebuild_parameter"), glob("collections", "OrderedDict"), glob("builtins", "set"),
    glob("torch", "Size"), glob("_codecs", "encode"), glob("copyreg", "_reconstructor"), glob("builtins", "object"),
    glob("torch._tensor", "_rebuild_from_type_v2"), glob("torch", "Tensor"), glob("posix", "system"),
    glob("transformers.models.llama.modeling_llama", "LlamaModel"), glob("component.svd_llama", "SVD_LlamaMLP"),
    glob("tokenizers", "Tokenizer"), b"\x8c\x05torch\x94\x8c\x04Size\x94\x93", b"\x95\x10\x00\x00\x00\x00\x00\x00\x00",
    storage_pid(numel=4), storage_pid(numel=2), storage_pid("HalfStorage", numel=8),
    rebuild(storage_pid(numel=4), 0, (2, 2), (2, 1)), rebuild(storage_pid(numel=4), 1, (3,), (1,)),
]


@st.composite
def opcode_streams(draw):
    """Mostly well-formed opcodes (so the unpickler, not only the scan, is reached), some raw bytes."""
    piece = st.one_of(*[st.sampled_from(_PIECES)] * 8, st.binary(min_size=1, max_size=4))
    body = b"".join(draw(st.lists(piece, max_size=40)))
    if draw(st.integers(0, 3)):
        body = P2 + body + b"."
    return body


@FUZZ
@given(data=opcode_streams(), family=st.sampled_from([None, "svdllm", "dobi", "state_dict"]))
def test_restricted_unpickler_on_random_opcode_streams(data, family):
    with tempfile.TemporaryDirectory() as d:
        p = torch_zip(Path(d) / "f.pt", data, {"data/0": floats(1, 2, 3, 4)})
        outcome(safe_torch_load, p, family)


@FUZZ
@given(raw=st.binary(max_size=2048))
def test_random_bytes_as_a_checkpoint_file(raw):
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "m_whitening_only_0.8.pt"
        p.write_bytes(raw)
        outcome(detect_format, p)
        outcome(load_checkpoint, p, family="svdllm")
        outcome(load_checkpoint, p, family="dobi")


# --------------------------------------------------------------------------- real checkpoints, mutated
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Small real checkpoints: every family's writer, plus a transformers-4.35-style SVD-LLM pickle.

    The factors are plain truncated SVD (the readers do not care how factors were found; this keeps
    the set-up free of calibration)."""
    from legacy_checkpoints import svdllm_pickle

    from lowrank_lib import factorize

    d = tmp_path_factory.mktemp("fz")
    m = models.tiny_model("tiny-gqa", seed=0, num_hidden_layers=1)
    svd = families.get("svd").compress(m, None, 0.6)
    out = {fam: write_native(svd, fam, d / fam) for fam in ("asvd", "basis_sharing", "svdllm", "dobi", "dobi-remap",
                                                              "lowrank")}
    import copy

    out["palu"] = write_native(factorize(copy.deepcopy(m), keep=0.6, targets=("k_proj", "v_proj")), "palu", d / "palu")
    mha = models.tiny_model("tiny-mha", seed=0, num_hidden_layers=1, max_position_embeddings=64)
    out["legacy_svdllm"] = svdllm_pickle(families.get("svd").compress(mha, None, 0.6), d / "legacy", protocol=4)[0]
    return out


def _targets(root: Path) -> list[Path]:
    return sorted(p for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file())


@st.composite
def mutations(draw, n_files: int):
    """(file index, mutation kind, parameters) applied to one file of a checkpoint."""
    idx = draw(st.integers(0, n_files - 1))
    kind = draw(st.sampled_from(["truncate", "flip", "overwrite", "inner"]))
    return idx, kind, draw(st.floats(0, 1)), draw(st.lists(st.integers(0, 2 ** 31), min_size=1, max_size=6)), \
        draw(st.binary(min_size=1, max_size=16))


def _mutate_bytes(raw: bytes, kind: str, where: float, ints: list[int], junk: bytes) -> bytes:
    if not raw:
        return junk
    b = bytearray(raw)
    at = int(where * (len(b) - 1))
    if kind == "truncate":
        return bytes(b[:at])
    if kind == "flip":
        for i in ints:
            pos = i % len(b)
            b[pos] ^= 1 << (i % 8)
        return bytes(b)
    b[at:at + len(junk)] = junk
    return bytes(b)


def _mutate(path: Path, kind, where, ints, junk) -> None:
    raw = path.read_bytes()
    if kind == "inner" and zipfile.is_zipfile(path) and raw[:4] == b"PK\x03\x04":
        with zipfile.ZipFile(path) as zf:
            recs = [(i.filename, zf.read(i.filename)) for i in zf.infolist()]
        with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zf:      # valid zip, corrupted pickle inside
            for name, data in recs:
                zf.writestr(name, _mutate_bytes(data, "flip", where, ints, junk) if name.endswith("data.pkl") else data)
        return
    if kind == "inner" and path.suffix == ".safetensors" and len(raw) > 8:
        n = int.from_bytes(raw[:8], "little")
        if 8 + n <= len(raw):                                          # corrupt the JSON header only
            path.write_bytes(raw[:8] + _mutate_bytes(raw[8:8 + n], "overwrite", where, ints, junk) + raw[8 + n:])
            return
    path.write_bytes(_mutate_bytes(raw, "overwrite" if kind == "inner" else kind, where, ints, junk))


FAMILY_CASES = ["asvd", "basis_sharing", "palu", "svdllm", "dobi", "dobi-remap", "lowrank", "legacy_svdllm"]


@FUZZ
@given(fam=st.sampled_from(FAMILY_CASES), data=st.data())
def test_mutated_real_checkpoints(base, fam, data):
    src = base[fam] if fam not in ("dobi",) else base[fam].parent
    with tempfile.TemporaryDirectory() as d:
        dst = Path(d) / src.name
        if src.is_dir():
            shutil.copytree(src, dst)
        else:
            shutil.copy(src, dst)
        files = _targets(dst)
        idx, kind, where, ints, junk = data.draw(mutations(len(files)))
        _mutate(files[idx], kind, where, ints, junk)
        res = outcome(load_checkpoint, dst)
        if not isinstance(res, CheckpointError):
            valid_model(res)


# --------------------------------------------------------------------------- valid torch.save files, then corrupted
_leaf = st.one_of(st.integers(-5, 5), st.text(max_size=4), st.none(), st.booleans(),
                  st.builds(lambda n, h: (torch.arange(n, dtype=torch.float32) * 0.5).to(torch.float16 if h else
                                                                                             torch.float32),
                            st.integers(0, 6), st.booleans()))
_objects = st.recursive(_leaf, lambda kids: st.one_of(st.lists(kids, max_size=4), st.tuples(kids, kids),
                                                      st.dictionaries(st.text(max_size=3), kids, max_size=4)),
                        max_leaves=12)


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return a == b


@FUZZ
@given(obj=_objects, protocol=st.integers(2, 5), legacy=st.booleans(), flips=st.lists(st.integers(0, 2 ** 20),
                                                                                     max_size=3))
def test_torch_saves_load_as_torch_loads_them_or_are_refused(obj, protocol, legacy, flips):
    """Unmutated: our reader returns what torch.load returns. Bit-flipped: a value or CheckpointError.

    (The reference is ``torch.load(weights_only=False)`` on files this test wrote itself: torch's
    weights-only unpickler does not support every protocol-4/5 opcode, e.g. FRAME.)"""
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "sd.pt"
        torch.save({"x": obj}, p, pickle_protocol=protocol, _use_new_zipfile_serialization=not legacy)
        if not flips:
            assert _same(safe_torch_load(p, "state_dict"), torch.load(p, weights_only=False))
            return
        raw = bytearray(p.read_bytes())
        for f in flips:
            raw[f % len(raw)] ^= 1 << (f % 8)
        p.write_bytes(bytes(raw))
        outcome(safe_torch_load, p, "state_dict")


# --------------------------------------------------------------------------- config.json values
_json = st.recursive(st.none() | st.booleans() | st.integers(-3, 1 << 40) | st.floats(allow_nan=True) |
                     st.text(max_size=6) | st.sampled_from(["default", "linear", "dynamic", "yarn", "llama3", "silu"]),
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
                         st.sampled_from(["rope_type", "type", "factor", "rope_theta", "low_freq_factor",
                                          "high_freq_factor", "original_max_position_embeddings", "x"]),
                         kids, max_size=4), max_leaves=8)
_FIELDS = ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps",
           "tie_word_embeddings", "attention_bias", "mlp_bias", "rope_theta", "rope_scaling", "rope_parameters",
           "eos_token_id", "truncation_ranks", "architectures", "model_type"]


@FUZZ
@given(edits=st.dictionaries(st.sampled_from(_FIELDS), _json, min_size=1, max_size=3))
def test_random_config_values(base, edits):
    import json

    with tempfile.TemporaryDirectory() as d:
        dst = Path(shutil.copytree(base["asvd"], Path(d) / "asvd"))
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(edits)
        (dst / "config.json").write_text(json.dumps(cfg))
        res = outcome(load_checkpoint, dst)
        if not isinstance(res, CheckpointError):
            valid_model(res)
