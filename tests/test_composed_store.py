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
    # packed tiers (the plan's bytes + offsets, head ids, rank padding: tests/test_composed_packed.py) + appended buffers
    assert rep["tier_bytes"] <= rep["packed_bytes"] <= rep["tier_bytes"] + 1024
    assert store.nbytes == rep["packed_bytes"] + 2 * L * 1 * H * (64 - 40) * D * 4
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


def test_engine_store_packed_and_ragged_attention_agree(model):
    """The packed layout (every head at once) and the per-head reference decode the same tokens; bad modes refused."""
    cfg = ComposedConfig(scorer="h2o_norm", mid_share=0.3, rank=4, window=4, quant8=True)
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(5))
    outs = {}
    for mode in ("packed", "ragged"):
        store = ComposedStore(cfg, 0.3, attention=mode)
        eng = Engine(model, EngineConfig(max_batch=1, max_seq_len=64), kv=store)
        outs[mode] = eng.generate(ids, 6, return_logits=True)
        assert store.report()["attention"] == mode
    assert torch.equal(outs["packed"].tokens, outs["ragged"].tokens)
    assert rel_err(torch.stack(outs["packed"].logits, 1), torch.stack(outs["ragged"].logits, 1)) < 1e-5
    with pytest.raises(ValueError, match="unknown composed attention"):
        ComposedStore(cfg, 0.3, attention="fast")


def test_bench_kv_decode_quick(tmp_path):
    """``bench kv-decode --quick``: a row per store, context and thread count; the composed stores hold fewer bytes."""
    import json

    from lowrank_lib.bench.cli import main

    assert main(["kv-decode", "--quick", "--contexts", "48", "--new", "2", "--repeats", "1", "--threads", "1",
                 "--budgets", "0.5", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "kv_decode.json").read_text())
    rows = res["rows"]
    assert [(r["store"], r["attention"]) for r in rows] == [
        ("dense", None), ("composed-h2o_norm", "auto"), ("composed-h2o_norm-q8", "auto"),
        ("composed-h2o_norm", "ragged"), ("composed-h2o_norm-q8", "ragged")]
    dense = rows[0]
    assert dense["ratio_vs_dense"] == 1.0 and dense["context"] == 48 and dense["threads"] == 1
    for r in rows[1:]:
        assert r["decode_ms_per_token"] > 0 and r["attn_ms_per_token"] > 0
        assert r["prompt_kv_bytes"] <= 0.5 * dense["prompt_kv_bytes"] + 2048     # + offsets, head ids, rank padding
        assert r["kv_bytes"] < dense["kv_bytes"]
    # one set of tiers, two layouts: packed = the ragged bytes + offsets, head ids and rank padding
    assert rows[3]["kv_bytes"] <= rows[1]["kv_bytes"] <= rows[3]["kv_bytes"] + 2048
    assert res["command"].startswith("python -m lowrank_lib.bench kv-decode") and "load_average" in res
