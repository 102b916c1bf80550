"""Algorithm 2 as math: exactness at full rank, monotone error in r, the Eckart-Young optimality of the
query-metric keys and mass-weighted values (property tests), the adversarial head of Appendix D.3.1,
and the energy rank rule."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowrank_lib.attention_mass import attention_mass
from lowrank_lib.attsvd.basis import (attention_svd, causal_probs, compress_prefill, logit_error, output_error,
                                      query_metric, trunc_svd)
from lowrank_lib.attsvd.config import AttSVDConfig
from lowrank_lib.attsvd.ranks import aggregate, energy_rank


def _head(seed, S=48, d=8, G=2, B=1, H=1, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    scale = torch.logspace(0, -1.5, d, dtype=dtype)          # anisotropic, like real keys
    K = torch.randn(B, H, S, d, generator=g, dtype=dtype) * scale
    V = torch.randn(B, H, S, d, generator=g, dtype=dtype)
    Q = torch.randn(B, H, G, S, d, generator=g, dtype=dtype) * scale.flip(0)
    return K, V, Q


def _weighted_obj_k(K, X, C):      # tr((K - X) C (K - X)^T)
    E = K - X
    return float(torch.einsum("...sd,...de,...se->...", E, C, E).sum())


def _weighted_obj_v(V, X, a):      # sum_i a_i ||V_i - X_i||^2
    return float((a[..., None] * (V - X) ** 2).sum())


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 10_000), r=st.integers(1, 7), G=st.integers(1, 3))
def test_aware_basis_is_optimal_in_its_metric(seed, r, G):
    """Eckart-Young in the query metric and the mass metric: the aware factors beat raw SVD (and a random
    rank-r competitor) on the objective they minimise, at equal rank."""
    K, V, Q = _head(seed, G=G)
    C = query_metric(Q, eps=1e-3)
    a = attention_mass(Q, K, 8 ** -0.5, torch.arange(48), torch.arange(48))
    aw = attention_svd(K, V, r, r, C_Q=C, mass=a, mass_floor=0.0)
    raw = attention_svd(K, V, r, r)
    assert _weighted_obj_k(K, aw.dense()[0], C) <= _weighted_obj_k(K, raw.dense()[0], C) * (1 + 1e-9) + 1e-12
    assert _weighted_obj_v(V, aw.dense()[1], a) <= _weighted_obj_v(V, raw.dense()[1], a) * (1 + 1e-9) + 1e-12
    # logit error ||Q(K - K_r)^T|| itself (ridge only 1e-3 of the mean eigenvalue)
    assert float(logit_error(Q[:, :, 0], K, aw.dense()[0]).sum()) <= \
        float(logit_error(Q[:, :, 0], K, raw.dense()[0]).sum()) * 1.02 + 1e-9 or G > 1
    lk = sum(float(logit_error(Q[:, :, g], K, aw.dense()[0]) ** 2) for g in range(G))
    lr = sum(float(logit_error(Q[:, :, g], K, raw.dense()[0]) ** 2) for g in range(G))
    assert lk <= lr * 1.02 + 1e-12
    # a random rank-r matrix in the aware row space is never better
    g = torch.Generator().manual_seed(seed + 1)
    Xr = (torch.randn(1, 1, 48, r, generator=g, dtype=K.dtype) @ aw.runs[0][1]) + aw.dense()[0] * 0.9
    assert _weighted_obj_k(K, aw.dense()[0], C) <= _weighted_obj_k(K, Xr, C) + 1e-12


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), r=st.integers(1, 7))
def test_key_mass_extension_optimal_in_two_sided_metric(seed, r):
    """The key_mass extension minimises sum_i a_i ||(K_i - X_i) C_Q^{1/2}||^2; exact at full rank."""
    K, V, Q = _head(seed)
    C = query_metric(Q)
    a = attention_mass(Q, K, 8 ** -0.5, torch.arange(48), torch.arange(48))
    km = attention_svd(K, V, r, r, C_Q=C, mass=a, mass_floor=0.0, key_mass=True)
    paper = attention_svd(K, V, r, r, C_Q=C, mass=a, mass_floor=0.0)
    obj = lambda X: float(torch.einsum("...s,...sd,...de,...se->...", a, K - X, C, K - X).sum())
    assert obj(km.dense()[0]) <= obj(paper.dense()[0]) * (1 + 1e-9) + 1e-12
    torch.testing.assert_close(attention_svd(K, V, 8, 8, C_Q=C, mass=a, key_mass=True).dense()[0], K)
    torch.testing.assert_close(km.dense()[1], paper.dense()[1])      # values unchanged


@pytest.mark.parametrize("aware", [True, False])
def test_full_rank_exact_and_error_monotone(aware):
    K, V, Q = _head(3, S=64, d=16, G=3, dtype=torch.float32)
    C = query_metric(Q) if aware else None
    a = attention_mass(Q, K, 0.25, torch.arange(64), torch.arange(64)) if aware else None
    P = causal_probs(Q[0, 0], K[0, 0], 0.25)
    full = attention_svd(K, V, 16, 16, C_Q=C, mass=a)
    out = P @ V[0, 0]
    out_r = P @ full.dense()[1][0, 0]
    torch.testing.assert_close(out_r, out, rtol=1e-4, atol=1e-5)   # full rank reproduces attention output
    torch.testing.assert_close(full.dense()[0], K, rtol=1e-4, atol=1e-5)
    errs_k, errs_v = [], []
    for r in range(1, 17):
        f = attention_svd(K, V, r, r, C_Q=C, mass=a)
        errs_k.append(_weighted_obj_k(K, f.dense()[0], C) if aware else float((K - f.dense()[0]).norm()))
        errs_v.append(float((V - f.dense()[1]).norm()) if not aware else
                      float(((a[..., None] + 1e-3 * a.mean()).sqrt() * (V - f.dense()[1])).norm()))
    assert all(e2 <= e1 * (1 + 1e-3) + 1e-6 for e1, e2 in zip(errs_k, errs_k[1:]))
    assert all(e2 <= e1 * (1 + 1e-3) + 1e-6 for e1, e2 in zip(errs_v, errs_v[1:]))
    assert errs_k[-1] < 1e-3 * max(errs_k[0], 1e-6) + 1e-4


def adversarial_head(S=256, d=32, seed=0):
    """Appendix D.3.1: K's dominant singular directions are ones the queries never read; attention mass
    sits on 16 tokens whose values live in directions of small raw energy."""
    g = torch.Generator().manual_seed(seed)
    K = torch.zeros(S, d)
    K[:, :8] = torch.randn(S, 8, generator=g) * 10.0       # high energy, never queried
    K[:, 8:16] = torch.randn(S, 8, generator=g) * 1.0      # what attention reads
    Q = torch.zeros(S, d)
    Q[:, 8:12] = torch.randn(S, 4, generator=g) * 2.0
    heavy = torch.randperm(S, generator=g)[:16]
    V = torch.randn(S, d, generator=g) * 3.0
    V[heavy] = torch.randn(16, d, generator=g) * 0.3       # the attended tokens: low raw energy
    logits = torch.full((S, S), -30.0)
    logits[:, heavy] = torch.randn(S, 16, generator=g)
    P = torch.softmax(logits, -1)                          # mass concentrated on the heavy tokens
    return K, V, Q, P


def test_adversarial_head_d31():
    K, V, Q, P = adversarial_head()
    C = query_metric(Q[None, None, None])
    a = P.sum(0)[None, None]
    err = {}
    for r in (4, 8, 16):
        aw = attention_svd(K[None, None], V[None, None], r, r, C_Q=C, mass=a)
        raw = attention_svd(K[None, None], V[None, None], r, r)
        err[r] = dict(lk_aw=float(logit_error(Q, K, aw.dense()[0][0, 0])),
                      lk_raw=float(logit_error(Q, K, raw.dense()[0][0, 0])),
                      fk_aw=float((K - aw.dense()[0][0, 0]).norm()), fk_raw=float((K - raw.dense()[0][0, 0]).norm()),
                      ov_aw=float(output_error(P, V, aw.dense()[1][0, 0])),
                      ov_raw=float(output_error(P, V, raw.dense()[1][0, 0])))
    e4 = err[4]
    assert e4["lk_raw"] > 0.9 and e4["lk_aw"] < 0.6 * e4["lk_raw"]   # paper: 0.98 -> 0.27
    assert e4["fk_aw"] > e4["fk_raw"]                                 # ... although its raw K error is larger
    assert err[16]["ov_aw"] < 0.05 and err[16]["ov_raw"] > 0.5      # paper: 0.61 -> 0.00 at r = 16
    assert err[8]["ov_aw"] < err[8]["ov_raw"]


def test_trunc_svd_matches_eckart_young_error():
    X = torch.randn(2, 3, 40, 12, dtype=torch.float64)
    S = torch.linalg.svdvals(X)
    for r in (1, 5, 12):
        A, B = trunc_svd(X, r)
        assert A.shape == (2, 3, 40, r) and B.shape == (2, 3, r, 12)
        torch.testing.assert_close(torch.linalg.matrix_norm(X - A @ B) ** 2, (S[..., r:] ** 2).sum(-1))


def test_energy_rank_rule_and_aggregators():
    S = torch.tensor([[3.0, 2.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # energies 9,4,1 of 14 -> 9/14=.64, 13/14=.93, 1.0 ; flat: .25 .5 .75 1
    assert energy_rank(S, 0.9).tolist() == [2, 4]
    assert energy_rank(S, 0.5).tolist() == [1, 2]
    assert energy_rank(S, 1.0).tolist() == [3, 4]
    assert energy_rank(torch.zeros(1, 4), 0.99).tolist() == [1]
    r = torch.tensor([2, 4, 4, 10])
    assert aggregate(r, "max") == 10 and aggregate(r, "mean") == 5 and aggregate(r, "p50") == 4
    assert aggregate(r, "max", rank_max=6) == 6


def test_config_rank_rules_and_errors():
    assert AttSVDConfig(ratio=0.5).fixed_ranks(64) == (32, 32)
    assert AttSVDConfig(ratio=0.75).fixed_ranks(128) == (32, 32)
    assert AttSVDConfig(rank=8, rank_v=24).fixed_ranks(64) == (8, 24)
    assert AttSVDConfig(rank_k=4, rank_v=100).fixed_ranks(64) == (4, 64)
    assert AttSVDConfig(ratio=0.5, tau=0.9).dynamic
    with pytest.raises(ValueError, match="rank rule"):
        AttSVDConfig()
    with pytest.raises(ValueError, match="mode"):
        AttSVDConfig(rank=4, mode="sliding")
    with pytest.raises(ValueError, match="aggregator"):
        AttSVDConfig(tau=0.9, aggregator="median")


def test_attention_mass_matches_dense_softmax_and_respects_padding():
    K, V, Q = _head(5, S=20, d=8, G=2, dtype=torch.float32)
    a = attention_mass(Q, K, 0.3, torch.arange(20), torch.arange(20), chunk=7)
    P = causal_probs(Q[0, 0], K[0, 0], 0.3)           # [G, S, S]
    torch.testing.assert_close(a[0, 0], P.sum((0, 1)), rtol=1e-5, atol=1e-5)
    kv = torch.ones(1, 20, dtype=torch.bool)
    kv[0, :3] = False
    a2 = attention_mass(Q, K, 0.3, torch.arange(20), torch.arange(20), q_valid=kv, k_valid=kv)
    assert float(a2[0, 0, :3].abs().max()) == 0.0
    assert float(a2.sum()) == pytest.approx(2 * 17, rel=1e-5)   # each valid query row sums to 1


def test_compress_prefill_splits_bulk_and_window_and_ignores_padding():
    """The one entry of every path: bulk factored at the configured rank, window kept exact (a copy),
    padded keys zeroed before factoring; a prompt inside the window is kept whole."""
    B, H, G, S, d, w = 2, 2, 3, 40, 8, 6
    g = torch.Generator().manual_seed(0)
    K, V = torch.randn(B, H, S, d, generator=g), torch.randn(B, H, S, d, generator=g)
    Q = torch.randn(B, H * G, S, d, generator=g)
    valid = torch.ones(B, S, dtype=torch.bool)
    valid[1, :5] = False
    kv = compress_prefill(K, V, Q, AttSVDConfig(rank=3, window=w), valid)
    assert len(kv.runs) == 1 and kv.rank_k == kv.rank_v == 3 and kv.length == S and kv.window == w
    assert kv.runs[0][0].shape == (B, H, S - w, 3) and kv.info.weighted
    assert torch.equal(kv.k_exact, K[:, :, -w:]) and kv.k_exact.data_ptr() != K[:, :, -w:].data_ptr()
    Kr, _ = kv.dense()
    assert float(Kr[1, :, :5].abs().max()) < 1e-6          # pad rows take no rank
    # the same call with the queries' padding reproduces attention_svd on the zeroed bulk
    Kb = K[:, :, :S - w] * valid[:, None, :S - w, None]
    Vb = V[:, :, :S - w] * valid[:, None, :S - w, None]
    Qg = Q.view(B, H, G, S, d)
    mass = attention_mass(Qg, K, d ** -0.5, torch.arange(S), torch.arange(S), valid, valid)[..., :S - w]
    ref = attention_svd(Kb, Vb, 3, 3, C_Q=query_metric(Qg, 1e-3, valid), mass=mass)
    for a, b in zip(kv.runs[0], ref.runs[0]):
        torch.testing.assert_close(a, b)
    small = compress_prefill(K[:, :, :4], V[:, :, :4], Q[:, :, :4], AttSVDConfig(rank=3, window=w))
    assert small.runs == [] and small.window == 4 and small.rank_k == 0
    raw = compress_prefill(K, V, None, AttSVDConfig(rank=3, window=w))      # no queries: unweighted
    assert not raw.info.weighted
    with pytest.raises(ValueError, match="do not fit keys"):
        compress_prefill(K, V, Q[:, :5], AttSVDConfig(rank=3, window=w))
