"""Eviction scorers and the eviction methods built on them: real eviction (only the kept rows and their positions
are held), positions and masks right after eviction (a multi-token forward equals the same tokens one by one),
each scorer keeps what it claims, scorers reading attention need the queries; a recorded prefill serves every
registry method like a live one."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from lowrank_lib import models
from lowrank_lib.compat import cache_kw
from lowrank_lib.eviction import H2O, SCORERS, KeyDiff, Observation, SnapKV, StreamingLLM
from lowrank_lib.eviction.budget import token_bytes
from lowrank_lib.kv.tiers import descriptor_nbytes
from lowrank_lib.kv import METHODS, make_method, method_kind
from lowrank_lib.kv.hf_adapter import KVCache, dense_cache, record, tiered_attention

S, N_KEEP, L, H, D = 64, 20, 2, 2, 16
# every (layer, head) keeps N_KEEP tokens: their rows and positions, and the layout's descriptors (held bytes too)
BUDGET = (H * N_KEEP * token_bytes(D, 4, S) + descriptor_nbytes(H, 0)) / (H * 2 * S * D * 4)


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model("tiny-gqa", seed=0).eval()


@pytest.mark.compat
@pytest.mark.parametrize("name", sorted(n for n in SCORERS if n != "kvzip"))
def test_eviction_holds_its_budget_and_decodes_consistently(tiny, name):
    ids, nxt = torch.randint(0, 256, (1, S)), torch.randint(0, 256, (1, 5))
    cache = KVCache(make_method(name, BUDGET, window=6 if SCORERS[name].forced_window is None else None), tiny)
    with torch.no_grad():
        with cache.serving(tiny):
            pre = tiny(ids, **cache_kw(cache)).logits
        ref = tiny(ids, **cache_kw(DynamicCache(config=tiny.config))).logits
        assert torch.equal(pre, ref)                                   # the prefill is served exactly
        layer = cache.states[0]
        assert layer.segment_counts()[0] == [N_KEEP] * H and cache.get_seq_length() == S
        if SCORERS[name].forced_window is None:                          # the normalised ones opt out
            for h in range(H):
                assert layer.pos_exact[layer.host_e_off[h + 1] - 6:layer.host_e_off[h + 1]].tolist() == \
                    list(range(S - 6, S))                                # window always kept
        # multi-token step after eviction == the same tokens one by one (mask offsets are right)
        with tiered_attention(tiny):
            many = tiny(nxt, **cache_kw(cache)).logits
        one = KVCache(make_method(name, BUDGET, window=6 if SCORERS[name].forced_window is None else None), tiny)
        with one.serving(tiny):
            tiny(ids, **cache_kw(one))
            steps = torch.cat([tiny(nxt[:, i:i + 1], **cache_kw(one)).logits for i in range(5)], 1)
    torch.testing.assert_close(many, steps, rtol=1e-4, atol=1e-4)
    held = cache.nbytes - sum(8 * (l.e_off.numel() + l.r_off.numel() + l.runs.numel()) for l in cache.states)
    assert held == L * H * (N_KEEP * token_bytes(D, 4, S) + 5 * 2 * D * 4)   # kept rows + positions + 5 appended


def test_policy_scores_pick_expected_tokens():
    B, S_, d = 1, 32, 8
    K, V = torch.randn(B, H, S_, d), torch.randn(B, H, S_, d)
    s = StreamingLLM(sinks=4).score(K, V, None)
    assert s.topk(6).indices.sort().values[0, 0].tolist() == [0, 1, 2, 3, 30, 31]
    Kd = K.clone()
    Kd[:, :, 5] = -Kd.mean(2) * 50         # anti-aligned with the mean key direction -> most different
    assert int(KeyDiff().score(Kd, V, None).argmax(-1)[0, 0]) == 5
    q = torch.zeros(B, H * 2, S_, d)
    Kh = torch.zeros(B, H, S_, d)
    Kh[:, :, 7, 0] = 10.0                  # key 7 aligned with every query: a heavy hitter
    q[..., 0] = 1.0
    obs = Observation(q, 1.0, torch.arange(S_), Kh)
    assert int(H2O().score(Kh, V, obs)[0, 0, 8:].argmax()) + 8 != 7
    assert int(H2O().score(Kh, V, obs)[0, 0].argmax()) == 7
    assert int(SnapKV(obs_window=8, kernel=1).score(Kh, V, obs)[0, 1].argmax()) == 7


def test_scorers_reading_attention_need_the_queries(tiny):
    rec = record(tiny, torch.randint(0, 256, (1, 30)), queries=False)
    with pytest.raises(ValueError, match="keys and queries"):
        make_method("h2o", 0.5).fit(rec)
    make_method("keydiff", 0.5).fit(rec)                              # attention-free: fine without them


@pytest.mark.compat
def test_a_recorded_prefill_serves_every_method_like_a_live_one(tiny):
    ids, nxt = torch.randint(0, 256, (1, 96)), torch.randint(0, 256, (1, 4))
    rec = record(tiny, ids)
    with torch.no_grad():
        ref = tiny(nxt, **cache_kw(dense_cache(rec, tiny))).logits
        for name in METHODS:
            m = lambda: make_method(name, 0.5, **({"window": 8, "chunk": 4} if method_kind(name) == "lowrank" else {}))
            fitted = KVCache.from_prefill(m(), rec, tiny)
            live = KVCache(m(), tiny)
            with live.serving(tiny):
                tiny(ids, **cache_kw(live))
                b = tiny(nxt, **cache_kw(live)).logits
            with fitted.serving(tiny):
                a = tiny(nxt, **cache_kw(fitted)).logits
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            if name == "dense":
                torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-5)
            else:
                assert fitted.describe()["bytes_ratio"] < 0.75, name
