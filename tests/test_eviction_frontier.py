"""The frontier's eviction baselines (lowrank_lib.eviction: normalised H2O, Expected Attention, KVzip) and
the byte-budget allocation (eviction.budget): each score against a brute-force reference of what its paper
defines, allocations that spend exactly the budget, KVzip's non-uniform global allocation."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.compat import cache_kw
from lowrank_lib.eviction import H2O, SCORERS, ExpectedAttention, KVzip, Observation, ObservedAttention
from lowrank_lib.eviction.budget import index_dtype, keep_counts, select, token_bytes
from lowrank_lib.kv.tiers import descriptor_nbytes
from lowrank_lib.eviction.expected import model_rope, rotate_half, rotation_matrix
from lowrank_lib.kv import make_method
from lowrank_lib.kv.hf_adapter import KVCache, dense_cache, record


@pytest.fixture(scope="module")
def tiny():
    return models.tiny_model("tiny-gqa", seed=0).eval()


def _obs(B=1, H=2, G=2, S=24, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    K = torch.randn(B, H, S, d, generator=g)
    V = torch.randn(B, H, S, d, generator=g)
    Q = torch.randn(B, H * G, S, d, generator=g)
    return K, V, Observation(Q, d ** -0.5, torch.arange(S), K)


def _budget(n: int, S: int, L: int = 2, H: int = 2, d: int = 16) -> float:
    """The byte budget at which every (layer, head) of a tiny-gqa prefill of S tokens keeps n tokens (their rows and
    positions, and each layer's descriptors: held bytes too)."""
    return (n * token_bytes(d, 4, S) * H + descriptor_nbytes(H, 0)) * L / (2 * L * H * S * d * 4)


def test_observed_attention_is_mean_attention_per_observing_query():
    K, V, obs = _obs()
    B, H, S, d = K.shape
    G = obs.query.shape[1] // H
    ref = torch.zeros(B, H, S)
    for h in range(H):
        for g in range(G):
            q = obs.query[0, h * G + g]
            for t in range(S):                             # query t sees keys 0..t
                p = torch.softmax(q[t] @ K[0, h, :t + 1].T * obs.scaling, -1)
                ref[0, h, :t + 1] += p / G / torch.arange(S, 0, -1)[:t + 1]     # key i seen by S - i queries
    torch.testing.assert_close(ObservedAttention().score(K, V, obs), ref, rtol=1e-5, atol=1e-6)
    # the same as H2O's summed mass, normalised (the frontier shares that work)
    torch.testing.assert_close(ObservedAttention.normalise(H2O().score(K, V, obs), obs, G), ref, rtol=1e-5, atol=1e-6)
    # uniform attention (zero queries): H2O's sum favours the first key S times more than the mean does
    z = Observation(torch.zeros_like(obs.query), obs.scaling, obs.q_pos, K)
    h, s = H2O().score(K, V, z)[0, 0], ObservedAttention().score(K, V, z)[0, 0]
    assert float(h[0] / h[-1]) == pytest.approx(S * float(s[0] / s[-1]), rel=1e-4)


def test_observed_attention_has_no_forced_window(tiny):
    ids = torch.randint(0, 256, (1, 48))
    rec = record(tiny, ids)
    cache = KVCache.from_prefill(make_method("h2o_norm", _budget(12, 48), window=8), rec, tiny)
    assert cache.method.window == 8                    # asked for explicitly; the scorer's own rule is none
    cache = KVCache.from_prefill(make_method("h2o_norm", _budget(12, 48)), rec, tiny)
    l0 = cache.states[0]
    scores = ObservedAttention().score(rec.keys[0], rec.values[0], rec.observation(0))[0]
    kept = [l0.pos_exact[l0.host_e_off[h]:l0.host_e_off[h + 1]].long().tolist() for h in range(2)]
    assert cache.method.window == 0 and kept == scores.topk(12, -1).indices.sort(-1).values.tolist()   # pure top-k


def test_rotation_matrix_is_the_rope_map(tiny):
    rope = model_rope(tiny)
    cos, sin = rope(torch.tensor([5, 17]))
    x = torch.randn(3, cos.shape[-1])
    for i in range(2):
        torch.testing.assert_close(x @ rotation_matrix(cos[i], sin[i]).T, x * cos[i] + rotate_half(x) * sin[i])


def test_expected_attention_closed_form_matches_monte_carlo():
    """Identity RoPE: E[exp(s q.k)] for q ~ N(mu, Sigma) has the closed form; compare with sampled queries."""
    d, S, m = 4, 10, 40000
    g = torch.Generator().manual_seed(1)
    K = torch.randn(1, 1, S, d, generator=g) * 0.7
    V = torch.ones(1, 1, S, d)
    A = torch.randn(d, d, generator=g) * 0.4
    mu = torch.randn(d, generator=g)
    q = mu + torch.randn(m, d, generator=g) @ A.T
    ident = lambda pos: (torch.ones(len(pos), d), torch.zeros(len(pos), d))
    obs = Observation(q[None, None], 0.5, torch.arange(m), K, rope=ident)
    pol = ExpectedAttention(sinks=0, use_vnorm=False, n_future=4)
    got = pol.score(K, V, obs)[0, 0]
    mc = torch.exp(0.5 * q @ K[0, 0].T).mean(0)
    torch.testing.assert_close(got, mc / mc.sum(), rtol=0.03, atol=1e-3)
    # without the covariance term only the mean query counts (a different, worse estimate here)
    mean_only = ExpectedAttention(sinks=0, use_vnorm=False, use_covariance=False).score(K, V, obs)[0, 0]
    torch.testing.assert_close(mean_only, torch.softmax(0.5 * K[0, 0] @ q.mean(0), -1), rtol=1e-4, atol=1e-6)
    assert float((mean_only - mc / mc.sum()).abs().max()) > float((got - mc / mc.sum()).abs().max())


def test_expected_attention_undoes_rope_and_rotates_to_the_future(tiny):
    """Queries that are RoPE rotations of one pre-RoPE q0: the mean pre-RoPE query is q0 exactly, and the
    score is softmax(s K R_bar q0) times ||v|| (R_bar: the average rotation of the next n_future positions)."""
    rope = model_rope(tiny)
    S, d = 40, 16
    q0 = torch.randn(d)
    cos, sin = rope(torch.arange(S))
    q = q0 * cos + rotate_half(q0[None]) * sin                   # [S, d] post-RoPE
    K, V = torch.randn(1, 1, S, d), torch.randn(1, 1, S, d)
    obs = Observation(q[None, None], 0.25, torch.arange(S), K, rope=rope)
    got = ExpectedAttention(sinks=2, n_future=8, use_covariance=False).score(K, V, obs)[0, 0]
    cf, sf = rope(torch.arange(S, S + 8))
    mu_f = q0 @ rotation_matrix(cf.mean(0), sf.mean(0)).T
    ref = torch.softmax(0.25 * K[0, 0] @ mu_f, -1) * V[0, 0].norm(dim=-1)
    assert torch.isinf(got[:2]).all()
    torch.testing.assert_close(got[2:], ref[2:], rtol=1e-4, atol=1e-6)


def test_expected_attention_reads_rope_from_the_adapter(tiny):
    ids = torch.randint(0, 256, (1, 40))
    rec = record(tiny, ids)
    obs = rec.observation(0)
    with pytest.raises(RuntimeError, match="needs RoPE"):
        ExpectedAttention().score(rec.keys[0], rec.values[0], Observation(obs.query, obs.scaling, obs.q_pos, obs.keys))
    cache = KVCache.from_prefill(make_method("expected_attention", _budget(10, 40)), rec, tiny)
    layer = cache.states[0]
    assert layer.segment_counts()[0] == [10, 10] and layer.pos_exact[:4].tolist() == [0, 1, 2, 3]   # sinks kept


def test_kvzip_chunk_scores_match_brute_force():
    B, H, G, n, S, d = 1, 2, 3, 7, 12, 8
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H * G, n, d, generator=g)
    key = torch.randn(B, H, S + n, d, generator=g)
    s, e = 4, 10
    mx, ms, gram = KVzip(q_chunk=3)._chunk_scores(q, key, s, e, S, 0.3)
    rmx, rms = torch.zeros(B, H, e - s), torch.zeros(B, H, e - s)
    for h in range(H):
        for gg in range(G):
            for t in range(n):
                kk = torch.cat([key[0, h, s:e], key[0, h, S:S + t + 1]])    # chunk keys + own keys up to t
                p = torch.softmax(q[0, h * G + gg, t] @ kk.T * 0.3, -1)[:e - s]
                rmx[0, h] = torch.maximum(rmx[0, h], p)
                rms[0, h] += p
    torch.testing.assert_close(mx, rmx)
    torch.testing.assert_close(ms, rms)
    qg = q.view(B, H, G, n, d)
    torch.testing.assert_close(gram, torch.einsum("bhgnd,bhgne->bhde", qg, qg))


