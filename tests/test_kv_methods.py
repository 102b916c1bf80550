"""Every KV method through both adapters (the equivalence matrix), and what each method promises: exactness at
full budget / rank, bytes really held at the budget, padded rows fitted as if alone, stream-mode bounds, the
declared needs, the adapters' life cycle and clear errors."""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from lowrank_lib import models
from lowrank_lib.compat import cache_kw
from lowrank_lib.kv import METHODS, KVMethod, Prefill, make_method, method_kind
from lowrank_lib.kv.engine_adapter import MethodStore
from lowrank_lib.kv.hf_adapter import KVCache, dense_cache, record
from lowrank_lib.kv.methods.attsvd import stored_tokens
from lowrank_lib.kv.tiers import descriptor_nbytes
from lowrank_lib.runtime import Engine, EngineConfig

from helpers import rel_err

B, T, STEPS, PAD = 2, 96, 16, 9
#: options that make every mechanism run at the test's sizes (a stream block every 8 tokens)
OPTS = {"attsvd-stream": {"chunk": 8}}


@pytest.fixture(scope="module")
def model():
    return models.tiny_model("tiny-gqa", seed=0).eval()


def batch(seed=0, T=T, pad=PAD):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 256, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[1, :pad] = 0
    return ids, mask, torch.randint(3, 256, (STEPS, B), generator=g)


def method(name, budget=0.5, **kw):
    return make_method(name, budget, **(OPTS.get(name, {}) | kw))


@torch.no_grad()
def hf_logits(model, m: KVMethod, ids, mask, nxt, attention="portable"):
    """Prefill + len(nxt) teacher-forced steps through the transformers adapter: [steps + 1] logits [B, V]."""
    cache = KVCache(m, model, attention=attention)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    out = []
    with cache.serving(model):
        out.append(model(ids, attention_mask=mask, position_ids=pos, **cache_kw(cache)).logits[:, -1])
        am, p = mask, pos[:, -1:]
        for t in nxt:
            am, p = torch.cat([am, torch.ones(B, 1, dtype=am.dtype)], 1), p + 1
            out.append(model(t[:, None], attention_mask=am, position_ids=p, **cache_kw(cache)).logits[:, -1])
    return out, cache


@torch.no_grad()
def engine_logits(model, m: KVMethod, ids, mask, nxt, **ecfg):
    store = MethodStore(m)
    eng = Engine(model, EngineConfig(max_batch=B, max_seq_len=ids.shape[1] + len(nxt) + 1, **ecfg), kv=store)
    out = [eng.prefill(ids, attention_mask=mask)]
    out += [eng.step(t) for t in nxt]
    return out, store


@pytest.mark.compat
@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_the_transformers_adapter_equals_the_engine_adapter(model, name):
    """Batch 2 with left padding, prefill + 16 decode steps: the same logits (fp32, 1e-5 relative) and the same
    bytes through both adapters, with no per-method adapter code."""
    ids, mask, nxt = batch()
    hf, cache = hf_logits(model, method(name), ids, mask, nxt)
    en, store = engine_logits(model, method(name), ids, mask, nxt)
    for i, (a, b) in enumerate(zip(hf, en)):
        assert rel_err(b, a) < 1e-5, (name, i)
    assert cache.nbytes == store.nbytes
    assert store.fit_info["fit"]["bytes_held"] == cache.describe()["bytes_held"]


