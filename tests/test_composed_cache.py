"""The composed cache's math and its KV methods (lowrank_lib.kv.methods.composed): exact tier + AttSVD low-rank
tier + dropped, at a byte budget.

Full budget = dense; bytes held = the plan's bytes <= the budget (positions counted); int8 factors really int8;
head-wise eviction keeps the scorer's top tokens + the window; a full-rank low-rank tier is exact; KVzip's global
allocation is non-uniform and gives the reconstruction queries' statistics."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.compat import cache_kw
from lowrank_lib.kv.methods.composed import TierBytes, allocate, importance, plan_bytes, segments
from lowrank_lib.eviction import SCORERS
from lowrank_lib.kv import make_method
from lowrank_lib.kv.hf_adapter import KVCache, dense_cache, record, tiered_attention
from lowrank_lib.kv.tiers import descriptor_nbytes

S, D, L, H = 64, 16, 2, 2


@pytest.fixture(scope="module")
def setup():
    tiny = models.tiny_model("tiny-gqa", seed=0).eval()
    g = torch.Generator().manual_seed(0)
    ids, nxt = torch.randint(0, 256, (1, S), generator=g), torch.randint(0, 256, (1, 5), generator=g)
    with torch.no_grad():
        rec = record(tiny, ids)
        ref = tiny(nxt, **cache_kw(dense_cache(rec, tiny))).logits
    return tiny, ids, nxt, rec, ref


def _logits(tiny, cache, nxt):
    with torch.no_grad(), tiered_attention(tiny):
        return tiny(nxt, **cache_kw(cache)).logits


def _dense_bytes(rec):
    return 2 * L * H * S * D * rec.keys[0].element_size()


def _tier_bytes(cache):
    """Bytes of the tiers (exact rows, positions, factors, scales, bases), the segment descriptors left out."""
    return sum(l.tier_nbytes - 8 * (l.e_off.numel() + l.r_off.numel() + l.runs.numel()) for l in cache.states)


@pytest.mark.parametrize("mid_share", [0.0, 0.3])
def test_full_budget_is_dense(setup, mid_share):
    tiny, ids, nxt, rec, ref = setup
    cache = KVCache.from_prefill(make_method("composed-h2o_norm-q8", 1.03, mid_share=mid_share), rec, tiny)
    d = cache.describe()                                     # int16 positions (+1.6 %) and the descriptors
    assert d["bytes_ratio"] <= 1.03
    assert (d["tokens_exact"], d["tokens_lowrank"]) == (L * H * S, 0)
    torch.testing.assert_close(_logits(tiny, cache, nxt), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [0.5, 0.25, 0.125])
@pytest.mark.parametrize("quant8", [False, True])
def test_bytes_held_are_the_plan_and_fit_the_budget(setup, budget, quant8):
    tiny, ids, nxt, rec, ref = setup
    cache = KVCache.from_prefill(make_method("composed-h2o_norm-q8", budget, mid_share=0.3, rank=4, quant8=quant8),
                                 rec, tiny)
    held = _tier_bytes(cache)
    imp = importance(SCORERS["h2o_norm"](), rec, None, 512)
    cost = TierBytes(D, 4, S, 4, quant8)
    avail = budget * _dense_bytes(rec) - L * descriptor_nbytes(H, H)     # the descriptors count against the budget
    plans = allocate(imp.score, avail, cost, 0.3)
    assert held == plan_bytes(plans, cost) <= avail
    assert cache.describe()["bytes_ratio"] <= budget
    d = cache.describe()
    assert d["tokens_lowrank"] > 0 and d["tokens_exact"] > 0
    if d["tokens_exact"] + d["tokens_lowrank"] < L * H * S:   # tight: one more low-rank token (+ a basis) would not fit
        assert avail - held < cost.mid_token() + cost.basis()
    else:                                        # only int8 factors at half the bytes keep every token; the
        assert budget == 0.5 and quant8          # slack turned low-rank tokens exact until one more would not fit
        assert avail - held < cost.exact
    assert all(l.a_k.dtype == (torch.int8 if quant8 else torch.float32) for l in cache.states)
    before = cache.nbytes
    _logits(tiny, cache, nxt)
    assert cache.nbytes == before + 5 * 2 * L * H * D * 4    # appended rows exact


def test_head_wise_eviction_keeps_the_scorers_top_tokens_and_the_window(setup):
    tiny, ids, nxt, rec, ref = setup
    n = 20
    budget = (n * TierBytes(D, 4, S).exact * H + descriptor_nbytes(H, 0)) * L / _dense_bytes(rec)   # + descriptors
    cache = KVCache.from_prefill(make_method("snapkv", budget, window=6), rec, tiny)
    raw = SCORERS["snapkv"]().score(rec.keys[0], rec.values[0], rec.observation(0))[0]     # [H, S]
    layer = cache.states[0]
    for h in range(H):
        lo, hi = layer.host_e_off[h], layer.host_e_off[h + 1]
        kept = layer.pos_exact[lo:hi].long().tolist()
        s = raw[h].clone()
        s[-6:] = float("inf")
        want = (s + torch.arange(S) * 1e-12).topk(n).indices.sort().values.tolist()
        assert hi - lo == n and kept == want
        torch.testing.assert_close(layer.k_exact[lo:hi], rec.keys[0][0, h, kept])
    with pytest.raises(ValueError, match="statistics"):
        segments(rec, importance(SCORERS["snapkv"](), rec, 6, stats=False), 0.5, mid_share=0.2)


def test_full_rank_low_rank_tier_is_exact(setup):
    """rank = head_dim: the AttSVD factors of the middle tier reproduce its K/V, so the composed cache equals
    keeping exact + middle tokens exactly."""
    tiny, ids, nxt, rec, ref = setup
    cache = KVCache.from_prefill(make_method("composed-h2o_norm-q8", 0.5, mid_share=0.6, rank=D, quant8=False),
                                 rec, tiny)
    assert cache.describe()["tokens_lowrank"] > 0
    for li, l in enumerate(cache.states):
        for h in range(H):
            _, _, js = l.segment(h)
            for j in js:
                a_k, b_k, a_v, b_v = l.run_factors(j)
                n, otok = l.host_runs[j][1], l.host_runs[j][6]
                p = l.pos_mid[otok:otok + n].long()
                torch.testing.assert_close(a_k @ b_k, rec.keys[li][0, h, p], rtol=1e-4, atol=1e-4)
                torch.testing.assert_close(a_v @ b_v, rec.values[li][0, h, p], rtol=1e-4, atol=1e-4)


def test_kvzip_global_allocation_is_non_uniform(setup):
    tiny, ids, nxt, rec, ref = setup
    cache = KVCache.from_prefill(make_method("kvzip", 0.25), rec, tiny)
    counts = [c for l in cache.states for c in l.segment_counts()[0]]
    avail = 0.25 * _dense_bytes(rec) - L * descriptor_nbytes(H, 0)          # the descriptors count against the budget
    assert len(set(counts)) > 1 and sum(counts) == int(avail // TierBytes(D, 4, S).exact)
    imp = importance(SCORERS["kvzip"](), rec)
    assert imp.mass and imp.gram[0].shape == (1, H, D, D)        # the reconstruction queries' statistics


def test_allocate_rejects_bad_share_and_a_fitted_layer_needs_its_routing(setup):
    tiny, ids, nxt, rec, ref = setup
    with pytest.raises(ValueError, match="mid_share"):
        allocate([torch.rand(1, 2, 8)], 100, TierBytes(4, 4, 8, 2), mid_share=1.0)
    with pytest.raises(ValueError, match="mid_share"):
        make_method("composed-kvzip", 0.5, mid_share=1.0)
    cache = KVCache.from_prefill(make_method("streamingllm", 0.5), rec, tiny)
    with torch.no_grad(), pytest.raises(TypeError, match="serving"):
        tiny(nxt, **cache_kw(cache))
