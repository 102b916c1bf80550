"""The AttSVD cache inside transformers: prefill bit-identical to dense, full rank == dense decode,
error falls with rank, generate() == manual loop, left padding, stream window bounds, fallback warning,
reversible registration, memory accounting (Eq. 6 at 8k, synthetic), MHA and GQA."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

from lowrank_lib import models
from lowrank_lib.attsvd import AttSVDCache, AttSVDConfig
from lowrank_lib.attsvd.cache import AttSVDLayer
from lowrank_lib.hf import Observation, capture

PRESETS = ["tiny-mha", "tiny-gqa"]


def _model(preset):
    m = models.tiny_model(preset, seed=0)
    return m.eval(), m.config.hidden_size // m.config.num_attention_heads


def _run(model, cache, ids, nxt, mask=None):
    with torch.no_grad(), capture(model, cache):
        pre = model(ids, attention_mask=mask, past_key_values=cache).logits
    with torch.no_grad():
        m2 = None if mask is None else torch.cat([mask, torch.ones_like(nxt)], 1)
        post = model(nxt, attention_mask=m2, past_key_values=cache).logits
    return pre, post


@pytest.mark.parametrize("preset", PRESETS)
def test_prefill_bit_identical_and_full_rank_exact(preset):
    model, d = _model(preset)
    ids, nxt = torch.randint(0, 256, (2, 80)), torch.randint(0, 256, (2, 7))
    dense = DynamicCache(config=model.config)
    with torch.no_grad():
        pre_d = model(ids, past_key_values=dense).logits
        post_d = model(nxt, past_key_values=dense).logits
    for cfg in (AttSVDConfig(ratio=0.5, window=8), AttSVDConfig(rank=d, window=0)):
        cache = AttSVDCache(model, cfg)
        pre, post = _run(model, cache, ids, nxt)
        assert torch.equal(pre, pre_d)                       # prefill served exactly
        assert not cache.used_fallback
        assert cache.layers[0].kv.runs[0][0].shape[-2] == cache.layers[0].bulk_len == 80 - cfg.window
    # the last cache is full rank with every token factored: decode reproduces dense (fp32 tolerance)
    torch.testing.assert_close(post, post_d, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("aware", [True, False])
def test_decode_error_falls_with_rank(aware):
    model, d = _model("tiny-gqa")
    ids, nxt = torch.randint(0, 256, (1, 96)), torch.randint(0, 256, (1, 8))
    with torch.no_grad():
        dense = DynamicCache(config=model.config)
        model(ids, past_key_values=dense)
        ref = model(nxt, past_key_values=dense).logits
    errs = []
    for r in (2, 6, 10, d):
        _, post = _run(model, AttSVDCache(model, AttSVDConfig(rank=r, window=4, attention_aware=aware)), ids, nxt)
        errs.append(float((post - ref).norm()))
    assert errs[0] > errs[1] > errs[2] > errs[3] and errs[3] < 1e-3 * errs[0]


def test_generate_equals_manual_loop_and_registration_is_reversible():
    model, _ = _model("tiny-gqa")
    ids = torch.randint(0, 256, (1, 60))
    registry = lambda: (dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping),
                        dict(ALL_ATTENTION_FUNCTIONS), dict(ALL_MASK_ATTENTION_FUNCTIONS),
                        model.config._attn_implementation)
    before = registry()
    sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
    other = models.tiny_model("tiny-mha", seed=1).eval()      # another model in the process: untouched
    x = torch.randint(0, 256, (1, 9))
    with torch.no_grad():
        other_ref = other(x).logits
    cfg = AttSVDConfig(ratio=0.5, window=6, mode="stream", chunk=4)
    cache = AttSVDCache(model, cfg)
    with capture(model, cache):
        # the model keeps its implementation (and its mask function); only the "sdpa" entry is overridden
        assert model.config._attn_implementation == "sdpa" and ALL_ATTENTION_FUNCTIONS["sdpa"] is not sdpa
        gen = model.generate(ids, past_key_values=cache, max_new_tokens=12, do_sample=False)
        with torch.no_grad():
            assert torch.equal(other(x).logits, other_ref)
    assert registry() == before and ALL_ATTENTION_FUNCTIONS["sdpa"] is sdpa
    manual = AttSVDCache(model, cfg)
    with torch.no_grad():
        with capture(model, manual):
            logits = model(ids, past_key_values=manual).logits[:, -1]
        toks = []
        for i in range(12):
            nxt = logits.argmax(-1, keepdim=True)
            toks.append(nxt)
            if i < 11:
                logits = model(nxt, past_key_values=manual).logits[:, -1]
    assert torch.equal(gen[:, 60:], torch.cat(toks, 1))
    assert cache.get_seq_length() == manual.get_seq_length() == 71


@pytest.mark.parametrize("preset,impl", [("tiny-mha", "sdpa"), ("tiny-gqa", "sdpa"), ("tiny-gqa", "eager")])
def test_left_padding_matches_unpadded_rows(preset, impl):
    """With the mask function registered, a left-padded row gives the same outputs as that prompt alone."""
    model, d = _model(preset)
    model.set_attn_implementation(impl)
    cfg = AttSVDConfig(ratio=0.5, window=4)
    a, b = torch.randint(3, 256, (1, 50)), torch.randint(3, 256, (1, 40))
    nxt = torch.randint(3, 256, (2, 3))
    ids = torch.cat([a, torch.cat([torch.zeros(1, 10, dtype=torch.long), b], 1)])
    mask = torch.ones_like(ids)
    mask[1, :10] = 0
    pre, post = _run(model, AttSVDCache(model, cfg), ids, nxt, mask)
    pre_b, post_b = _run(model, AttSVDCache(model, cfg), b, nxt[1:])
    torch.testing.assert_close(pre[1, 10:], pre_b[0], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(post[1], post_b[0], rtol=1e-3, atol=1e-3)


def test_stream_window_bounds_and_accumulate_growth():
    model, d = _model("tiny-mha")
    ids = torch.randint(0, 256, (1, 40))
    w, l = 6, 5
    for mode in ("stream", "accumulate"):
        cache = AttSVDCache(model, AttSVDConfig(rank=4, window=w, mode=mode, chunk=l))
        with torch.no_grad():
            with capture(model, cache):
                model(ids, past_key_values=cache)
            for step in range(23):
                model(torch.randint(0, 256, (1, 1)), past_key_values=cache)
                layer = cache.layers[1]
                n = layer.keys.shape[-2]
                if mode == "stream":
                    assert w <= n < w + l and len(layer.blocks) == (step + 1) // l
                else:
                    assert n == w + step + 1 and not layer.blocks
        total = cache.layers[1].bulk_len + sum(ak.shape[-2] for ak, _, _, _ in cache.layers[1].blocks) + \
            cache.layers[1].keys.shape[-2]
        assert total == cache.layers[1].kv.length
        assert total == cache.get_seq_length() == 63
    assert len(cache.layers[1].blocks) == 0
    # stream: 23 tokens after a window of 6 -> (6 + 23 - 6) // 5 = 4 frozen blocks of l tokens
    stream = AttSVDCache(model, AttSVDConfig(rank=4, window=w, mode="stream", chunk=l))
    with torch.no_grad():
        with capture(model, stream):
            model(ids, past_key_values=stream)
        model(torch.randint(0, 256, (1, 23)), past_key_values=stream)
    assert len(stream.layers[0].blocks) == 4 and stream.layers[0].blocks[0][0].shape[-2:] == (l, 4)


def test_fallback_without_queries_warns_and_still_works():
    model, _ = _model("tiny-gqa")
    cache = AttSVDCache(model, AttSVDConfig(ratio=0.5, window=4))
    with torch.no_grad():
        model(torch.randint(0, 256, (1, 30)), past_key_values=cache)
        with pytest.warns(RuntimeWarning, match="falling back to unweighted SVD"):
            model(torch.randint(0, 256, (1, 1)), past_key_values=cache)
    assert cache.used_fallback and cache.layers[0].kv.info is not None and not cache.layers[0].kv.info.weighted


def test_energy_rule_ranks_reported_per_layer_and_head():
    model, d = _model("tiny-gqa")
    cache = AttSVDCache(model, AttSVDConfig(tau=0.9, window=4, rank_max=d - 2))
    _run(model, cache, torch.randint(0, 256, (1, 64)), torch.randint(0, 256, (1, 2)))
    rep = cache.memory()
    assert len(rep.rank_k) == len(rep.head_rank_k) == 2 and len(rep.head_rank_k[0]) == 2
    for l, rk, rv in zip(cache.layers, rep.rank_k, rep.rank_v):
        assert 1 <= rk <= d - 2 and 1 <= rv <= d - 2
        assert rk == min(d - 2, int(l.kv.info.head_rank_k.max())) and rv == min(d - 2, int(l.kv.info.head_rank_v.max()))


def test_memory_matches_eq6_at_8k_synthetic():
    """Accounting on a synthetic 8k cache (no model): stored bytes == (r_K + r_V)(S - w + d) + 2 w d
    entries per head, and the ratio is (r_K + r_V)/(2d) up to the d/S and w/S terms."""
    B, H, G, S, d, w = 1, 3, 3, 8192, 64, 32
    for rk, rv in ((32, 32), (16, 48)):
        layer = AttSVDLayer(AttSVDConfig(rank_k=rk, rank_v=rv, window=w, obs_window=128))
        K, V = torch.randn(B, H, S, d), torch.randn(B, H, S, d)
        layer.update(K, V)
        layer.observe(Observation(torch.randn(B, H * G, 128, d), d ** -0.5, torch.arange(S - 128, S)))
        assert layer.keys.shape[-2] == w and layer.rank_k == rk and layer.rank_v == rv
        entries = (rk + rv) * (S - w + d) + 2 * w * d
        assert layer.nbytes == layer.kv.nbytes == B * H * entries * 4
        assert layer.dense_nbytes == B * H * 2 * S * d * 4
        ratio = layer.nbytes / layer.dense_nbytes
        target = (rk + rv) / (2 * d)
        assert abs(ratio - target) <= target * d / S + w / S + 1e-9
        assert abs(ratio - target) < 0.006