def test_registry_declares_what_every_method_needs():
    for name in METHODS:
        m = make_method(name, 0.25)
        assert m.name == name and m.kind == method_kind(name) in ("dense", "lowrank", "eviction", "composed")
        assert m.scope in ("layer", "model") and isinstance(m.needs_queries, bool)
        assert isinstance(m.capturable, bool) and isinstance(m.window, int) and m.window >= 0
        assert (m.scope == "model") == (getattr(m, "scorer", None) == "kvzip")
    assert not make_method("attsvd-stream", 0.5).capturable and make_method("attsvd", 0.5).needs_queries
    assert not make_method("svd", 0.5).needs_queries and not make_method("kvzip", 0.5).needs_queries
    assert make_method("snapkv", 0.5).needs_queries and make_method("composed-h2o_norm-q8", 0.5).needs_queries
    with pytest.raises(ValueError, match="unknown KV method"):
        make_method("h3o")
    with pytest.raises(ValueError, match="budget must be > 0"):
        make_method("snapkv", 0.0)
    with pytest.raises(ValueError, match="unknown scorer"):
        make_method("kvzip", 0.5, scorer="nope")


@pytest.mark.compat
def test_dense_method_equals_transformers_dynamic_cache(model):
    ids, mask, nxt = batch(1)
    hf, _ = hf_logits(model, method("dense"), ids, mask, nxt)
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    dc, ref = DynamicCache(config=model.config), []
    with torch.no_grad():
        ref.append(model(ids, attention_mask=mask, position_ids=pos, **cache_kw(dc)).logits[:, -1])
        am, p = mask, pos[:, -1:]
        for t in nxt:
            am, p = torch.cat([am, torch.ones(B, 1, dtype=am.dtype)], 1), p + 1
            ref.append(model(t[:, None], attention_mask=am, position_ids=p, **cache_kw(dc)).logits[:, -1])
    assert max(rel_err(a, b) for a, b in zip(hf, ref)) < 1e-5


@pytest.mark.parametrize("name", ["attsvd", "svd", "attsvd-ext", "snapkv", "kvzip", "expected_attention",
                                  "composed-kvzip-q8", "composed-h2o_norm-q8"])
def test_full_budget_or_full_rank_is_exact(model, name):
    """AttSVD at rank d and every eviction / composed method at a budget that holds every token exactly: the
    dense cache's logits."""
    ids, mask, nxt = batch(2)
    kw = {"rank": 16} if method_kind(name) == "lowrank" else {}
    hf, cache = hf_logits(model, method(name, budget=1.5, **kw), ids, mask, nxt)
    ref, _ = hf_logits(model, method("dense"), ids, mask, nxt)
    assert max(rel_err(a, b) for a, b in zip(hf, ref)) < 1e-5
    if method_kind(name) != "lowrank":
        assert cache.describe()["tokens_lowrank"] == 0


def test_bytes_held_are_the_fitted_tensors_and_fit_the_budget():
    """Eviction / composed: bytes held, the segment descriptors included, within the budget and filling it;
    AttSVD: exactly Eq. 6 of the paper + the descriptors, its rank the largest whose bytes (descriptors included)
    fit."""
    g = torch.Generator().manual_seed(0)
    L, H, G, S, d = 3, 2, 2, 512, 32
    rnd = lambda *s: torch.randn(*s, generator=g)
    pre = Prefill([rnd(1, H, S, d) for _ in range(L)], [rnd(1, H, S, d) for _ in range(L)],
                  [rnd(1, H * G, S, d) for _ in range(L)], d ** -0.5)
    dense = 2 * L * H * S * d * 4
    for name in ("snapkv", "h2o_norm", "streamingllm", "keydiff", "composed-h2o_norm-q8"):
        for b in (0.5, 0.25, 0.125):
            m = make_method(name, b)
            layers = m.fit(pre)
            desc = sum(l.e_off.numel() * 8 + l.r_off.numel() * 8 + l.runs.numel() * 8 for l in layers)
            held = sum(l.nbytes for l in layers)
            assert m.describe(layers, pre)["bytes_held"] == held
            assert b * dense * 0.97 <= held - desc and held <= b * dense, (name, b)
    for b in (0.5, 0.25):
        m = make_method("attsvd", b)
        layers = m.fit(pre)
        r = layers[0].ranks()[0][0]
        o = descriptor_nbytes(H, H) / (H * 2 * d * 4)                     # this row's descriptors per head, in tokens
        assert stored_tokens(S, d, r, r, 32) + o <= b * S < stored_tokens(S, d, r + 1, r + 1, 32) + o
        assert sum(l.nbytes for l in layers) <= b * dense
        desc = sum(l.e_off.numel() * 8 + l.r_off.numel() * 8 + l.runs.numel() * 8 for l in layers)
        assert sum(l.nbytes for l in layers) - desc == L * H * 4 * 2 * d * stored_tokens(S, d, r, r, 32)
        info = m.describe(layers, pre)
        assert info["r_over_d"] == r / d and info["compression_ratio"] == 1 - r / d


