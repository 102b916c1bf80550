"""The one factorized representation: exactness, shared bases, accounting, clear errors."""
import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from lowrank_lib import LowRankLinear, account, factorize, keep_rank, replace_with_factors, shared_groups, svd_factors
from lowrank_lib.compress import SVDSpectra, compress_svd
from lowrank_lib.factorized import thin_svd


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("preset", ["tiny_mha", "tiny_gqa"])
def test_full_rank_logits_equal_dense(preset, request):
    model = request.getfixturevalue(preset)
    x = torch.randint(0, model.config.vocab_size, (2, 24))
    ref = model(x).logits
    f = factorize(copy.deepcopy(model), full_rank=True)
    assert len([m for m in f.modules() if isinstance(m, LowRankLinear)]) == 7 * model.config.num_hidden_layers
    assert rel(f(x).logits, ref) < 1e-5


def test_full_rank_with_lm_head_keeps_embedding(tiny_gqa):
    assert tiny_gqa.lm_head.weight is tiny_gqa.model.embed_tokens.weight  # tied preset
    x = torch.randint(0, 256, (1, 16))
    ref = tiny_gqa(x).logits
    f = factorize(copy.deepcopy(tiny_gqa), full_rank=True, include_lm_head=True)
    assert isinstance(f.lm_head, LowRankLinear) and isinstance(f.model.embed_tokens, nn.Embedding)
    assert rel(f(x).logits, ref) < 1e-5


def test_smollm2_full_rank_exact(smollm2):
    """SmolLM2's real weights (their conditioning, not a random preset's) factorized at full rank: the logits are the
    dense model's. Its first 6 of 30 layers (every projection type, 42 matrices; the SVD of all 210 took 15 s of a
    CI worker, and notebook 00's CI run checks the whole model's full-rank logits again)."""
    model, tok = smollm2
    ids = tok("The tower is 324 metres tall, about the same height as an 81-storey building.",
              return_tensors="pt").input_ids
    short = copy.deepcopy(model)                             # the session's fixture stays whole
    short.model.layers = short.model.layers[:6]
    with torch.no_grad():
        ref = short(ids).logits
        f = factorize(copy.deepcopy(short), full_rank=True)
        assert len([m for m in f.modules() if isinstance(m, LowRankLinear)]) == 7 * 6
        assert rel(f(ids).logits, ref) < 1e-5
    assert len(model.model.layers) == 30


@settings(max_examples=25, deadline=None)
@given(out=st.integers(2, 40), inn=st.integers(2, 40), seed=st.integers(0, 10_000))
def test_truncation_error_is_eckart_young(out, inn, seed):
    """||W - U V||_F^2 equals the tail energy of the spectrum, and shrinks monotonically with r."""
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, inn, generator=g, dtype=torch.float64)
    S = torch.linalg.svdvals(W)
    prev = float("inf")
    for r in range(1, min(out, inn) + 1):
        U, V = svd_factors(W, r)
        assert U.shape == (out, r) and V.shape == (r, inn)
        err = (W - U @ V).norm() ** 2
        assert torch.isclose(err, (S[r:] ** 2).sum(), rtol=1e-6, atol=1e-9)
        assert err <= prev + 1e-9
        prev = err


def test_keep_ratio_realised_in_accounting(tiny_mha):
    f = compress_svd(tiny_mha, keep=0.5)
    acc = account(f)
    for name, info in acc.per_module.items():
        out, inn = info["shape"]
        assert info["rank"] == keep_rank(out, inn, 0.5)
        assert info["params"] == info["rank"] * (out + inn)
    assert 0.4 < acc.linear_keep <= 0.5
    assert account(tiny_mha).linear_keep == 1.0
    # original untouched (compress_svd copies)
    assert isinstance(tiny_mha.model.layers[0].self_attn.q_proj, nn.Linear)


def test_spectra_reuse_equals_fresh_svd(tiny_mha):
    spectra = SVDSpectra(tiny_mha, progress=False)
    x = torch.randint(0, 256, (1, 12))
    a = compress_svd(tiny_mha, 0.6, spectra=spectra)(x).logits
    b = compress_svd(tiny_mha, 0.6)(x).logits
    assert torch.allclose(a, b)


