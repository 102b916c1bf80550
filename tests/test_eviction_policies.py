"""Eviction baselines (lowrank_lib.eviction, every policy of the POLICIES registry): real eviction (stored
rows shrink), memory matched to AttSVD (Eq. 6), positions and masks right after eviction, each policy keeps
what it claims; the KV method registry (lowrank_lib.eval.methods) end to end."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from lowrank_lib import models
from lowrank_lib.attsvd import AttSVDConfig
from lowrank_lib.eval.methods import EXT_OBS_WINDOW, METHODS, MethodSpec, attsvd_stored_tokens
from lowrank_lib.eviction import H2O, POLICIES, EvictionBudget, EvictionCache, KeyDiff, SnapKV, StreamingLLM
from lowrank_lib.hf import Observation, capture, dense_from, record_prefill, replay


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model("tiny-gqa", seed=0).eval()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_eviction_stores_budget_and_decodes_consistently(tiny, name):
    ids, nxt = torch.randint(0, 256, (1, 64)), torch.randint(0, 256, (1, 5))
    cache = EvictionCache(tiny, POLICIES[name](), EvictionBudget(tokens=20, window=6))
    with torch.no_grad():
        with capture(tiny, cache):
            pre = tiny(ids, past_key_values=cache).logits
        ref = tiny(ids, past_key_values=DynamicCache(config=tiny.config)).logits
        assert torch.equal(pre, ref)
        layer = cache.layers[0]
        assert layer.keys.shape == (1, 2, 20, 16) and cache.get_seq_length() == 64
        assert layer.kept_idx[..., -6:].tolist() == [[list(range(58, 64))] * 2]      # window always kept
        # multi-token step after eviction == the same tokens one by one (mask offsets are right)
        many = tiny(nxt, past_key_values=cache).logits
        one = EvictionCache(tiny, POLICIES[name](), EvictionBudget(tokens=20, window=6))
        with capture(tiny, one):
            tiny(ids, past_key_values=one)
        steps = torch.cat([tiny(nxt[:, i:i + 1], past_key_values=one).logits for i in range(5)], 1)
    torch.testing.assert_close(many, steps, rtol=1e-4, atol=1e-4)
    assert cache.memory().stored_bytes == 2 * 2 * (20 + 5) * 16 * 4 * 2   # layers * K,V * rows * d * fp32 * heads


def test_policy_scores_pick_expected_tokens():
    B, H, S, d = 1, 2, 32, 8
    K, V = torch.randn(B, H, S, d), torch.randn(B, H, S, d)
    s = StreamingLLM(sinks=4).score(K, V)
    assert s.topk(6).indices.sort().values[0, 0].tolist() == [0, 1, 2, 3, 30, 31]
    Kd = K.clone()
    Kd[:, :, 5] = -Kd.mean(2) * 50         # anti-aligned with the mean key direction -> most different
    assert int(KeyDiff().score(Kd, V).argmax(-1)[0, 0]) == 5
    q = torch.zeros(B, H * 2, S, d)
    Kh = torch.zeros(B, H, S, d)
    Kh[:, :, 7, 0] = 10.0                  # key 7 aligned with every query: a heavy hitter
    q[..., 0] = 1.0
    obs = Observation(q, 1.0, torch.arange(S))
    assert int(H2O().score(Kh, V, obs)[0, 0, 8:].argmax()) + 8 != 7
    assert int(H2O().score(Kh, V, obs)[0, 0].argmax()) == 7
    assert int(SnapKV(obs_window=8, kernel=1).score(Kh, V, obs)[0, 1].argmax()) == 7


def test_attention_policies_need_queries(tiny):
    cache = EvictionCache(tiny, H2O(), EvictionBudget(tokens=10, window=2))
    with torch.no_grad():
        tiny(torch.randint(0, 256, (1, 30)), past_key_values=cache)
        with pytest.raises(RuntimeError, match="needs the post-RoPE"):
            tiny(torch.randint(0, 256, (1, 1)), past_key_values=cache)


def test_methods_matched_memory_and_replay_equals_live(tiny):
    S = 96
    ids, nxt = torch.randint(0, 256, (1, S)), torch.randint(0, 256, (1, 4))
    base = AttSVDConfig(rank=1, window=8, chunk=4)
    with torch.no_grad():
        rec = record_prefill(tiny, ids)
        ref = tiny(nxt, past_key_values=dense_from(rec, tiny)).logits
        ratios = {}
        for name in METHODS:
            spec = MethodSpec(name, 0.5, base)
            replayed = replay(rec, spec.make(tiny, S))
            live = spec.make(tiny, S)
            with capture(tiny, live):
                tiny(ids, past_key_values=live)
            a = tiny(nxt, past_key_values=replayed).logits
            b = tiny(nxt, past_key_values=live).logits
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
            if name == "dense":
                torch.testing.assert_close(a, ref)
                continue
            rep = replayed.memory()
            # memory of the prefill part (before the 4 decode tokens) from the layers' own accounting
            ratios[name] = rep.stored_bytes / rep.dense_bytes
    lowrank = ratios["attsvd"]
    assert lowrank == pytest.approx(ratios["svd"]) == pytest.approx(ratios["attsvd-ext"]) and lowrank < 0.75
    ext = MethodSpec("attsvd-ext", 0.5, base).attsvd_config(16)
    assert ext.key_mass and ext.obs_window == EXT_OBS_WINDOW and ext.rank == 8 and ext.attention_aware
    n = attsvd_stored_tokens(S, 16, 8, 8, 8)
    for name in POLICIES:
        assert ratios[name] == pytest.approx(lowrank, abs=1.0 / S)   # matched to within one token
    assert n == pytest.approx(lowrank * S - 0, abs=4.5)              # Eq. 6 in tokens (4 decode tokens exact)