def test_kvzip_score_is_the_models_own_max_attention(tiny):
    """One chunk: the score of each cached pair is the max attention weight any reconstruction query of its
    group gives it in the model's own (eager) forward over the full cache."""
    S = 30
    ids = torch.randint(0, 256, (1, S))
    rec = record(tiny, ids)
    kz = KVzip(chunk=64)
    cs = kz.score_prefill(rec)
    (s0, e0, x), = kz.inputs(None, ids)
    tiny.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = tiny(x, **cache_kw(dense_cache(rec, tiny)), output_attentions=True)
    finally:
        tiny.set_attn_implementation("sdpa")
    H = rec.keys[0].shape[1]
    for li, att in enumerate(out.attentions):                      # [1, Hq, n, S + n]
        ref = att[..., :S].reshape(1, H, -1, x.shape[-1], S).amax(dim=(2, 3))
        torch.testing.assert_close(cs.score[li], ref, rtol=1e-4, atol=1e-6)
    assert cs.queries == x.shape[-1]
    assert all(float(s.max()) <= 1.0 for s in cs.score)


def test_kvzip_chunks_cover_the_context():
    ids = torch.arange(50)[None]
    parts = KVzip(chunk=16).inputs(None, ids)
    assert [(s, e) for s, e, _ in parts] == [(0, 16), (16, 32), (32, 48), (48, 50)]
    assert all(torch.equal(x[0, -(e - s):], ids[0, s:e]) for s, e, x in parts)