def test_full_rank_from_spectra_equals_factorize_and_the_keeps_reuse_them(tiny_gqa):
    """compress_svd(full_rank=True) over SVDSpectra: every matrix at rank min(out, in), logits equal to
    factorize(full_rank=True)'s and the dense model's; the same spectra then serve a keep (notebook 00's one SVD)."""
    spectra = SVDSpectra(tiny_gqa, progress=False)
    x = torch.randint(0, 256, (2, 16))
    ref = tiny_gqa(x).logits
    full = compress_svd(tiny_gqa, spectra=spectra, full_rank=True)
    lins = [m for m in full.modules() if isinstance(m, LowRankLinear)]
    assert len(lins) == 7 * tiny_gqa.config.num_hidden_layers
    assert all(m.rank == min(m.out_features, m.in_features) for m in lins) and full.lowrank_meta["keep"] == 1.0
    assert rel(full(x).logits, ref) < 1e-5
    assert rel(full(x).logits, factorize(copy.deepcopy(tiny_gqa), full_rank=True)(x).logits) < 1e-5
    assert torch.allclose(compress_svd(tiny_gqa, 0.6, spectra=spectra)(x).logits, compress_svd(tiny_gqa, 0.6)(x).logits)
    for bad in (dict(), dict(keep=0.5, full_rank=True)):
        with pytest.raises(ValueError, match="exactly one"):
            compress_svd(tiny_gqa, spectra=spectra, **bad)


def test_shared_basis_is_one_parameter_counted_once(tiny_mha):
    """Two layers' q_proj share V (a Basis Sharing group): one Parameter, counted once, used by both."""
    m = copy.deepcopy(tiny_mha)
    q0, q1 = m.model.layers[0].self_attn.q_proj, m.model.layers[1].self_attn.q_proj
    r, d = 16, q0.in_features
    basis = nn.Parameter(torch.randn(r, d), requires_grad=False)
    lr0 = LowRankLinear(torch.randn(q0.out_features, r), basis)
    lr1 = LowRankLinear(torch.randn(q1.out_features, r), basis)
    before = account(m)
    replace_with_factors(m, {"model.layers.0.self_attn.q_proj": lr0, "model.layers.1.self_attn.q_proj": lr1},
                         {"family": "test"})
    assert m.model.layers[0].self_attn.q_proj.V is m.model.layers[1].self_attn.q_proj.V
    after = account(m)
    expected_delta = -2 * d * d + (2 * q0.out_features * r + r * d)
    assert after.linear_params - before.linear_params == expected_delta
    assert after.total_params - before.total_params == expected_delta
    assert after.shared_params_saved == r * d
    assert shared_groups(m) == [["model.layers.0.self_attn.q_proj.V", "model.layers.1.self_attn.q_proj.V"]]
    # the shared tensor really drives both layers
    with torch.no_grad():
        basis.mul_(0)
    x = torch.randn(1, 3, d)
    assert m.model.layers[1].self_attn.q_proj(x).abs().max() == 0


def test_bad_factors_are_refused_with_shapes():
    with pytest.raises(ValueError, match=r"rank mismatch.*\(8, 4\).*\(5, 6\)"):
        LowRankLinear(torch.zeros(8, 4), torch.zeros(5, 6))
    with pytest.raises(ValueError, match="bias has shape"):
        LowRankLinear(torch.zeros(8, 4), torch.zeros(4, 6), torch.zeros(7))
    with pytest.raises(ValueError, match=r"rank 9 outside \[1, 6\]"):
        svd_factors(torch.zeros(8, 6), 9)


def test_replace_refuses_wrong_shape(tiny_mha):
    bad = LowRankLinear(torch.zeros(10, 2), torch.zeros(2, 64))
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj: factors give a 10x64 map, the model "
                                         r"expects 64x64"):
        replace_with_factors(tiny_mha, {"model.layers.0.self_attn.q_proj": bad})


def test_factorize_argument_errors(tiny_mha):
    with pytest.raises(ValueError, match="exactly one"):
        factorize(tiny_mha, keep=0.5, full_rank=True)
    f = factorize(copy.deepcopy(tiny_mha), keep=0.5)
    with pytest.raises(ValueError, match="already factorized"):
        factorize(f, keep=0.5)


