"""FactorSpectra: a compressed model's own factors re-decomposed, so any lower rank is a slice (notebook 00's
slider on a checkpoint you bring)."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import models
from mapped import mapped_from
from lowrank_lib.compress import FactorSpectra, compress_svd, compress_svdllm, collect_stats
from lowrank_lib.data import random_token_batches
from lowrank_lib.factorized import LowRankLinear, account


@pytest.fixture(scope="module")
def ckpt():
    dense = models.tiny_model("tiny-gqa", seed=0)
    stats = collect_stats(dense, random_token_batches(256, 4, 32, seed=1), progress=False)
    comp = compress_svdllm(dense, stats, 0.6, progress=False)       # factors with unequal sides, not orthogonal
    return comp, FactorSpectra(comp, progress=False)


def _lr(m):
    return {n: x for n, x in m.named_modules() if isinstance(x, LowRankLinear)}


def test_at_the_stored_rank_the_model_is_the_checkpoint(ckpt):
    comp, sp = ckpt
    same = sp.compress(comp, keep=1.0)                         # every rank clamps at the stored one
    assert {n: x.rank for n, x in _lr(same).items()} == {n: x.rank for n, x in _lr(comp).items()}
    x = random_token_batches(256, 1, 24, seed=3)
    with torch.no_grad():                                     # the stored factors themselves: the same logits
        assert torch.equal(same(x).logits, comp(x).logits)
        assert torch.equal(sp.compress(comp, keep=1.0, share=True)(x).logits, comp(x).logits)
    assert same.lowrank_meta["truncated_from"] == comp.lowrank_meta["keep"]
    mine = _lr(comp)
    assert all(x.U.data_ptr() != mine[n].U.data_ptr() for n, x in _lr(same).items())       # copies, unless shared


@pytest.mark.parametrize("keep", [0.1, 0.3, 0.5])
def test_a_lower_rank_is_the_best_approximation_of_the_stored_map(ckpt, keep):
    comp, sp = ckpt
    got = _lr(sp.compress(keep=keep))
    for name, orig in _lr(comp).items():
        g = got[name]
        assert g.rank == sp.rank(name, keep) <= orig.rank
        W = orig.dense_weight().double()
        U, S, Vh = torch.linalg.svd(W, full_matrices=False)
        k = g.rank
        best = (U[:, :k] * S[:k]) @ Vh[:k]
        torch.testing.assert_close(g.dense_weight().double(), best, rtol=1e-4, atol=1e-5)
    assert account(sp.compress(keep=keep)).total_params < account(comp).total_params


def test_refusals(ckpt):
    comp, sp = ckpt
    with pytest.raises(ValueError, match="model it was built from"):
        sp.compress(models.tiny_model("tiny-gqa", seed=0), keep=0.5)
    with pytest.raises(ValueError, match="no LowRankLinear"):
        FactorSpectra(models.tiny_model("tiny-gqa", seed=0))
    name = next(iter(sp.u))
    with pytest.raises(ValueError, match="outside"):
        sp.factors(ranks={name: sp.stored_rank(name) + 1})
    with pytest.raises(ValueError, match="exactly one"):
        sp.factors()


def test_plain_svd_checkpoint_truncates_like_compress_svd():
    """A plain-SVD checkpoint truncated further equals plain SVD of the dense model at the lower keep (the
    stored map's leading components ARE the dense matrix's)."""
    dense = models.tiny_model("tiny-gqa", seed=0)
    comp = compress_svd(dense, 0.8)
    low = FactorSpectra(comp, progress=False).compress(keep=0.4)
    ref = compress_svd(dense, 0.4)
    x = random_token_batches(256, 1, 16, seed=4)
    with torch.no_grad():
        torch.testing.assert_close(low(x).logits, ref(x).logits, rtol=1e-3, atol=1e-3)


def test_a_truncated_copy_never_copies_the_factors_it_replaces(ckpt):
    """``copy_for_factors`` (what every ``compress`` copies the model with) leaves out each parameter that only the
    replaced modules hold: a checkpoint's U / V, a basis whose every sharer is replaced; a basis shared with a module
    that stays, the embedding and the norms are real copies. So the slider's peak is not a second checkpoint."""
    import copy

    from lowrank_lib.compress.common import copy_for_factors

    comp, _ = ckpt
    comp = copy.deepcopy(comp)
    lrs = _lr(comp)
    a, b = "model.layers.0.self_attn.q_proj", "model.layers.1.self_attn.q_proj"
    lrs[b].V = lrs[a].V                                       # one basis, two holders (Basis Sharing)
    nbytes = lambda t: t.untyped_storage().nbytes()
    for names, basis_copied in ((set(lrs), False), (set(lrs) - {b}, True)):
        cp = copy_for_factors(comp, names)
        got = _lr(cp)
        for n in names - {a}:
            assert nbytes(got[n].U) == got[n].U.element_size() and got[n].U.shape == lrs[n].U.shape, n
        assert (nbytes(got[a].V) == lrs[a].V.numel() * lrs[a].V.element_size()) == basis_copied
        emb = cp.model.embed_tokens.weight
        assert nbytes(emb) == nbytes(comp.model.embed_tokens.weight) and emb.data_ptr() != \
            comp.model.embed_tokens.weight.data_ptr()


