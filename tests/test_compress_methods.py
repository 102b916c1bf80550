"""Compressor math: exactness at full rank, whitening optimality, determinism, rank rules, quantiser."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowrank_lib import account, keep_rank, models
from lowrank_lib.compress import (collect_stats, compress_asvd, compress_basis_sharing, compress_dobi, compress_palu,
                                  compress_svdllm, compress_svdllm_v2)
from lowrank_lib.compress.calib import cholesky_lower
from lowrank_lib.compress.common import whitened_factors
from lowrank_lib.compress.dobi import dynamic_map, energy_ranks, remap_decode, remap_encode
from lowrank_lib.compress.svdllm import v2_keep_ratios
from lowrank_lib.data import random_token_batches
from lowrank_lib.factorized import LLAMA_PROJ, iter_linears


@pytest.fixture(scope="module")
def gqa():
    m = models.tiny_model("tiny-gqa", seed=0)
    stats = collect_stats(m, random_token_batches(256, 8, 64, seed=1), progress=False)
    return m, stats


def _rel(a, b):
    return float((a - b).norm() / b.norm())


@torch.no_grad()
def _logits(m, x):
    return m(x).logits


X = random_token_batches(256, 2, 32, seed=7)


def test_stats_shared_inputs_and_values(gqa):
    m, stats = gqa
    assert stats["model.layers.0.self_attn.k_proj"] is stats["model.layers.0.self_attn.q_proj"]
    assert stats["model.layers.1.mlp.up_proj"] is stats["model.layers.1.mlp.gate_proj"]
    # recompute one Gram matrix directly from a hook-free forward
    seen = {}

    def grab(mod, inp, out):
        seen["x"] = inp[0]

    h = m.model.layers[1].mlp.down_proj.register_forward_hook(grab)
    ids = random_token_batches(256, 1, 64, seed=1)
    with torch.no_grad():
        m(ids)
    h.remove()
    x = seen["x"].reshape(-1, seen["x"].shape[-1]).double()
    one = collect_stats(m, ids, progress=False)["model.layers.1.mlp.down_proj"]
    torch.testing.assert_close(one.xtx, x.T @ x, rtol=1e-5, atol=1e-5)
    assert one.tokens == 64


@pytest.mark.parametrize("method", ["svdllm", "asvd", "basis_sharing", "palu"])
def test_full_rank_is_exact(gqa, method):
    m, stats = gqa
    full = {n: min(lin.out_features, lin.in_features) for n, lin in iter_linears(m)}
    if method == "svdllm":
        cm = compress_svdllm(m, stats, 0.5, ranks=full, progress=False)
    elif method == "asvd":
        cm = compress_asvd(m, stats, 0.5, ranks=full, progress=False)
    elif method == "basis_sharing":
        cm = compress_basis_sharing(m, stats, 0.5, num_basis=10 ** 6, progress=False)
    else:
        cm = compress_palu(m, stats, 1.0, head_group_size=1, align=1, progress=False)
    assert _rel(_logits(cm, X), _logits(m, X)) < 1e-5


def test_svdllm_v2_equals_v1_at_equal_rank(gqa):
    """Loss-optimised truncation (eigen sqrt) and Cholesky whitening reach the same optimum."""
    m, stats = gqa
    lin = m.model.layers[0].mlp.down_proj
    st = stats["model.layers.0.mlp.down_proj"]
    from lowrank_lib.compress.svdllm import _sqrt_cov, loss_optimised_factors

    u1, v1 = whitened_factors(lin.weight, cholesky_lower(st.xtx), 20)
    u2, v2 = loss_optimised_factors(lin.weight, *_sqrt_cov(st.xtx), 20)
    torch.testing.assert_close(u1 @ v1, u2 @ v2, rtol=1e-6, atol=1e-8)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10 ** 6), rank=st.integers(1, 11), n=st.integers(12, 24))
def test_whitening_beats_plain_svd_on_activation_error(seed, rank, n):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(16, n, generator=g, dtype=torch.float64)
    mix = torch.randn(n, n, generator=g, dtype=torch.float64) * torch.logspace(0, -2, n, dtype=torch.float64)
    Xs = torch.randn(200, n, generator=g, dtype=torch.float64) @ mix      # correlated, anisotropic inputs
    L = cholesky_lower(Xs.T @ Xs)
    u, v = whitened_factors(W, L, rank)
    U, S, Vh = torch.linalg.svd(W, full_matrices=False)
    plain = (U[:, :rank] * S[:rank]) @ Vh[:rank]
    err_w = ((W - u @ v) @ Xs.T).norm()
    err_p = ((W - plain) @ Xs.T).norm()
    assert err_w <= err_p * (1 + 1e-9)
    # and it is the optimum: error^2 = tail of the singular values of W L
    sig = torch.linalg.svdvals(W @ L)
    assert math.isclose(float(err_w ** 2), float((sig[rank:] ** 2).sum()), rel_tol=1e-6, abs_tol=1e-9)


def test_cholesky_fallback_on_singular_gram():
    x = torch.randn(3, 6, dtype=torch.float64)
    A = x.T @ x                                  # rank 3 of 6: not positive definite
    assert int(torch.linalg.cholesky_ex(A - 1e-3 * torch.eye(6, dtype=torch.float64)).info) != 0
    L = cholesky_lower(A - 1e-3 * torch.eye(6, dtype=torch.float64))
    lam_min = float(torch.linalg.eigvalsh(A - 1e-3 * torch.eye(6, dtype=torch.float64))[0])
    shifted = A - 1e-3 * torch.eye(6, dtype=torch.float64) + (-lam_min + 1e-6) * torch.eye(6, dtype=torch.float64)
    torch.testing.assert_close(L @ L.T, shifted)


def test_asvd_is_deterministic_and_ranks_follow_its_rule(gqa):
    m, stats = gqa
    a = compress_asvd(m, stats, 0.7, progress=False)
    b = compress_asvd(m, stats, 0.7, progress=False)
    for (n, x), y in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(x, y), n
    q = a.model.layers[0].self_attn.q_proj
    assert q.rank == int(64 * 64 * 0.7) // 128


def test_asvd_scaling_helps_activation_error(gqa):
    m, stats = gqa
    name = "model.layers.1.mlp.down_proj"
    W = m.get_submodule(name).weight.double()
    xtx = stats[name].xtx
    a = compress_asvd(m, stats, 0.5, progress=False, targets=("down_proj",)).get_submodule(name)
    err_a = torch.trace((W - a.dense_weight().double()) @ xtx @ (W - a.dense_weight().double()).T)
    U, S, Vh = torch.linalg.svd(W, full_matrices=False)
    r = a.rank
    P = (U[:, :r] * S[:r]) @ Vh[:r]
    err_p = torch.trace((W - P) @ xtx @ (W - P).T)
    assert err_a < err_p


def test_v2_keeps_average_to_target_per_type(gqa):
    m, stats = gqa
    keeps = v2_keep_ratios(m, stats, 0.6)
    for typ in LLAMA_PROJ:
        ks = [k for n, k in keeps.items() if n.endswith(typ)]
        assert abs(sum(ks) / len(ks) - 0.6) < 1e-9
    cm = compress_svdllm_v2(m, stats, 0.6, progress=False)
    assert abs(account(cm).linear_keep - 0.6) < 0.03


def test_basis_sharing_shares_one_parameter_and_counts_it_once(gqa):
    m, stats = gqa
    cm = compress_basis_sharing(m, stats, 0.6, group_size=2, progress=False)
    l0, l1 = cm.model.layers
    assert l0.self_attn.q_proj.V is l1.self_attn.q_proj.V
    assert l0.mlp.up_proj.V is l1.mlp.up_proj.V
    assert l0.self_attn.o_proj.V is not l1.self_attn.o_proj.V      # o, down private
    acc = account(cm)
    shared = sum(cm.model.layers[0].get_submodule(p).V.numel()
                 for p in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.up_proj", "mlp.gate_proj"))
    assert acc.shared_params_saved == shared
    # coefficients are orthonormal (all of Sigma sits in the basis)
    U = l0.self_attn.q_proj.U.double()
    Vh = torch.cat([U, l1.self_attn.q_proj.U.double()], 0)
    torch.testing.assert_close(Vh.T @ Vh, torch.eye(Vh.shape[1], dtype=torch.float64), atol=1e-5, rtol=0)
    assert abs(acc.linear_keep - 0.6) < 0.03


def test_dynamic_map_matches_bitsandbytes_definition():
    code = dynamic_map()
    assert code.numel() == 256 and torch.all(code[1:] >= code[:-1])
    assert float(code.max()) == 1.0 and float(code.min()) > -1.0 and (code == 0).sum() == 1
    assert math.isclose(float(code[code > 0].min()), 1e-6 * 0.55, rel_tol=1e-6)


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10 ** 6), m=st.integers(4, 20), n=st.integers(4, 20), k=st.integers(1, 4))
def test_remap_decode_encode_is_idempotent(seed, m, n, k):
    g = torch.Generator().manual_seed(seed)
    US, VT = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    e = remap_encode(US, VT)
    assert e["us_quan"].dtype == torch.uint8 and e["us_quan"].shape == (k, min(m, n))
    assert (e["tuple_info"] is None) == (m == n)
    a, b = remap_decode(e)
    assert a.shape == (m, k) and b.shape == (k, n) and a.dtype == torch.float16
    assert _rel(a.float() @ b.float(), US @ VT) < 0.05     # 8-bit dynamic map: a few % error
    # the codes of the decoded factors reproduce the decode exactly (what writers rely on)
    e2 = remap_encode(a.float(), b.float())
    a2, b2 = remap_decode(e2)
    assert _rel(a2.float() @ b2.float(), a.float() @ b.float()) < 0.05


def test_dobi_energy_ranks_meet_budget(gqa):
    m, stats = gqa
    for remap in (False, True):
        cm = compress_dobi(m, stats, 0.5, remap=remap, progress=False)
        shapes = {n: (x.out_features, x.in_features) for n, x in iter_linears(m)}
        cost = sum(r * (max(shapes[n]) if remap else sum(shapes[n])) for n, r in cm.lowrank_meta["ranks"].items())
        total = sum(a * b for a, b in shapes.values())
        assert 0.4 * total < cost <= 0.5 * total


def test_energy_ranks_prefer_concentrated_spectra():
    spectra = {"flat": torch.ones(10, dtype=torch.float64),
               "peaked": torch.tensor([100.0] + [0.01] * 9, dtype=torch.float64)}
    r = energy_ranks(spectra, {"flat": (10, 10), "peaked": (10, 10)}, 0.5, remap=False)
    assert r["peaked"] < r["flat"]


def test_palu_block_diagonal_u_and_rounded_ranks():
    m = models.tiny_model("tiny-mha", seed=0)   # 4 kv heads of 16
    stats = collect_stats(m, random_token_batches(256, 4, 32), progress=False)
    cm = compress_palu(m, stats, 0.5, head_group_size=2, align=4, progress=False)
    k = cm.model.layers[0].self_attn.k_proj
    assert cm.lowrank_meta["head_wise_ranks"]["model.layers.0.self_attn.k_proj"] == [16, 16]
    assert k.U.shape == (64, 32) and torch.count_nonzero(k.U[:32, 16:]) == 0 and torch.count_nonzero(k.U[32:, :16]) == 0
    assert isinstance(cm.model.layers[0].self_attn.q_proj, torch.nn.Linear)
    assert keep_rank(64, 64, 0.5) == 16
