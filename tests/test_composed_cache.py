"""The composed cache (lowrank_lib.composed): exact tier + AttSVD low-rank tier + dropped, at a byte budget.

Full budget = dense; bytes held = the plan's bytes <= the budget (positions counted); the ragged eviction
(no low-rank tier) equals EvictionCache; factor-space attention over the tiers equals dense attention over
the rebuilt K/V; a full-rank low-rank tier is exact."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lowrank_lib import models
from lowrank_lib.compat import cache_kw
from lowrank_lib.composed import ComposedConfig, HeadTiers, Q8, TierBytes, allocate, attend, build, \
    composed_attention, importance, make_policy, plan_bytes
from lowrank_lib.eviction import POLICIES, EvictionBudget, EvictionCache
from lowrank_lib.hf import dense_from, record_prefill, replay

S, D, L, H = 64, 16, 2, 2


@pytest.fixture(scope="module")
def setup():
    tiny = models.tiny_model("tiny-gqa", seed=0).eval()
    g = torch.Generator().manual_seed(0)
    ids, nxt = torch.randint(0, 256, (1, S), generator=g), torch.randint(0, 256, (1, 5), generator=g)
    with torch.no_grad():
        rec = record_prefill(tiny, ids)
        ref = tiny(nxt, **cache_kw(dense_from(rec, tiny))).logits
    return tiny, ids, nxt, rec, ref


def _logits(tiny, cache, nxt):
    with torch.no_grad(), composed_attention(tiny):
        return tiny(nxt, **cache_kw(cache)).logits


def _dense_bytes(rec):
    return 2 * L * H * S * D * rec.keys[0].element_size()


@pytest.mark.parametrize("mid_share", [0.0, 0.3])
def test_full_budget_is_dense(setup, mid_share):
    tiny, ids, nxt, rec, ref = setup
    imp = importance(make_policy("h2o_norm", tiny), tiny, None, ids, rec)
    cache = build(rec, imp, 1.02, ComposedConfig(scorer="h2o_norm", mid_share=mid_share))   # int16 positions: +1.6 %
    assert cache.tier_counts() == {"exact": L * H * S, "mid": 0, "total": L * H * S}
    torch.testing.assert_close(_logits(tiny, cache, nxt), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [0.5, 0.25, 0.125])
@pytest.mark.parametrize("quant8", [False, True])
def test_bytes_held_are_the_plan_and_fit_the_budget(setup, budget, quant8):
    tiny, ids, nxt, rec, ref = setup
    imp = importance(make_policy("h2o_norm", tiny), tiny, None, ids, rec)
    cfg = ComposedConfig(scorer="h2o_norm", mid_share=0.3, rank=4, quant8=quant8)
    cache = build(rec, imp, budget, cfg)
    mem = cache.memory()
    held = sum(h.nbytes for l in cache.layers for row in l.heads for h in row)
    assert mem.stored_bytes == held == cache.info["plan_bytes"]           # nothing appended yet
    assert held <= budget * _dense_bytes(rec)
    cost = TierBytes(D, 4, S, 4, quant8)
    c = cache.tier_counts()
    assert c["mid"] > 0 and c["exact"] > 0
    if c["exact"] + c["mid"] < c["total"]:       # tight: one more low-rank token (+ its head's basis) would not fit
        assert budget * _dense_bytes(rec) - held < cost.mid_token() + cost.basis()
    else:                                        # only int8 factors at half the bytes keep every token; the
        assert budget == 0.5 and quant8          # slack turned low-rank tokens exact until one more would not fit
        assert budget * _dense_bytes(rec) - held < cost.exact
    # factors really are int8 when asked
    h = next(h for l in cache.layers for row in l.heads for h in row if h.n_mid)
    assert isinstance(h.a_k, Q8) == quant8 and (h.a_k.q.dtype == torch.int8 if quant8 else True)
    _logits(tiny, cache, nxt)
    assert cache.memory().stored_bytes == held + 5 * 2 * L * H * D * 4    # appended rows exact


def test_ragged_eviction_equals_eviction_cache(setup):
    tiny, ids, nxt, rec, ref = setup
    imp = importance(make_policy("snapkv", tiny), tiny, None, ids, rec, window=6, stats=False)
    n = 20
    budget = n * TierBytes(D, 4, S).exact * L * H / _dense_bytes(rec)
    cache = build(rec, imp, budget, ComposedConfig(scorer="snapkv", mode="head", mid_share=0.0))
    ev = replay(rec, EvictionCache(tiny, POLICIES["snapkv"](), EvictionBudget(tokens=n, window=6)))
    assert all(h.n_exact == n for l in cache.layers for row in l.heads for h in row)
    assert [h.pos_exact.long().tolist() for h in cache.layers[0].heads[0]] == ev.layers[0].kept_idx[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(_logits(tiny, cache, nxt), tiny(nxt, **cache_kw(ev)).logits, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="statistics"):
        build(rec, imp, 0.5, ComposedConfig(scorer="snapkv", mid_share=0.2))


def _tiers(g, n_e, n_m, r, d, q8=False):
    k, v = torch.randn(n_e, d, generator=g), torch.randn(n_e, d, generator=g)
    ht = HeadTiers(k, v, torch.arange(n_e, dtype=torch.int16))
    if n_m:
        a_k, a_v = torch.randn(n_m, r, generator=g), torch.randn(n_m, r, generator=g)
        ht.a_k, ht.a_v = (Q8.quantize(a_k), Q8.quantize(a_v)) if q8 else (a_k, a_v)
        ht.b_k, ht.b_v = torch.randn(r, d, generator=g), torch.randn(r, d, generator=g)
        ht.pos_mid = torch.arange(n_e, n_e + n_m, dtype=torch.int16)
    return ht


@pytest.mark.parametrize("q8", [False, True])
def test_factor_space_attention_equals_dense_over_rebuilt_tiers(q8):
    g = torch.Generator().manual_seed(3)
    B, Hk, G, ql, d, t = 2, 2, 3, 4, 8, 6
    heads = [[_tiers(g, 5 + h + b, 7 * h + 3 * b, 3, d, q8) for h in range(Hk)] for b in range(B)]
    heads[1][0] = _tiers(g, 4, 0, 3, d)                            # a head with no low-rank tier
    q = torch.randn(B, Hk * G, ql, d, generator=g)
    kn, vn = torch.randn(B, Hk, t, d, generator=g), torch.randn(B, Hk, t, d, generator=g)
    out = attend(q, heads, kn, vn, 0.3)
    for b in range(B):
        for h in range(Hk):
            k, v, _ = heads[b][h].dense()
            kk, vv = torch.cat([k, kn[b, h]]), torch.cat([v, vn[b, h]])
            n = k.shape[0]
            vis = torch.ones(ql, n + t, dtype=torch.bool)
            vis[:, n:] = torch.ones(ql, t, dtype=torch.bool).tril(t - ql)   # new rows: causal, queries newest
            ref = F.scaled_dot_product_attention(q[b, h * G:(h + 1) * G], kk, vv, attn_mask=vis, scale=0.3)
            torch.testing.assert_close(out[b, h * G:(h + 1) * G], ref, rtol=1e-5, atol=1e-5)


def test_full_rank_low_rank_tier_is_exact(setup):
    """rank = head_dim: the AttSVD factors of the middle tier reproduce its K/V, so the composed cache equals
    keeping exact + middle tokens exactly (a ragged eviction cache over the same positions)."""
    tiny, ids, nxt, rec, ref = setup
    imp = importance(make_policy("h2o_norm", tiny), tiny, None, ids, rec)
    cache = build(rec, imp, 0.5, ComposedConfig(scorer="h2o_norm", mid_share=0.6, rank=D))
    assert cache.tier_counts()["mid"] > 0
    for li, l in enumerate(cache.layers):
        for h, ht in enumerate(l.heads[0]):
            k, v, p = ht.dense()
            torch.testing.assert_close(k, rec.keys[li][0, h, p], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(v, rec.values[li][0, h, p], rtol=1e-4, atol=1e-4)


def test_kvzip_global_allocation_is_non_uniform(setup):
    tiny, ids, nxt, rec, ref = setup
    imp = importance(make_policy("kvzip", tiny), tiny, None, ids, rec)
    cache = build(rec, imp, 0.25, ComposedConfig(scorer="kvzip", mode="global", mid_share=0.0))
    counts = [h.n_exact for l in cache.layers for row in l.heads for h in row]
    assert len(set(counts)) > 1 and sum(counts) == int(0.25 * _dense_bytes(rec) // TierBytes(D, 4, S).exact)
    assert imp.mass and imp.gram[0].shape == (1, H, D, D)        # the reconstruction queries' statistics


def test_allocate_rejects_bad_share_and_dense_attention_is_refused(setup):
    tiny, ids, nxt, rec, ref = setup
    with pytest.raises(ValueError, match="mid_share"):
        allocate([torch.rand(1, 2, 8)], 100, TierBytes(4, 4, 8, 2), mid_share=1.0)
    imp = importance(make_policy("streamingllm", tiny), tiny, None, ids, rec, stats=False)
    cache = build(rec, imp, 0.5, ComposedConfig(scorer="streamingllm", mid_share=0.0))
    with torch.no_grad(), pytest.raises(TypeError, match="composed_attention"):
        tiny(nxt, **cache_kw(cache))
    plans = allocate(imp.score, 0.5 * _dense_bytes(rec), TierBytes(D, 4, S), 0.0)
    assert plan_bytes(plans, TierBytes(D, 4, S)) == cache.info["plan_bytes"]