@pytest.mark.parametrize("name", ["attsvd", "snapkv", "kvzip", "composed-h2o_norm-q8"])
def test_a_padded_row_is_fitted_as_if_it_were_alone(model, name):
    ids, mask, _ = batch(3)
    both = make_method(name, 0.4).fit(record(model, ids, mask))
    alone = make_method(name, 0.4).fit(record(model, ids[1:, PAD:]))
    for lb, la in zip(both, alone):
        for h in range(lb.H):
            kb, vb, jb = lb.segment(lb.H + h)                  # row 1 of the batch
            ka, va, ja = la.segment(h)
            assert kb.shape == ka.shape and rel_err(kb, ka) < 1e-5 and rel_err(vb, va) < 1e-5
            assert [lb.run_factors(j)[0].shape for j in jb] == [la.run_factors(j)[0].shape for j in ja]
            for j, k in zip(jb, ja):                           # K and V rebuilt (sign-free) from each run
                fb, fa = lb.run_factors(j), la.run_factors(k)
                tol = 1e-2 if lb.quant8 else 1e-4                # int8: a rounding may flip by one step
                assert rel_err(fb[0] @ fb[1], fa[0] @ fa[1]) < tol and rel_err(fb[2] @ fb[3], fa[2] @ fa[3]) < tol


