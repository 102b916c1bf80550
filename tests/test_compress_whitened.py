"""WhitenedSpectra: SVD-LLM v1 at any keep by slicing one full-rank decomposition."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import models
from mapped import mapped_from
from lowrank_lib.compress import collect_stats, compress_svdllm
from lowrank_lib.compress.whitened import WhitenedSpectra
from lowrank_lib.data import random_token_batches
from lowrank_lib.factorized import LowRankLinear, iter_linears


@pytest.fixture(scope="module")
def gqa():
    m = models.tiny_model("tiny-gqa", seed=0)
    stats = collect_stats(m, random_token_batches(256, 8, 64, seed=1), progress=False)
    return m, stats, WhitenedSpectra(m, stats, progress=False)


def _lowrank(model):
    return {n: mod for n, mod in model.named_modules() if isinstance(mod, LowRankLinear)}


@pytest.mark.parametrize("keep", [0.2, 0.55, 0.8, 1.0])
def test_truncating_the_cache_equals_compress_svdllm(gqa, keep):
    m, stats, spectra = gqa
    ref = _lowrank(compress_svdllm(m, stats, keep, progress=False))
    got_model = spectra.compress(m, keep)
    got = _lowrank(got_model)
    assert set(got) == set(ref) and len(got) == len(list(iter_linears(m)))
    for name, r in ref.items():
        g = got[name]
        assert g.rank == r.rank, name
        # the same rank-r map (factors may differ by the sign of a component)
        torch.testing.assert_close(g.dense_weight(), r.dense_weight(), rtol=1e-5, atol=1e-6)
    assert got_model.lowrank_meta["family"] == "svdllm" and got_model.lowrank_meta["keep"] == keep
    x = random_token_batches(256, 1, 32, seed=3)
    with torch.no_grad():
        torch.testing.assert_close(got_model(x).logits, compress_svdllm(m, stats, keep, progress=False)(x).logits,
                                   rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(12, 30), (30, 12), (16, 16)])
def test_whitened_full_equals_svdllm_factors_at_every_rank(shape):
    from lowrank_lib.compress.calib import cholesky_lower
    from lowrank_lib.compress.common import whitened_factors
    from lowrank_lib.compress.whitened import whitened_full

    g = torch.Generator().manual_seed(0)
    W = torch.randn(*shape, generator=g, dtype=torch.float64)
    X = torch.randn(200, shape[1], generator=g, dtype=torch.float64) * torch.logspace(0, 3, shape[1], dtype=torch.float64)
    L = cholesky_lower(X.T @ X)
    u, v = whitened_full(W, L)
    k = min(shape)
    assert u.shape == (shape[0], k) and v.shape == (k, shape[1])
    for r in range(1, k + 1):
        a, b = whitened_factors(W, L, r)
        torch.testing.assert_close(u[:, :r] @ v[:r], a @ b, rtol=1e-9, atol=1e-9 * float(W.norm()))
        # the same balanced split as SVD-LLM: column norms of u equal row norms of v times ||L|| scale
        torch.testing.assert_close(u[:, :r].norm(dim=0), a.norm(dim=0), rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(u @ v, W, rtol=1e-9, atol=1e-9)
    # a rank-deficient W gives zero components, not huge ones
    Wd = W.clone()
    Wd[-1] = Wd[0] if shape[0] < shape[1] else Wd[-1]
    Wd[:, -1] = Wd[:, 0] if shape[0] >= shape[1] else Wd[:, -1]
    u, v = whitened_full(Wd, L)
    assert torch.isfinite(u).all() and torch.isfinite(v).all() and float(u.abs().max()) < 1e6
    torch.testing.assert_close(u @ v, Wd, rtol=1e-8, atol=1e-8)


def test_explicit_ranks_and_full_rank_exact(gqa):
    m, stats, spectra = gqa
    full = {n: min(lin.out_features, lin.in_features) for n, lin in iter_linears(m)}
    x = random_token_batches(256, 2, 32, seed=7)
    with torch.no_grad():
        dense, fr = m(x).logits, spectra.compress(m, ranks=full)(x).logits
    assert float((fr - dense).norm() / dense.norm()) < 1e-5
    one = next(iter(full))
    part = spectra.compress(m, ranks={one: 3})
    assert list(_lowrank(part)) == [one] and _lowrank(part)[one].rank == 3


def test_model_and_cache_untouched_and_not_aliased(gqa):
    m, stats, spectra = gqa
    before = {n: lin.weight.clone() for n, lin in iter_linears(m)}
    c = spectra.compress(m, 0.5)
    for mod in _lowrank(c).values():
        mod.U.data.zero_()
        mod.V.data.zero_()
    again = _lowrank(spectra.compress(m, 0.5))
    assert all(float(mod.U.abs().sum()) > 0 for mod in again.values())
    for n, lin in iter_linears(m):
        assert not isinstance(lin, LowRankLinear)
        assert torch.equal(lin.weight, before[n])


def test_errors(gqa):
    m, stats, spectra = gqa
    with pytest.raises(ValueError, match="exactly one"):
        spectra.factors()
    with pytest.raises(ValueError, match="outside"):
        spectra.factors(ranks={next(iter(spectra.u)): 10 ** 6})
    with pytest.raises(KeyError, match="not a decomposed"):
        spectra.factors(ranks={"model.nope": 1})
    with pytest.raises(ValueError, match="already factorized"):
        WhitenedSpectra(spectra.compress(m, 0.5), stats, progress=False)



def test_the_disk_cache_returns_the_same_spectra_and_misses_on_any_change(tmp_path):
    """cached(): a miss computes and writes, the next call reads the same bits back (no calibration, no SVD); other
    weights, other calibration tokens or a damaged file are a miss, and a damaged file is replaced."""
    m = models.tiny_model("tiny-gqa", seed=0)
    ids = random_token_batches(256, 4, 32, seed=1)
    a, ia = WhitenedSpectra.cached(m, ids, cache_dir=tmp_path, progress=False)
    b, ib = WhitenedSpectra.cached(m, ids, cache_dir=tmp_path, progress=False)
    assert not ia["hit"] and ib["hit"] and ia["path"] == ib["path"] and ia["whiten_s"] > 0 and ib["whiten_s"] == 0
    assert set(a.u) == set(b.u) and all(torch.equal(a.u[n], b.u[n]) and torch.equal(a.v[n], b.v[n]) for n in a.u)
    direct = WhitenedSpectra(m, collect_stats(m, ids, progress=False), progress=False)
    assert all(torch.equal(direct.u[n], b.u[n]) for n in direct.u)
    x = random_token_batches(256, 1, 16, seed=3)
    with torch.no_grad():
        assert torch.equal(a.compress(m, 0.5)(x).logits, b.compress(m, 0.5)(x).logits)
    other_ids = ids.clone()
    other_ids[0, 0] = (other_ids[0, 0] + 1) % 256
    assert not WhitenedSpectra.cached(m, other_ids, cache_dir=tmp_path, progress=False)[1]["hit"]
    m2 = models.tiny_model("tiny-gqa", seed=0)
    with torch.no_grad():
        m2.model.layers[1].mlp.down_proj.weight[0, 0] += 1e-3
    _, i2 = WhitenedSpectra.cached(m2, ids, cache_dir=tmp_path, progress=False)
    assert not i2["hit"] and i2["key"] != ia["key"] and len(list(tmp_path.glob("*.safetensors"))) == 3
    assert mapped_from(a.u[next(iter(a.u))], ia["path"])     # the miss returns the written file's factors, mapped
    p = tmp_path / f"{ia['key']}.safetensors"
    half = p.read_bytes()[: p.stat().st_size // 2]           # damaged (a new file: the old one stays mapped by a, b)
    p.unlink()
    p.write_bytes(half)                                      # computed and written again
    c, ic = WhitenedSpectra.cached(m, ids, cache_dir=tmp_path, progress=False)
    assert not ic["hit"] and all(torch.equal(c.u[n], a.u[n]) for n in a.u)
    assert WhitenedSpectra.cached(m, ids, cache_dir=tmp_path, progress=False)[1]["hit"]


def test_the_cache_is_pruned_least_recently_used_first(tmp_path):
    import os

    from lowrank_lib.compress.spectra_cache import prune_cache

    files = []
    for i in range(4):
        f = tmp_path / f"{i}.safetensors"
        f.write_bytes(b"x" * 1000)
        os.utime(f, (1000 + i, 1000 + i))
        files.append(f)
    os.utime(files[0], (2000, 2000))                                   # 0 used last: 1 is the oldest now
    assert prune_cache(tmp_path, 3000, keep=files[1]) == [files[2]]    # 1, the oldest, is kept: 2 goes
    assert [f.exists() for f in files] == [True, True, False, True]
    assert prune_cache(tmp_path, 1000) == [files[1], files[3]]
    assert prune_cache(tmp_path, 10 ** 6) == []
