"""lowrank_lib.resolve: (dense reference, compressed model, tokenizer) from MODEL and CHECKPOINT (issue 28)."""
import pytest
import torch

from lowrank_lib import models, synthetic
from lowrank_lib.factorized import LowRankLinear
from lowrank_lib.formats import CheckpointError, load_checkpoint
from lowrank_lib.resolve import (NO_TOKENIZER, Resolved, describe, load_normalised, normalised_path, resolve_models,
                                 source_hash)

#: the families whose native folder holds the tokenizer they were saved with (save_pretrained); the pickled ones
#: (SVD-LLM, Dobi) pickle it into the .pt, which is never unpickled, and our format keeps none
HF_FOLDERS = {"asvd", "basis_sharing", "dobi-remap", "palu"}


@pytest.fixture(autouse=True)
def model_cache(tmp_path, monkeypatch):
    """Each test its own model cache (the normalised checkpoints resolve_models writes)."""
    monkeypatch.setenv("LOWRANK_LIB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    """Every family's native checkpoint at the tiny ``quick`` shape (vocabulary 512, as tiny-smol), saved with a
    tokenizer."""
    root = tmp_path_factory.mktemp("families")
    tok = synthetic.synthetic_tokenizer(synthetic.SHAPES["quick"]["vocab_size"])
    return {fam: synthetic.write_family(fam, "quick", root / fam, keep=0.6, tokenizer=tok)
            for fam in synthetic.FAMILIES}


@pytest.fixture(scope="module")
def reference_dir(tmp_path_factory):
    """A dense reference of the ``quick`` shape as a local HF directory (random weights), with the synthetic
    tokenizer and without: what ``MODEL`` names beside such a checkpoint."""
    shape = synthetic.SHAPES["quick"]
    dense = models.tiny_model("tiny-gqa", **shape, tie_word_embeddings=False)
    dirs = {"with": tmp_path_factory.mktemp("reference"), "bare": tmp_path_factory.mktemp("reference-bare")}
    for path in dirs.values():
        dense.save_pretrained(path)
    synthetic.synthetic_tokenizer(shape["vocab_size"]).save_pretrained(dirs["with"])
    return dirs


@pytest.mark.parametrize("family", synthetic.FAMILIES)
def test_a_checkpoint_of_every_family_resolves(family_files, reference_dir, family):
    path = family_files[family]
    dense, comp, tok = resolve_models(None, path)
    assert dense is None
    assert comp.lowrank_meta["family"] == synthetic.families_format(family)
    assert any(isinstance(m, LowRankLinear) for m in comp.modules())
    assert {p.dtype for p in comp.parameters()} == {torch.float32}
    ids = torch.randint(0, comp.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.isfinite(comp(ids).logits).all()
    assert (tok is not None) == (family in HF_FOLDERS), tok
    if tok is not None:
        assert len(tok) == synthetic.SHAPES["quick"]["vocab_size"]
    # with a reference of the same geometry: the reference and its tokenizer, else (a folder without one) the
    # checkpoint's; the compressed model read from the normalised cache this time, the same tensors as the native file
    dense, comp2, tok2 = resolve_models(reference_dir["with"], path)
    assert dense.config.vocab_size == comp2.config.vocab_size and tok2 is not None
    assert (resolve_models(reference_dir["bare"], path).tokenizer is not None) == (tok is not None)
    ours = comp.lowrank_meta["family"] == "lowrank"                   # our own format: already mmap-able, read as is
    assert comp2.lowrank_meta.get("normalised_cache") == (
        None if ours else str(normalised_path(source_hash(path), torch.float32)))
    assert comp2.lowrank_meta["source"] == str(path) and comp2.lowrank_meta["family"] == comp.lowrank_meta["family"]
    native = load_checkpoint(path, dtype=torch.float32)
    assert comp2.state_dict().keys() == native.state_dict().keys()
    for (k, a), b in zip(comp2.state_dict().items(), native.state_dict().values()):
        assert torch.equal(a, b), k
    # what a notebook says it ran on; the banner only where there is no tokenizer at all
    info = describe(None, path, Resolved(None, comp, tok))
    assert info["label"].startswith(f"{path.name} ({comp.lowrank_meta['family']}, keep 0.6")
    assert info["banner"] == (None if tok is not None else NO_TOKENIZER) and not info["random_weights"]


def test_a_reference_of_another_vocabulary_or_geometry_is_refused(family_files):
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the reference tiny-gqa 256"):
        resolve_models("tiny-gqa", family_files["svdllm"])
    with pytest.raises(ValueError, match=r"differ in hidden_size \(64 vs 192\), intermediate_size \(160 vs 512\), "
                                         r"num_hidden_layers \(2 vs 4\).*not its dense model"):
        resolve_models("tiny-smol", family_files["svdllm"])


@pytest.mark.parametrize("method", ["svd", "svdllm"])
def test_without_a_checkpoint_the_reference_is_compressed_as_before(method):
    """CHECKPOINT=None: the dense model of MODEL, compressed by ``method`` at ``keep`` (what bench's loader did)."""
    from lowrank_lib.compress import COMPRESSORS, collect_stats, compress_svd
    from lowrank_lib.compress.calib import calibration_data

    dense, comp, tok = resolve_models("tiny-smol", method=method, keep=0.6, calib_samples=2, calib_seq_len=16)
    ref, _ = models.load("tiny-smol")
    if method == "svd":
        want = compress_svd(ref, 0.6)
    else:
        want = COMPRESSORS[method](ref, collect_stats(ref, calibration_data(None, 2, 16, vocab_size=512)), 0.6)
    assert tok is None
    assert dense.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(dense.state_dict()[k], v), k
    got, exp = comp.state_dict(), want.state_dict()
    assert got.keys() == exp.keys()
    for k in exp:
        assert torch.equal(got[k], exp[k]), k
    assert sum(isinstance(m, LowRankLinear) for m in comp.modules()) > 0


def test_an_unreadable_checkpoint_raises_the_loaders_error_before_the_reference_loads(family_files, tmp_path,
                                                                                      monkeypatch):
    good = family_files["svdllm"]
    bad = tmp_path / good.name
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])              # truncated
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"not a checkpoint at all")

    def no_reference(*a, **k):
        raise AssertionError("the reference was loaded before the checkpoint was read")

    monkeypatch.setattr(models, "load", no_reference)
    for path in (bad, junk):
        with pytest.raises(CheckpointError) as e:
            resolve_models("tiny-smol", path)
        assert str(path) in str(e.value) and e.value.path == str(path)


