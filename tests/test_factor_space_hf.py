"""Factor-space decode inside transformers: generate() through the AttSVD cache gives the same tokens
and logits (fp32, rel. err < 1e-5) as the cache's own rebuild path; registrations are reversible."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.attsvd.cache import AttSVDCache
from lowrank_lib.attsvd.config import AttSVDConfig
from lowrank_lib.attsvd.factor_cache import FactorSpaceAttSVDCache, decode_route, factor_space
from lowrank_lib.attsvd.kv import LowRankKV

from helpers import rel_err

TOL = 1e-5


def _registry_names():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    return (dict(AttentionInterface._global_mapping), dict(AttentionMaskInterface._global_mapping),
            dict(ALL_ATTENTION_FUNCTIONS), dict(ALL_MASK_ATTENTION_FUNCTIONS))


def run_generate(model, cfg, route, ids, mask=None, new=12):
    cache = (AttSVDCache if route == "rebuild" else FactorSpaceAttSVDCache)(model, cfg)
    with decode_route(model, cache, route) as stats:
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences, torch.stack(out.scores), cache, stats


@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa"])
@pytest.mark.parametrize("mode", ["accumulate", "stream"])
def test_generate_factor_equals_rebuild(preset, mode):
    model = models.tiny_model(preset, seed=1)
    cfg = AttSVDConfig(ratio=0.5, window=6, mode=mode, chunk=5)
    ids = torch.randint(3, 256, (2, 48))
    mask = torch.ones_like(ids)
    mask[1, :7] = 0                                   # left padding in row 1
    ids[1, :7] = 0
    new = 12
    ref_tok, ref_scores, ref_cache, ref_stats = run_generate(model, cfg, "rebuild", ids, mask, new)
    tok, scores, cache, stats = run_generate(model, cfg, "factor", ids, mask, new)
    assert torch.equal(tok, ref_tok)
    assert rel_err(scores, ref_scores) < TOL
    n_layers = model.config.num_hidden_layers
    assert stats.factor_calls == n_layers * (new - 1)      # every decode step of every layer, no rebuild
    assert stats.dense_calls == n_layers                    # the prefill only
    assert ref_stats.factor_calls == ref_stats.dense_calls == 0   # rebuild route: the model's own attention
    assert cache.memory().stored_bytes == ref_cache.memory().stored_bytes
    if mode == "stream":
        assert len(cache.layers[0].blocks) > 0 and len(cache.layers[0].blocks) == len(ref_cache.layers[0].blocks)
    assert not cache.used_fallback                           # queries were captured at prefill


def test_teacher_forced_continuation_identical():
    """A multi-token forward after the compressed prefill (continuation perplexity) reads the same function."""
    model = models.tiny_model("tiny-gqa", seed=2)
    cfg = AttSVDConfig(rank_k=3, rank_v=5, window=4)
    ids = torch.randint(0, 256, (1, 64))
    logits = {}
    for route in ("rebuild", "factor", "factor_rebuild"):
        cache = (AttSVDCache if route == "rebuild" else FactorSpaceAttSVDCache)(model, cfg)
        with torch.no_grad(), decode_route(model, cache, route):
            model(ids[:, :40], past_key_values=cache)
            logits[route] = model(ids[:, 40:], past_key_values=cache).logits
    assert rel_err(logits["factor"], logits["rebuild"]) < TOL
    assert rel_err(logits["factor_rebuild"], logits["rebuild"]) < TOL
    # the prefix really is compressed: dense attention over the exact prompt differs
    dense = model(ids).logits[:, 40:]
    assert rel_err(logits["factor"], dense) > 1e-3


def test_continuation_quality_identical_through_factor_space():
    """The AttSVD issue's continuation-perplexity protocol gives the same numbers on both routes."""
    from lowrank_lib.eval.kvquality import continuation_quality

    model = models.tiny_model("tiny-gqa", seed=4)
    cfg = AttSVDConfig(ratio=0.5, window=4, mode="stream", chunk=6)
    windows = torch.randint(0, 256, (2, 72))
    methods = {"rebuild": lambda m, n: AttSVDCache(m, cfg),
               "factor": lambda m, n: FactorSpaceAttSVDCache(m, cfg, route="factor")}
    with factor_space(model) as stats:
        res = continuation_quality(model, windows, 48, methods, step=8, progress=False)
    assert stats.factor_calls > 0
    assert abs(res["factor"].ppl - res["rebuild"].ppl) < 1e-5 * res["rebuild"].ppl
    assert abs(res["factor"].kl - res["rebuild"].kl) < 1e-6 + 1e-4 * res["rebuild"].kl
    assert res["factor"].memory_ratio == res["rebuild"].memory_ratio < 1


def test_switch_is_explicit_and_reversible():
    model = models.tiny_model("tiny-gqa", seed=3)
    before = (model.config._attn_implementation, _registry_names())
    cache = FactorSpaceAttSVDCache(model, AttSVDConfig(ratio=0.5, window=4))
    ids = torch.randint(0, 256, (1, 30))
    with pytest.raises(RuntimeError, match="boom"):
        with decode_route(model, cache, "factor"):
            model(ids, past_key_values=cache)
            layer = cache.layers[0]
            k, v = layer.update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
            assert isinstance(k, LowRankKV) and v is k and k.length == 31     # no string in the value slot
            raise RuntimeError("boom")
    assert (model.config._attn_implementation, _registry_names()) == before
    # a factor-route cache used without factor_space(): a clear error, not a wrong answer
    with pytest.raises(TypeError, match="factor_space"):
        model(ids[:, :1], past_key_values=cache)
    # with route "rebuild" the same cache rebuilds like the plain AttSVD layer
    cache.route = "rebuild"
    k, v = cache.layers[0].update(torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16))
    assert isinstance(k, torch.Tensor) and k.shape == (1, 2, 33, 16)  # 30 + the failed call's token + this one
    kf, vf = cache.layers[0].kv.dense()
    assert torch.equal(kf, k) and torch.equal(vf, v)
    with pytest.raises(TypeError, match="FactorSpaceAttSVDCache"):
        with decode_route(model, AttSVDCache(model, AttSVDConfig(ratio=0.5)), "factor"):
            pass
    with pytest.raises(ValueError, match="route"):
        with decode_route(model, cache, "dense"):
            pass


@pytest.mark.smollm2
def test_smollm2_generate_identical(smollm2):
    model, tok = smollm2
    text = open(__file__).read()[:2000]
    ids = tok(text, return_tensors="pt").input_ids[:, :160]
    for cfg in (AttSVDConfig(ratio=0.5, window=16), AttSVDConfig(ratio=0.75, window=4, mode="stream", chunk=4)):
        ref_tok, ref_scores, ref_cache, _ = run_generate(model, cfg, "rebuild", ids, new=6)
        tok_f, scores, cache, stats = run_generate(model, cfg, "factor", ids, new=6)
        assert torch.equal(tok_f, ref_tok)
        assert rel_err(scores, ref_scores) < TOL
        assert stats.factor_calls == 30 * 5
        assert len(cache.layers[0].blocks) == len(ref_cache.layers[0].blocks) == (1 if cfg.mode == "stream" else 0)