def test_kvzip_is_model_scope():
    assert SCORERS["kvzip"] is KVzip and KVzip.scope == "model" and KVzip.forced_window == 0
    with pytest.raises(NotImplementedError, match="model-scope scorer without score"):
        KVzip().score(None, None, None)
    from lowrank_lib.kv import Prefill

    with pytest.raises(ValueError, match="token ids and a probe"):
        KVzip().score_prefill(Prefill([torch.zeros(1, 1, 4, 8)], [torch.zeros(1, 1, 4, 8)], None, 1.0))


def test_keep_counts_spend_the_token_budget():
    g = torch.Generator().manual_seed(0)
    scores = [torch.rand(1, 3, 20, generator=g) for _ in range(4)]
    scores[2][0, 1] += 10.0                                       # one head much more important
    glob = keep_counts(scores, 90, "global")
    assert sum(int(c.sum()) for c in glob) == 90
    assert int(glob[2][0, 1]) == 20                               # non-uniform: that head keeps everything
    assert len({int(x) for c in glob for x in c.flatten()}) > 1
    head = keep_counts(scores, 90, "head")
    assert {int(x) for c in head for x in c.flatten()} == {7}     # 90 // 12 each
    layer = keep_counts(scores, 90, "layer")
    assert [int(c.sum()) for c in layer] == [22] * 4 and int(layer[2][0, 1]) == 20
    with pytest.raises(ValueError, match="mode"):
        keep_counts(scores, 10, "nope")
    # +inf always wins; selection returns the top positions sorted
    s = scores[0].clone()
    s[0, 0, 3] = float("inf")
    idx = select(s, torch.tensor([[2, 1, 0]]))
    assert int(idx[0][0][0]) == 3 or 3 in idx[0][0].tolist()
    assert idx[0][2].numel() == 0 and idx[0][0].tolist() == sorted(idx[0][0].tolist())


def test_token_bytes_count_the_index():
    assert index_dtype(2048) == torch.int16 and index_dtype(40000) == torch.int32
    assert token_bytes(64, 2, 2048) == 2 * 64 * 2 + 2 and token_bytes(64, 4, 40000) == 2 * 64 * 4 + 4