def test_generate_works_on_factorized_model(tiny_gqa):
    f = factorize(copy.deepcopy(tiny_gqa), full_rank=True)
    x = torch.randint(0, 256, (1, 8))
    a = tiny_gqa.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0)
    b = f.generate(x, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(a, b)


@settings(max_examples=40, deadline=None)
@given(out=st.integers(1, 48), inn=st.integers(1, 48), rank=st.integers(0, 48), seed=st.integers(0, 10_000),
       scale=st.sampled_from([1e-30, 1e-3, 1.0, 1e6]))
def test_thin_svd_is_the_svd(out, inn, rank, seed, scale):
    """thin_svd (the Gram eigenproblem in float64) against LAPACK's SVD, on tall, wide, square, rank-deficient and
    badly scaled matrices: the same singular values down to the Gram's rounding floor (sqrt(k eps) of the largest),
    U S Vh = M, orthonormal components down to 1e-3 of the largest (the Gram's eigenvectors lose accuracy as
    eps * S[0]^2 / gap^2 below that), the same rank-r maps (sign-free) wherever the cut is not a near-tie."""
    g = torch.Generator().manual_seed(seed)
    k = min(out, inn)
    r_true = min(rank, k)
    M = (torch.randn(out, r_true, generator=g, dtype=torch.float64)
         @ torch.randn(r_true, inn, generator=g, dtype=torch.float64)) * scale
    U, S, Vh = thin_svd(M)
    assert U.shape == (out, k) and S.shape == (k,) and Vh.shape == (k, inn) and U.dtype == torch.float64
    ref = torch.linalg.svdvals(M)
    top = float(ref[0]) if k else 0.0
    assert torch.all(S[:-1] >= S[1:]) and torch.all(S >= 0)
    floor = 4 * (k * torch.finfo(torch.float64).eps) ** 0.5 * top
    assert torch.allclose(S, ref, rtol=1e-9, atol=floor)
    assert torch.all(S[r_true:] <= floor)             # a random rank-r product: nothing above the floor past r
    assert torch.allclose(U * S @ Vh, M, rtol=0, atol=1e-12 * top * k)
    live = S > 1e-3 * top
    eye = torch.eye(int(live.sum()), dtype=torch.float64)
    assert torch.allclose(U[:, live].T @ U[:, live], eye, atol=1e-8)
    assert torch.allclose(Vh[live] @ Vh[live].T, eye, atol=1e-8)
    Ur, Sr, Vr = torch.linalg.svd(M, full_matrices=False)
    for r in {1, r_true // 2, r_true} - {0}:
        if r < r_true and ref[r - 1] - ref[r] < 1e-6 * top:
            continue                                  # a near-tie at the cut: either basis is a best rank-r map
        assert torch.allclose(U[:, :r] * S[:r] @ Vh[:r], Ur[:, :r] * Sr[:r] @ Vr[:r], atol=1e-8 * top)


def test_thin_svd_dtypes_and_refusals():
    """float32 in, float32 out (computed in float64); a bf16 weight's factors; ints as float64; not a matrix:
    refused."""
    W = torch.randn(37, 11)
    U, S, Vh = thin_svd(W)
    assert U.dtype == S.dtype == Vh.dtype == torch.float32
    assert torch.allclose(U * S @ Vh, W, atol=1e-5)
    assert thin_svd(W.bfloat16())[1].dtype == torch.bfloat16
    assert thin_svd(W, torch.float64)[1].dtype == torch.float64
    assert thin_svd(torch.arange(6).reshape(2, 3))[1].dtype == torch.float64
    Z = thin_svd(torch.zeros(4, 6))
    assert not Z[1].any() and not (Z[0] * Z[1] @ Z[2]).any()
    with pytest.raises(ValueError, match="a matrix"):
        thin_svd(torch.randn(2, 3, 4))


def test_svd_factors_of_a_bf16_weight_are_rounded_once():
    """bf16 in: the factors are the float64 split rounded once to bf16 (not the bf16 SVD multiplied in bf16)."""
    W = torch.randn(48, 32, generator=torch.Generator().manual_seed(5)).bfloat16()
    U, V = svd_factors(W, 12)
    U64, S64, Vh64 = thin_svd(W, torch.float64)
    s = S64[:12].sqrt()
    assert U.dtype == V.dtype == torch.bfloat16
    assert torch.equal(U, (U64[:, :12] * s).bfloat16()) and torch.equal(V, (s[:, None] * Vh64[:12]).bfloat16())
