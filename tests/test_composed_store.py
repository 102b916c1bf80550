"""The composed cache as a runtime engine store: the engine's decode equals the transformers composed cache
built from the same prompt (same scorer, budget, tiers), bytes held are the tiers + the appended buffers,
and what the store cannot do is refused with a clear error."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.compat import cache_kw
from lowrank_lib.composed import ComposedConfig, ComposedStore, build, composed_attention, importance, make_policy
from lowrank_lib.compress import compress_svd
from lowrank_lib.hf import record_prefill
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.kv import KVStore

from helpers import rel_err


@pytest.fixture(scope="module")
def model():
    return compress_svd(models.tiny_model("tiny-gqa", seed=1), 0.6)


def _hf_greedy(model, ids, cfg, budget, new):
    rec = record_prefill(model, ids)
    imp = importance(make_policy(cfg.scorer, model), model, None, ids, rec, cfg.window, cfg.obs_window)
    cache = build(rec, imp, budget, cfg)
    logits = [rec.last_logits]
    toks = [logits[-1].argmax(-1)]
    with torch.no_grad(), composed_attention(model):
        for _ in range(new - 1):
            logits.append(model(toks[-1][:, None], **cache_kw(cache)).logits[:, -1].float())
            toks.append(logits[-1].argmax(-1))
    return torch.stack(toks, 1), torch.stack(logits, 1), cache


@pytest.mark.parametrize("scorer,mid_share", [("h2o_norm", 0.3), ("snapkv", 0.0), ("expected_attention", 0.3)])
def test_engine_store_equals_the_transformers_composed_cache(model, scorer, mid_share):
    cfg = ComposedConfig(scorer=scorer, mid_share=mid_share, rank=4, window=4)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(3))
    store = ComposedStore(cfg, 0.4)
    assert isinstance(store, KVStore)
    eng = Engine(model, EngineConfig(max_batch=1, max_seq_len=64), kv=store)
    out = eng.generate(ids, 8, return_logits=True)
    ref_tok, ref_logits, cache = _hf_greedy(model, ids, cfg, 0.4, 8)
    assert torch.equal(out.tokens, ref_tok)
    assert rel_err(torch.stack(out.logits, 1), ref_logits) < 1e-4
    rep = store.report()
    assert rep["tiers"] == cache.tier_counts() and rep["tier_bytes"] == cache.info["plan_bytes"]
    assert rep["tier_ratio"] <= 0.4
    L, H, D = 2, 2, 16
    assert store.nbytes == rep["tier_bytes"] + 2 * L * 1 * H * (64 - 40) * D * 4      # tiers + appended buffers
    assert eng.report()["kv_cache_bytes"] == store.nbytes


def test_engine_store_refuses_what_it_cannot_do(model):
    with pytest.raises(ValueError, match="forward of the transformers model"):
        ComposedStore(ComposedConfig(scorer="kvzip"))
    with pytest.raises(ValueError, match="unknown scorer"):
        ComposedStore(ComposedConfig(scorer="nope"))
    eng = Engine(model, EngineConfig(max_batch=2, max_seq_len=64), kv=ComposedStore(budget=0.5))
    ids = torch.randint(3, 256, (2, 20))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with pytest.raises(NotImplementedError, match="left-padded"):
        eng.generate(ids, 2, attention_mask=mask)
