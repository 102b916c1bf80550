"""The streaming loader (formats/lazy.py + build.py): what it reads, when, and in which dtype.

In process and fast: the NaN/Inf scan never misses a value, a streamed cast equals ``Tensor.to``,
legacy (unaligned) and zip containers stream to what ``torch.load`` reads, a corrupt record fails
its CRC while streaming, nothing of a refused pickle's tensors is read, the dtype policy (stored
dtypes by default, a cast on request, recorded in ``lowrank_meta``), a mixed-dtype model runs a
forward, and the progress bar. Memory bounds are measured in a child process in
``tests/test_load_memory.py``.
"""
from __future__ import annotations

import os
import zipfile

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowrank_lib import families, load_checkpoint, models
from lowrank_lib.formats import CheckpointError, UnsafePickleError, lazy, write_native
from lowrank_lib.formats.safe_pickle import load_lazy, safe_torch_load

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(dtype=st.sampled_from(FLOATS), n=st.integers(1, 5000), where=st.floats(0, 1),
       bad=st.sampled_from([float("nan"), float("inf"), float("-inf")]))
def test_the_scan_finds_every_nonfinite_value(dtype, n, where, bad):
    t = torch.randn(n).to(dtype)
    assert lazy.finite(t)
    i = int(where * (n - 1))
    t[i] = bad
    assert not lazy.finite(t)
    nan, inf, first = lazy.count_nonfinite(t.view(1, n), chunk_elems=97)
    assert (nan, inf) == ((1, 0) if bad != bad else (0, 1)) and first == (0, i)


@pytest.fixture(scope="module")
def svd_model():
    m = models.tiny_model("tiny-gqa", seed=0, num_hidden_layers=2)
    return families.get("svd").compress(m, None, 0.6)


def _svdllm(model, path):
    return write_native(model, "svdllm", path)


@pytest.mark.parametrize("dtype", [None, torch.float32, torch.bfloat16, torch.float16])
def test_streamed_tensors_equal_the_stored_ones_cast(svd_model, tmp_path, dtype, monkeypatch):
    """Chunks much smaller than a tensor (so the chunked CRC / cast / scan path runs): the loaded tensors
    are exactly ``torch.load``'s, cast with ``Tensor.to``."""
    monkeypatch.setattr(lazy, "CHUNK_BYTES", 1000)
    p = _svdllm(svd_model, tmp_path)
    stored = {k: v for k, v in safe_torch_load(p, "svdllm")["model"]._modules["lm_head"]._parameters.items()}
    r = load_checkpoint(p, dtype=dtype)
    want = stored["weight"] if dtype is None else stored["weight"].to(dtype)
    assert r.lm_head.weight.dtype == want.dtype and torch.equal(r.lm_head.weight, want)
    U = r.model.layers[1].mlp.down_proj.U
    src = svd_model.model.layers[1].mlp.down_proj.U.detach().float()       # SVD-LLM stores factors fp32
    assert torch.equal(U, src if dtype is None else src.to(dtype))


def test_default_keeps_the_stored_dtypes_and_meta_says_so(svd_model, tmp_path):
    p = _svdllm(svd_model, tmp_path)
    r = load_checkpoint(p)
    assert r.model.layers[0].self_attn.q_proj.U.dtype == torch.float32          # factors: fp32 as stored
    assert r.model.embed_tokens.weight.dtype == torch.float16                    # the rest: fp16 as stored
    d = r.lowrank_meta["dtypes"]
    assert d["requested"] is None and d["stored"] == d["loaded"] and set(d["stored"]) == {"float32", "float16"}
    b = load_checkpoint(p, dtype=torch.bfloat16)
    assert {t.dtype for t in b.parameters()} == {torch.bfloat16}
    assert b.lowrank_meta["dtypes"]["requested"] == "bfloat16" and set(b.lowrank_meta["dtypes"]["loaded"]) == \
        {"bfloat16"} and b.lowrank_meta["dtypes"]["stored"] == d["stored"]
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():                    # a model in mixed stored dtypes runs (LowRankLinear casts)
        mixed = r(x).logits.float()
        full = load_checkpoint(p, dtype=torch.float32)(x).logits
    assert float((mixed - full).norm() / full.norm()) < 2e-2


