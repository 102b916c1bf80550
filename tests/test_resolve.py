"""lowrank_lib.resolve: (dense reference, compressed model, tokenizer) from MODEL and CHECKPOINT (issue 28)."""
import pytest
import torch

from lowrank_lib import models, synthetic
from lowrank_lib.factorized import LowRankLinear
from lowrank_lib.formats import CheckpointError
from lowrank_lib.resolve import resolve_models

#: the families whose native folder holds the tokenizer they were saved with (save_pretrained); the pickled ones
#: (SVD-LLM, Dobi) pickle it into the .pt, which is never unpickled, and our format keeps none
HF_FOLDERS = {"asvd", "basis_sharing", "dobi-remap", "palu"}


@pytest.fixture(scope="module")
def family_files(tmp_path_factory):
    """Every family's native checkpoint at the tiny ``quick`` shape (vocabulary 512, as tiny-smol), saved with a
    tokenizer."""
    root = tmp_path_factory.mktemp("families")
    tok = synthetic.synthetic_tokenizer(synthetic.SHAPES["quick"]["vocab_size"])
    return {fam: synthetic.write_family(fam, "quick", root / fam, keep=0.6, tokenizer=tok)
            for fam in synthetic.FAMILIES}


@pytest.mark.parametrize("family", synthetic.FAMILIES)
def test_a_checkpoint_of_every_family_resolves(family_files, family):
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
    # with a reference of the same vocabulary: the reference and ITS tokenizer (tiny presets have none)
    dense, comp2, tok2 = resolve_models("tiny-smol", path)
    assert dense.config.vocab_size == comp2.config.vocab_size and tok2 is None
    for a, b in zip(comp.parameters(), comp2.parameters()):
        assert torch.equal(a, b)


def test_a_reference_of_another_vocabulary_is_refused(family_files):
    with pytest.raises(ValueError, match="vocabulary of 512 tokens, the reference tiny-gqa 256"):
        resolve_models("tiny-gqa", family_files["svdllm"])


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
