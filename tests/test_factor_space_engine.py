"""The AttSVD factor store in the runtime Engine equals the transformers factor-space path (tokens
equal, logits fp32 rel. err < 1e-5), eager and compiled, with buckets and re-capture."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.attsvd.config import AttSVDConfig
from lowrank_lib.attsvd.factor_cache import FactorSpaceAttSVDCache, decode_route
from lowrank_lib.attsvd.store import AttSVDStore
from lowrank_lib.runtime import Engine, EngineConfig

from helpers import rel_err

TOL = 1e-5


def hf_factor(model, cfg, ids, mask, new):
    cache = FactorSpaceAttSVDCache(model, cfg)
    with decode_route(model, cache, "factor"):
        out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new, do_sample=False,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.scores, 1), cache


def factor_engine(model, ecfg, cfg, bucket=256):
    return Engine(model, ecfg, kv=AttSVDStore(cfg, bucket=bucket))


def padded_batch(T, pad, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (2, T), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    ids[1, :pad] = 0
    return ids, mask


@pytest.mark.parametrize("preset", ["tiny-mha", "tiny-gqa"])
def test_engine_factor_equals_hf_factor_path(preset):
    model = models.tiny_model(preset, seed=5)
    cfg = AttSVDConfig(ratio=0.5, window=6)
    ids, mask = padded_batch(40, 5, 0)
    ref_tok, ref_logits, cache = hf_factor(model, cfg, ids, mask, 10)
    eng = factor_engine(model, EngineConfig(max_batch=2, max_seq_len=96), cfg, bucket=16)
    out = eng.generate(ids, 10, attention_mask=mask, return_logits=True)
    assert torch.equal(out.tokens, ref_tok)
    assert rel_err(torch.stack(out.logits, 1), ref_logits) < TOL
    rep = eng.kv.report()
    assert rep["bulk_len"] == 34 and rep["bulk_padded"] == 34 and rep["rank_k"] == 8   # eager: exact sizes
    # same accounting as the AttSVD cache right after the prefill
    fresh = FactorSpaceAttSVDCache(model, cfg)
    with torch.no_grad(), decode_route(model, fresh, "factor"):
        model(ids, attention_mask=mask, past_key_values=fresh)
    mem = fresh.memory()
    assert rep["attsvd_stored_bytes"] == mem.stored_bytes and rep["attsvd_dense_bytes"] == mem.dense_bytes
    # bytes held in decode: exactly the static factor + window buffers (no dense KV anywhere)
    g, L, esize = model.config, model.config.num_hidden_layers, 4
    H, D = g.num_key_value_heads, g.hidden_size // g.num_attention_heads
    w_cap = 96 - 34
    assert eng.kv.nbytes == L * 2 * esize * 2 * H * (34 * 8 + 8 * D + w_cap * D) == rep["buffer_bytes"]
    assert eng.report()["kv"] == "attsvd-factor" and eng.report()["kv_cache_bytes"] == eng.kv.nbytes


def test_compiled_step_buckets_and_recapture():
    """Whole-step torch.compile (CPU 'graph'): equal to eager; reused within a bucket, re-captured across."""
    model = models.tiny_model("tiny-gqa", seed=6)
    cfg = AttSVDConfig(rank=4, window=4)
    ecfg = dict(max_batch=2, max_seq_len=96)
    eager = factor_engine(model, EngineConfig(**ecfg), cfg, bucket=16)
    comp = factor_engine(model, EngineConfig(**ecfg, graph="whole-step", compile_backend="aot_eager"), cfg, bucket=16)
    ptrs = []
    for T, expect_capture in ((30, True), (33, False), (50, True)):     # bulks 26, 29 (bucket 32), 46 (48)
        ids, mask = padded_batch(T, 3, T)
        a = eager.generate(ids, 6, attention_mask=mask, return_logits=True)
        b = comp.generate(ids, 6, attention_mask=mask, return_logits=True)
        assert comp.kv.report()["bulk_padded"] == (32 if T < 40 else 48)
        assert torch.equal(a.tokens, b.tokens)
        assert rel_err(torch.stack(b.logits, 1), torch.stack(a.logits, 1)) < TOL
        assert (b.info["capture_s"] > 0) == expect_capture
        ptrs.append(comp.kv._bufs[0]["a_k"].data_ptr())
        assert comp.graphs.captured == [(2, comp.kv.shape_key())]   # a new bucket dropped the stale capture
        if not expect_capture:                         # same bucket: the captured buffers were refilled in place
            assert ptrs[-1] == ptrs[-2]


def test_prompt_inside_window_and_clear_errors():
    model = models.tiny_model("tiny-gqa", seed=7)
    cfg = AttSVDConfig(ratio=0.5, window=16)
    ids = torch.randint(3, 256, (1, 12))                       # everything exact: no bulk
    ref_tok, ref_logits, _ = hf_factor(model, cfg, ids, None, 5)
    out = factor_engine(model, EngineConfig(max_seq_len=64), cfg).generate(ids, 5, return_logits=True)
    assert torch.equal(out.tokens, ref_tok) and rel_err(torch.stack(out.logits, 1), ref_logits) < TOL
    with pytest.raises(ValueError, match="kv='dense'"):
        factor_engine(model, EngineConfig(kv="rebuild"), cfg)
    with pytest.raises(NotImplementedError, match="stream"):
        AttSVDStore(AttSVDConfig(ratio=0.5, mode="stream"))


@pytest.mark.smollm2
def test_smollm2_engine_factor(smollm2):
    model, tok = smollm2
    ids = tok(open(__file__).read()[:1500], return_tensors="pt").input_ids[:, :200]
    cfg = AttSVDConfig(ratio=0.5, window=16)
    ref_tok, ref_logits, _ = hf_factor(model, cfg, ids, None, 8)
    eng = factor_engine(model, EngineConfig(max_seq_len=256), cfg)
    out = eng.generate(ids, 8, return_logits=True)
    assert torch.equal(out.tokens, ref_tok)
    assert rel_err(torch.stack(out.logits, 1), ref_logits) < 1e-4   # packed/folded projections: round-off