def test_stored_dtype_tensors_view_the_file_mapping(svd_model, tmp_path):
    """Zero copy: a tensor kept in its stored dtype is the file's bytes at its record, in a mapping (a
    ``frombuffer`` storage, not a torch allocation)."""
    from lowrank_lib.formats.safe_pickle import module_tree

    p = _svdllm(svd_model, tmp_path)
    r = load_checkpoint(p)
    U = r.model.layers[0].self_attn.q_proj.U
    lz = module_tree(load_lazy(p, "svdllm")["model"], p).params["model.layers.0.self_attn.q_u_proj.weight"]
    off = lz.record.offset
    assert p.read_bytes()[off:off + lz.nbytes] == U.detach().numpy().tobytes()
    assert not U.untyped_storage().resizable()


def test_a_corrupt_record_fails_its_crc_while_streaming(svd_model, tmp_path, monkeypatch):
    monkeypatch.setattr(lazy, "CHUNK_BYTES", 4096)
    p = _svdllm(svd_model, tmp_path)
    with zipfile.ZipFile(p) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    raw = bytearray(p.read_bytes())
    at = info.header_offset + 30 + len(info.filename) + len(info.extra) + info.file_size // 2
    raw[at] ^= 0x01                      # one bit of one factor: still finite, so only the CRC can tell
    p.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="fails its CRC check"):
        load_checkpoint(p)


def test_the_legacy_container_streams_unaligned_storages(svd_model, tmp_path):
    """Pre-1.6 ``torch.save`` puts storages at odd offsets: each is copied aligned (never two full copies)."""
    p = tmp_path / "sd.pt"
    # odd-sized fp16 storages first (14, 16, 18, ... bytes): where the legacy container's key pickles happen to
    # realign every storage after them (it did with transformers 5.25's model), one more odd storage shifts them
    base = {k: v.detach().clone() for k, v in svd_model.state_dict().items() if "rotary" not in k}
    for n_odd in range(1, 9):
        sd = {f"odd{j}": torch.arange(7 + j, dtype=torch.float16) for j in range(n_odd)} | base
        torch.save(sd, p, _use_new_zipfile_serialization=False)
        lz = load_lazy(p, "state_dict")
        offsets = {lz[k].record.offset % 4 for k in lz}
        if offsets != {0}:
            break
    assert offsets != {0}                                     # really unaligned somewhere
    for k, t in lz.items():
        out, ok = lazy.stream(t, None if t.dtype != torch.float32 else torch.bfloat16)
        want = sd[k] if t.dtype != torch.float32 else sd[k].to(torch.bfloat16)
        assert ok and torch.equal(out, want), k


def test_a_refused_pickle_reads_no_tensor(tmp_path, monkeypatch):
    """The refusal comes from the unpickler; no record was read (so the cost is the pickle's bytes)."""
    from legacy_checkpoints import impersonating, standin

    reads = []
    monkeypatch.setattr(lazy.Record, "data", lambda self: reads.append(self.key))
    monkeypatch.setattr(lazy.Mapping, "crc", lambda self, *a: reads.append(a))
    attn = standin("component.svd_llama.SVD_LlamaAttention")
    m = attn()
    for i in range(8):
        m.register_parameter(f"w{i}", torch.nn.Parameter(torch.randn(256, 256)))

    class Payload:
        def __reduce__(self):
            return os.getcwd, ()

    p = tmp_path / "m_whitening_only_0.8.pt"
    with impersonating([attn]):
        torch.save({"model": m, "tokenizer": Payload()}, p)
    with pytest.raises(UnsafePickleError, match="posix.getcwd"):
        load_checkpoint(p)
    assert reads == []


def test_nonfinite_after_the_cast_is_named(svd_model, tmp_path):
    import copy

    m = copy.deepcopy(svd_model)
    with torch.no_grad():
        m.model.layers[0].mlp.up_proj.U[3, 1] = 1e6            # finite in fp32, inf in fp16
    p = _svdllm(m, tmp_path)
    with pytest.raises(CheckpointError, match=r"up_u_proj.weight' holds 0 NaN and 1 Inf values after casting to "
                                              r"torch.float16 \(first at index \(3, 1\)\)"):
        load_checkpoint(p, dtype=torch.float16)
    r = load_checkpoint(p, dtype=torch.float16, allow_nonfinite=True)
    assert list(r.lowrank_meta["nonfinite"]) == ["model.layers.0.mlp.up_u_proj.weight"]


def test_progress_bar_on_stderr_and_silent_when_asked(svd_model, tmp_path, capsys, monkeypatch):
    from lowrank_lib.formats import build

    p = _svdllm(svd_model, tmp_path)
    monkeypatch.setattr(build, "PROGRESS_DELAY", 0.0)          # a real load shows it after 2 s
    load_checkpoint(p, progress=False)
    assert capsys.readouterr().err == ""
    load_checkpoint(p)
    err = capsys.readouterr().err
    assert f"loading {p.name}" in err and "tensors" in err