def test_what_cannot_be_resolved():
    with pytest.raises(ValueError, match="a model, a checkpoint, or both"):
        resolve_models(None, None)
    with pytest.raises(ValueError, match="takes no checkpoint"):
        resolve_models("llama7b-random", "x.pt")
    with pytest.raises(ValueError, match="unknown method 'nope'"):
        resolve_models("tiny-smol", method="nope")


def test_the_second_resolve_reads_the_normalised_cache_and_a_changed_file_misses_it(tmp_path, monkeypatch,
                                                                                    model_cache):
    """Two notebooks of one run read the native file once: the second resolve maps the normalised copy back (the
    native reader is not called); a file whose bytes changed (same size, same mtime) is read natively again."""
    import os

    from lowrank_lib import formats

    path = synthetic.write_family("svdllm", "quick", tmp_path / "a", keep=0.6, seed=0)
    calls = []
    real = formats.load_checkpoint
    monkeypatch.setattr(formats, "load_checkpoint", lambda p, *a, **k: calls.append(str(p)) or real(p, *a, **k))
    first = resolve_models(None, path).compressed
    entry = normalised_path(source_hash(path), torch.float32)
    assert calls == [str(path)] and (entry / "model.safetensors").is_file()
    calls.clear()
    second = resolve_models(None, path).compressed
    assert calls == [str(entry)]
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)
    # same size and mtime, other bytes (another seed): a miss, read natively, and its own entry
    orig, st = path.read_bytes(), path.stat()
    other = synthetic.write_family("svdllm", "quick", tmp_path / "b", keep=0.6, seed=1)
    assert other.stat().st_size == st.st_size
    path.write_bytes(other.read_bytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    calls.clear()
    third = resolve_models(None, path).compressed
    assert calls == [str(path)] and normalised_path(source_hash(path), torch.float32) != entry
    assert not torch.equal(third.model.layers[0].self_attn.q_proj.U, second.model.layers[0].self_attn.q_proj.U)
    # a damaged entry is made again from the native file, never trusted
    path.write_bytes(orig)
    (entry / "model.safetensors").write_bytes(b"junk")
    calls.clear()
    again = resolve_models(None, path).compressed
    assert calls == [str(entry), str(path)]
    for a, b in zip(first.state_dict().values(), again.state_dict().values()):
        assert torch.equal(a, b)
    calls.clear()
    resolve_models(None, path)
    assert calls == [str(entry)]
    # cache=False: the native file, nothing written
    entries = sorted((model_cache / "normalised").iterdir())
    calls.clear()
    load_normalised(other, cache=False)
    assert calls == [str(other)] and sorted((model_cache / "normalised").iterdir()) == entries


def test_the_normalised_cache_is_pruned_least_recently_used_first(family_files, model_cache, monkeypatch):
    """Past $LOWRANK_LIB_NORMALISED_CACHE_GB, writing an entry deletes the least recently used others (a hit
    refreshes its entry); the entry just written and entries being written (``.tmp``) stay."""
    import os
    import time

    from lowrank_lib.models import prune_lru

    a, b, c = family_files["svdllm"], family_files["dobi"], family_files["asvd"]      # entries of about one size
    load_normalised(a)
    load_normalised(b)
    ea, eb = (normalised_path(source_hash(p), torch.float32) for p in (a, b))
    old = time.time() - 100
    os.utime(ea, (old, old))
    os.utime(eb, (old - 50, old - 50))                    # b the least recently used ...
    assert load_normalised(b).lowrank_meta["normalised_cache_hit"]      # ... until this hit refreshes it
    writing = model_cache / "normalised" / "f00-float32.tmp123"
    writing.mkdir()
    size = max(sum(f.stat().st_size for f in e.rglob("*") if f.is_file()) for e in (ea, eb))
    monkeypatch.setenv("LOWRANK_LIB_NORMALISED_CACHE_GB", str(2.5 * size / 1e9))   # room for about two entries
    load_normalised(c)
    ec = normalised_path(source_hash(c), torch.float32)
    assert ec.is_dir() and eb.is_dir() and not ea.exists() and writing.is_dir()
    assert prune_lru(model_cache / "normalised", 0, keep=ec) == [eb]             # everything but the kept one
    assert ec.is_dir() and writing.is_dir()


@pytest.mark.parametrize("family", synthetic.FAMILIES)
def test_auto_dtype_is_fp32_unless_three_fp32_copies_of_the_checkpoint_exceed_memory(family_files, family,
                                                                                       monkeypatch):
    """``run_dtype("auto")`` (what a report's ``DTYPE: auto`` and a notebook's load use): the checkpoint's stored
    values (read from its headers) decide; a model that would not fit three times in fp32 loads in bf16."""
    from lowrank_lib import resolve
    from lowrank_lib.factorized import account

    path = family_files[family]
    n = resolve.checkpoint_params(path)
    held = account(load_checkpoint(path)).total_params
    assert 0.5 * held <= n <= 1.5 * held, (n, held)
    fits = resolve.COPIES * 4 * n
    assert resolve.run_dtype("auto", path, memory_bytes=fits) == "fp32"
    assert resolve.run_dtype("auto", path, memory_bytes=fits - 1) == "bf16"
    assert resolve.run_dtype("fp32", path, memory_bytes=1) == "fp32" and resolve.run_dtype("auto", None) == "fp32"
    monkeypatch.setattr(resolve.host, "physical_memory", lambda: fits - 1)        # a machine too small for fp32
    _, comp, _ = resolve_models(None, path)
    assert {p.dtype for p in comp.parameters()} == {torch.bfloat16}
    _, comp, _ = resolve_models(None, path, dtype=torch.float32)            # an explicit dtype wins
    assert {p.dtype for p in comp.parameters()} == {torch.float32}


def test_auto_dtype_reads_no_unreadable_file(tmp_path):
    from lowrank_lib.resolve import run_dtype

    bad = tmp_path / "model.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError):
        run_dtype("auto", bad)