def test_shared_factors_are_views_of_the_spectra_with_the_same_logits(ckpt):
    """``compress(..., share=True)`` (the keep slider's: each keep is measured, then dropped) holds views of the
    spectra, no new bytes, and computes what the copies compute."""
    comp, sp = ckpt
    x = random_token_batches(256, 1, 16, seed=5)
    copied, shared = sp.compress(comp, 0.4), sp.compress(comp, 0.4, share=True)
    for n, m in _lr(shared).items():
        assert m.U.untyped_storage().data_ptr() == sp.u[n].untyped_storage().data_ptr()
        assert m.V.untyped_storage().data_ptr() == sp.v[n].untyped_storage().data_ptr()
        assert m.rank == _lr(copied)[n].rank < sp.stored_rank(n)
    for n, m in _lr(copied).items():
        assert m.U.untyped_storage().data_ptr() != sp.u[n].untyped_storage().data_ptr()
    emb = comp.model.embed_tokens.weight                     # the rest: the checkpoint's own tensors, or copies
    assert shared.model.embed_tokens.weight is emb and copied.model.embed_tokens.weight.data_ptr() != emb.data_ptr()
    with torch.no_grad():
        assert torch.equal(shared(x).logits, copied(x).logits)


def test_16_bit_factors_are_re_decomposed_in_float32_within_their_own_rounding(ckpt):
    """bf16 factors are re-decomposed in float32 (not float64): at the stored rank the map equals the stored one
    within the bf16 rounding of the new factors, and half the rank is the best rank-r approximation of the stored map
    within that rounding too."""
    import copy

    comp, sp64 = ckpt
    half = copy.deepcopy(comp).to(torch.bfloat16)
    sp = FactorSpectra(half, progress=False)
    for n, m in _lr(half).items():
        stored = m.U.double() @ m.V.double()
        got = sp.u[n].double() @ sp.v[n].double()
        err = float((got - stored).norm() / stored.norm())
        assert sp.u[n].dtype == torch.bfloat16 and err < 2 ** -8, (n, err)
        r = max(1, sp.stored_rank(n) // 2)
        best = torch.linalg.svdvals(stored)[r:].square().sum().sqrt() / stored.norm()
        trunc = float(((sp.u[n][:, :r].double() @ sp.v[n][:r].double()) - stored).norm() / stored.norm())
        assert trunc <= float(best) + 2 ** -7, (n, trunc, float(best))


def test_cached_spectra_read_back_equal_and_follow_the_weights(ckpt, tmp_path):
    """``FactorSpectra.cached``: the first call decomposes and writes, the second reads the same factors back (and
    truncates to the same model); other weights are a miss; a damaged file is made again; a file over the limit is
    not kept."""
    import copy

    comp, _ = ckpt
    a, ia = FactorSpectra.cached(comp, cache_dir=tmp_path, progress=False)
    b, ib = FactorSpectra.cached(comp, cache_dir=tmp_path, progress=False)
    assert (ia["hit"], ia["written"], ib["hit"]) == (False, True, True) and ia["key"] == ib["key"]
    assert ia["decompose_s"] > 0 and ib["decompose_s"] == 0.0
    assert set(a.u) == set(b.u) and all(torch.equal(a.u[n], b.u[n]) and torch.equal(a.v[n], b.v[n]) for n in a.u)
    x = random_token_batches(256, 1, 12, seed=7)
    with torch.no_grad():
        assert torch.equal(a.compress(comp, 0.4)(x).logits, b.compress(comp, 0.4, share=True)(x).logits)
    other = copy.deepcopy(comp)
    with torch.no_grad():
        next(iter(_lr(other).values())).U.mul_(2)
    assert not FactorSpectra.cached(other, cache_dir=tmp_path, progress=False)[1]["hit"]
    path = tmp_path / f"{ia['key']}.safetensors"
    assert mapped_from(a.u[next(iter(a.u))], path)           # the miss returns the written file's factors, mapped
    path.unlink()                                            # damaged (a new file: the old one stays mapped by a, b)
    path.write_bytes(b"not a safetensors file")
    c, ic = FactorSpectra.cached(comp, cache_dir=tmp_path, progress=False)
    assert not ic["hit"] and ic["written"] and all(torch.equal(a.u[n], c.u[n]) for n in a.u)
    d, idd = FactorSpectra.cached(comp, cache_dir=tmp_path / "small", progress=False, max_cache_bytes=1000)
    assert not idd["written"] and not list((tmp_path / "small").glob("*.safetensors"))


def test_the_stored_rank_of_a_bf16_checkpoint_is_its_own_factors(ckpt):
    """In bf16 the re-decomposed factors round differently from the stored ones, so the slider's top keep (the
    stored rank) serves the checkpoint's own factors: exactly the checkpoint's logits; one component less is the
    re-decomposition's."""
    import copy

    comp, _ = ckpt
    half = copy.deepcopy(comp).to(torch.bfloat16)
    sp = FactorSpectra(half, progress=False)
    x = random_token_batches(256, 1, 12, seed=8)
    with torch.no_grad():
        assert torch.equal(sp.compress(half, keep=1.0, share=True)(x).logits, half(x).logits)
    name = next(iter(sp.u))
    lower = sp.factors(ranks={name: sp.stored_rank(name) - 1})[name]
    assert lower.rank == sp.stored_rank(name) - 1 and torch.equal(lower.U, sp.u[name][:, :-1])