def test_stream_mode_keeps_the_exact_window_bounded_and_accumulate_grows(model):
    ids, mask, _ = batch(4)
    nxt = torch.randint(3, 256, (40, B), generator=torch.Generator().manual_seed(5))
    w, c = 32, 8
    for mode, grows in (("stream", False), ("accumulate", True)):
        m = make_method("attsvd-stream" if mode == "stream" else "attsvd", 0.5, window=w, chunk=c)
        _, cache = hf_logits(model, m, ids, mask, nxt)
        for l in cache.states:
            e, _ = l.segment_counts()
            exact = [n + l.n_new for n in e]
            if grows:
                assert exact == [w + 40] * (2 * l.H) and len(l.host_runs) == 2 * l.H
            else:
                assert all(w <= n < w + c for n in exact) and len(l.host_runs) == 2 * l.H * (1 + 40 // c)


def test_generate_through_serving_equals_a_manual_loop_and_the_routing_is_reversible(model):
    ids, mask, _ = batch(6)
    before = dict(ALL_ATTENTION_FUNCTIONS)
    cache = KVCache(method("composed-kvzip-q8"), model)
    with cache.serving(model):
        gen = model.generate(ids, attention_mask=mask, **cache_kw(cache), max_new_tokens=6, do_sample=False,
                             pad_token_id=0)
    assert dict(ALL_ATTENTION_FUNCTIONS) == before                     # nothing left registered
    manual, _ = engine_logits(model, method("composed-kvzip-q8"), ids, mask, gen[:, T:T + 5].T)
    assert torch.equal(torch.stack([o.argmax(-1) for o in manual], 1), gen[:, T:])
    with pytest.raises(TypeError, match="serving"):                    # a fitted layer outside its routing
        model(gen[:, -1:], **cache_kw(cache))


def test_a_prefill_without_its_queries_or_its_routing_is_refused(model):
    ids, _, _ = batch(7)
    cache = KVCache(method("snapkv"), model)
    with torch.no_grad():
        model(ids, **cache_kw(cache))                                  # no serving: nothing captured or fitted
        with pytest.raises(RuntimeError, match="never fitted"):
            model(ids[:, :1], **cache_kw(cache))
    cache = KVCache(method("snapkv"), model)
    with torch.no_grad():
        model(ids, **cache_kw(cache))
    with pytest.raises(RuntimeError, match="reads the prefill's queries"):
        cache.fit(ids)


@pytest.mark.parametrize("name", ["attsvd", "kvzip", "composed-kvzip-q8"])
def test_compiled_engine_step_equals_eager(model, name):
    ids, mask, nxt = batch(8)
    eager, _ = engine_logits(model, method(name), ids, mask, nxt[:6])
    comp, store = engine_logits(model, method(name), ids, mask, nxt[:6], graph="whole-step",
                                compile_backend="aot_eager")
    assert max(rel_err(a, b) for a, b in zip(comp, eager)) < 1e-5
    assert store.nbytes == store.fit_info["fit"]["bytes_held"] + 2 * 2 * B * 2 * 6 * 16 * 4   # 6 appended rows



def test_requests_of_other_lengths_share_a_compiled_step_only_where_it_is_correct(model, name="attsvd"):
    """Under the fused kernel (device-side layout, bucketed buffers) two prompts whose layers round alike share one
    compiled step, and both decode as the eager engine does (the prompt length is read from device memory); a
    host-slicing reader keys its capture by the layout too. (AttSVD: its layout is a function of the length; a
    budget-allocating method's split moves with the content, so its requests share a step only by chance.)"""
    from lowrank_lib.kv.tiers import lrk_tiers_unavailable

    if lrk_tiers_unavailable(torch.device("cpu"), 16, torch.float32):
        pytest.skip("the fused tier kernel cannot run here")
    ecfg = EngineConfig(max_batch=B, max_seq_len=T + 24, graph="whole-step", compile_backend="aot_eager")
    comp = Engine(model, ecfg, kv=MethodStore(method(name)))
    keys, lens = {}, []
    for n in range(T - 12, T + 1):                       # the first two lengths whose bucketed layers agree
        ids, mask, _ = batch(n, T=n)
        comp.prefill(ids, mask)
        lens = keys.setdefault(comp.kv.shape_key(), []) + [n]
        keys[comp.kv.shape_key()] = lens
        if len(lens) == 2:
            break
    assert len(lens) == 2, keys.values()
    for n in lens:
        ids, mask, nxt = batch(n, T=n)
        eager, _ = engine_logits(model, method(name), ids, mask, nxt[:5])
        out = [comp.prefill(ids, attention_mask=mask)] + [comp.step(t) for t in nxt[:5]]
        assert max(rel_err(a, b) for a, b in zip(out, eager)) < 1e-5, n
    assert len(comp.graphs.captured) == 1                # one compile served both requests
    port = MethodStore(method(name), attention="portable")
    eng = Engine(model, EngineConfig(max_batch=B, max_seq_len=T + 24), kv=port)
    port_keys = set()
    for n in lens:
        ids, mask, _ = batch(n, T=n)
        eng.prefill(ids, mask)
        port_keys.add(port.shape_key())
    assert len(port_keys) == 2                           # host-sliced layouts never share a capture

def test_the_engine_probe_is_the_transformers_forward(model):
    """KVzip's reconstruction forward, run by the engine: the same post-RoPE queries and keys as transformers'."""
    ids, mask, _ = batch(9)
    rec = record(model, ids, mask)
    eng = Engine(model, EngineConfig(max_batch=B, max_seq_len=T + 4))
    x = torch.randint(3, 256, (1, 20), generator=torch.Generator().manual_seed(9))
    for b in range(B):
        p = rec.pad(b)
        ref = rec.probe_row(b, x)
        got = eng.probe(x, [(k[b:b + 1, :, p:], v[b:b + 1, :, p:]) for k, v in zip(rec.keys, rec.values)])
        for (q0, k0), (q1, k1) in zip(ref, got):
            assert rel_err(q1, q0) < 1e-5 and rel_err(k1, k0) < 1e-5


def test_rebuild_backend_is_the_same_function_as_factor_space(model):
    ids, mask, nxt = batch(10)
    fac, _ = hf_logits(model, method("attsvd", rank=4), ids, mask, nxt)
    reb, _ = hf_logits(model, method("attsvd", rank=4), ids, mask, nxt, attention="rebuild")
    assert max(rel_err(a, b) for a, b in zip(fac, reb)) < 1e-5


def test_decode_error_falls_with_rank_and_the_energy_rule_reports_its_ranks(model):
    ids, mask, nxt = batch(11)
    ref, _ = hf_logits(model, method("dense"), ids, mask, nxt[:4])
    errs = []
    for r in (1, 4, 8, 16):
        out, _ = hf_logits(model, method("attsvd", rank=r), ids, mask, nxt[:4])
        errs.append(max(rel_err(a, b) for a, b in zip(out, ref)))
    assert errs == sorted(errs, reverse=True) and errs[-1] < 1e-5
    _, cache = hf_logits(model, make_method("attsvd", None, tau=0.9), ids, mask, nxt[:1])
    d = cache.describe()
    for l, rk in zip(cache.states, d["rank_k"][::2]):
        hr = l.info[0]["head_rank_k"]
        assert len(hr) == l.H and max(hr) == rk          # aggregated by max over the KV heads
    from lowrank_lib.kv.methods.attsvd import AttSVD

    with pytest.raises(ValueError, match="budget, an explicit rank or the energy rule"):
        AttSVD(budget=None)


def test_recorded_prefill_serves_many_methods_and_scores_once(model):
    """One record, many fits: the scorer runs once per prefill whatever the budgets (memoised), and a cache
    fitted from a record equals one fitted live."""
    ids, _, nxt = batch(12)
    rec = record(model, ids[:1])
    calls = []
    from lowrank_lib.eviction import KVzip

    orig = KVzip.score_prefill
    KVzip.score_prefill = lambda self, p: calls.append(1) or orig(self, p)
    try:
        caches = [KVCache.from_prefill(make_method("composed-kvzip-q8", b), rec, model) for b in (0.5, 0.25, 0.125)]
    finally:
        KVzip.score_prefill = orig
    assert len(calls) == 1
    assert caches[0].nbytes > caches[1].nbytes > caches[2].nbytes
    from lowrank_lib.kv.hf_adapter import tiered_attention

    with tiered_attention(model), torch.no_grad():
        fitted = model(nxt[:1, :1], **cache_kw(caches[1])).logits[:, -1]
    cache = KVCache(make_method("composed-kvzip-q8", 0.25), model)
    with cache.serving(model), torch.no_grad():
        model(ids[:1], **cache_kw(cache))
        assert rel_err(model(nxt[:1, :1], **cache_kw(cache)).logits[:, -1], fitted) < 1e-5
    assert dense_cache(rec, model).get_seq_length() == T


@pytest.mark.smollm2
@pytest.mark.parametrize("name,budget", [("attsvd-ext", 0.5), ("composed-kvzip-q8", 0.25)])
def test_smollm2_engine_adapter_equals_the_transformers_adapter(smollm2, name, budget):
    """The real model and tokenizer (KVzip's instruction prompt, its reconstruction forward in the engine): the
    same greedy tokens and logits through both adapters."""
    from lowrank_lib.data import tokens

    model, tok = smollm2
    ids = tokens(tok, "test")[:300][None]
    hf = KVCache(make_method(name, budget), model, tok)
    with torch.no_grad(), hf.serving(model):
        out = model.generate(ids, **cache_kw(hf), max_new_tokens=8, do_sample=False, output_scores=True,
                             return_dict_in_generate=True)
    eng = Engine(model, EngineConfig(max_batch=1, max_seq_len=320), kv=MethodStore(make_method(name, budget), tok))
    got = eng.generate(ids, 8, return_logits=True)
    assert torch.equal(got.tokens, out.sequences[:, 300:])
    assert rel_err(torch.stack(got.logits, 1), torch.stack(out.scores, 1)) < 1e-4
    assert eng.kv.report()["fit"]["bytes_ratio"] == pytest.approx(hf.describe()["bytes_ratio"], rel=1e-12)


def test_every_method_reports_the_budget_it_really_holds(model):
    """``describe()["budget"]`` is the bytes held over the dense prompt bytes for every registered method, also where
    a rank or the energy rule sized the cache (whose requested budget, ``budget_target``, is then None): one meaning
    of the word everywhere."""
    ids, _, _ = batch(13)
    rec = record(model, ids[:1])
    dense = sum(2 * k.numel() * k.element_size() for k in rec.keys)
    cases = {name: make_method(name, 0.5, **OPTS.get(name, {})) for name in sorted(METHODS)}
    cases |= {"attsvd-tau": make_method("attsvd", tau=0.9), "attsvd-full-rank": make_method("attsvd", rank=16)}
    for label, m in cases.items():
        cache = KVCache.from_prefill(m, rec, model)
        d = cache.describe()
        held = sum(l.tier_nbytes for l in cache.states)
        assert d["budget"] == pytest.approx(held / dense, rel=1e-12) and d["bytes_held"] == held, label
    assert cases["attsvd-tau"].budget is None and KVCache.from_prefill(cases["attsvd-tau"], rec, model).describe()[
        "budget_target"] is None
    full = KVCache.from_prefill(cases["attsvd-full-rank"], rec, model).describe()["budget"]
    assert full > 1.0                                    # full rank holds more than the dense cache (Eq. 6: 1 + d / S)
    assert make_method("attsvd", 0.5).budget == 0.5 and make_method("dense").budget == 1.0


def test_scorer_options_reach_the_scorer_and_every_scorer_is_a_method(monkeypatch):
    """``scorer_options`` are the scorer's own fields, handed to it at every fit (and memoised apart); an unknown
    option is refused. Every ``SCORERS`` entry is an eviction method, its allocation the scorer's declared one."""
    from lowrank_lib.eviction import SCORERS, SnapKV
    from lowrank_lib.kv import EVICTION_MODES

    g = torch.Generator().manual_seed(1)
    L, H, G, S, d = 2, 2, 2, 256, 16
    rnd = lambda *s: torch.randn(*s, generator=g)
    pre = Prefill([rnd(1, H, S, d) for _ in range(L)], [rnd(1, H, S, d) for _ in range(L)],
                  [rnd(1, H * G, S, d) for _ in range(L)], d ** -0.5)
    seen, orig = [], SnapKV.score
    monkeypatch.setattr(SnapKV, "score", lambda self, K, V, obs: seen.append((self.kernel, self.obs_window))
                        or orig(self, K, V, obs))
    mine = make_method("snapkv", 0.25, scorer_options={"kernel": 3, "obs_window": 16}).fit(pre)
    assert seen and set(seen) == {(3, 16)}
    default = make_method("snapkv", 0.25).fit(pre)                   # the same prefill: scored again, not memoised
    assert set(seen) == {(3, 16), (5, 64)}
    assert any(not torch.equal(a.pos_exact, b.pos_exact) for a, b in zip(mine, default))
    with pytest.raises(ValueError, match="no option"):
        make_method("snapkv", 0.25, scorer_options={"window": 3})
    assert EVICTION_MODES == {n: c.allocation for n, c in SCORERS.items()} and set(SCORERS) <= set(METHODS)
    assert EVICTION_MODES["kvzip"] == "global" and method_kind("kvzip") == "eviction"
