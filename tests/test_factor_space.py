"""Factor-space decode attention == rebuild-then-attend (fp32, rel. err < 1e-5), MHA and GQA,
accumulate (one bulk) and stream (bulk + frozen blocks), any window, masks, batch; cost model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lowrank_lib.attsvd.factor_space import attend, dense_attention, factor_space_attention, rebuild_then_attend
from lowrank_lib.attsvd.kv import LowRankKV
from lowrank_lib.attsvd.cost import cost_table, step_cost

from helpers import rel_err, svd_kv, svd_run

TOL = 1e-5


def random_segment(b, hkv, n, rk, rv, d, gen, shared_basis=False):
    """Non-orthogonal random factors (like the attention-aware B_K = Vh C_Q^{-1/2})."""
    bb = 1 if shared_basis else b
    return (torch.randn(b, hkv, n, rk, generator=gen), torch.randn(bb, hkv, rk, d, generator=gen) / rk ** 0.5,
            torch.randn(b, hkv, n, rv, generator=gen), torch.randn(bb, hkv, rv, d, generator=gen) / rv ** 0.5)


def random_kv(b, hkv, d, bulk, ranks, blocks, w, gen, shared_basis=False):
    segs = [random_segment(b, hkv, bulk, *ranks, d, gen, shared_basis)] if bulk else []
    segs += [random_segment(b, hkv, n, *ranks, d, gen) for n in blocks]
    kw = torch.randn(b, hkv, w, d, generator=gen) * 2 if w else None
    vw = torch.randn(b, hkv, w, d, generator=gen) if w else None
    return LowRankKV(segs, kw, vw).validate()


def sdpa_reference(q, kv, mask=None):
    """Independent reference: torch SDPA (its own GQA) over the rebuilt K/V."""
    k, v = kv.dense()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


@settings(max_examples=60, deadline=None)
@given(b=st.integers(1, 3), hkv=st.integers(1, 3), group=st.sampled_from([1, 2, 3, 4]),
       d=st.sampled_from([8, 16, 64]), bulk=st.integers(0, 200), rk=st.integers(1, 16), rv=st.integers(1, 16),
       blocks=st.lists(st.integers(1, 40), max_size=3), w=st.integers(0, 24), q_len=st.integers(1, 3),
       masked=st.booleans(), shared=st.booleans(), seed=st.integers(0, 2 ** 16))
@example(b=1, hkv=1, group=1, d=8, bulk=33, rk=8, rv=1, blocks=[], w=0, q_len=1, masked=True, shared=False,
         seed=0)                          # rank-1 V: the output cancels to ~1 % of the values (CI, fp32)
def test_factor_equals_rebuild_random(b, hkv, group, d, bulk, rk, rv, blocks, w, q_len, masked, shared, seed):
    if bulk + sum(blocks) + w < q_len:      # the q_len query rows attend to at least themselves
        w = q_len - bulk - sum(blocks)
    gen = torch.Generator().manual_seed(seed)
    kv = random_kv(b, hkv, d, bulk, (min(rk, d), min(rv, d)), blocks, w, gen, shared)
    q = torch.randn(b, hkv * group, q_len, d, generator=gen) * 2
    mask = None
    if masked:  # left padding per batch row + causal among the q_len newest positions
        n = kv.length
        mask = torch.ones(b, 1, q_len, n, dtype=torch.bool)
        for i in range(b):
            pad = int(torch.randint(0, max(1, n - q_len), (1,), generator=gen))
            mask[i, :, :, :pad] = False
        mask[..., n - q_len:] &= torch.ones(q_len, q_len, dtype=torch.bool).tril()
    fac = factor_space_attention(q, kv, mask)
    reb = rebuild_then_attend(q, kv, mask)
    assert fac.shape == (b, hkv * group, q_len, d)
    # exact in exact arithmetic: float64 agrees to rounding
    q64, kv64 = q.double(), kv.to(torch.float64)
    assert rel_err(factor_space_attention(q64, kv64, mask), rebuild_then_attend(q64, kv64, mask)) < 1e-10
    # fp32: rounding is bounded by eps x the attention-weighted MAGNITUDE of the values (sum_j p_j |v_j|),
    # not by the output, which can cancel (a rank-1 V averaged to ~1 % of its rows' norm)
    k, v = kv.dense()
    scale = F.scaled_dot_product_attention(q, k, v.abs(), attn_mask=mask, enable_gqa=True).double().norm()
    for a, ref in ((fac, reb), (reb, sdpa_reference(q, kv, mask))):
        assert float((a.double() - ref.double()).norm() / scale) < TOL


@pytest.mark.parametrize("hkv,group", [(4, 1), (3, 3), (1, 8)])
def test_full_rank_reproduces_dense_attention(hkv, group):
    """Full-rank SVD factors of the exact K/V: factor space == dense attention on the exact K/V."""
    b, s, d, w = 2, 300, 32, 16
    k, v = torch.randn(b, hkv, s, d) * 1.5, torch.randn(b, hkv, s, d)
    q = torch.randn(b, hkv * group, 1, d) * 2
    kv = svd_kv(k[:, :, :-w], v[:, :, :-w], d, k_exact=k[:, :, -w:], v_exact=v[:, :, -w:])
    assert rel_err(factor_space_attention(q, kv), dense_attention(q, k, v)) < TOL
    assert rel_err(dense_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, enable_gqa=True)) < TOL


def test_truncated_cache_same_function_at_every_rank():
    """Both routes read the same truncated cache: equal at every rank, exact only at full rank."""
    gen = torch.Generator().manual_seed(1)
    b, hkv, s, d = 1, 2, 256, 32
    basis = torch.randn(d, d, generator=gen)
    spectrum = torch.logspace(0, -2, d)
    k = (torch.randn(b, hkv, s, d, generator=gen) * spectrum) @ basis
    v = (torch.randn(b, hkv, s, d, generator=gen) * spectrum) @ basis
    q = torch.randn(b, hkv * 2, 1, d, generator=gen)
    ref = dense_attention(q, k, v)
    errs = []
    for r in (2, 4, 8, 16, 32):
        kv = svd_kv(k, v, r)
        out = factor_space_attention(q, kv)
        assert rel_err(out, rebuild_then_attend(q, kv)) < TOL
        errs.append(rel_err(out, ref))
    assert errs[0] > 1e-3 and errs[-1] < TOL


def test_mask_forms_agree():
    """Bool keep-mask, additive float mask, per-query-head mask and [B, N] padding mask agree."""
    gen = torch.Generator().manual_seed(2)
    kv = random_kv(2, 3, 16, 50, (4, 6), [10], 5, gen)
    q = torch.randn(2, 6, 1, 16, generator=gen)
    keep = torch.rand(2, 1, 1, kv.length, generator=gen) > 0.4
    keep[..., -1] = True
    add = torch.zeros(keep.shape).masked_fill(~keep, float("-inf"))
    per_head = keep.expand(2, 6, 1, kv.length)
    outs = [factor_space_attention(q, kv, m) for m in (keep, add, per_head, keep[:, 0, 0])]
    for o in outs[1:]:
        assert rel_err(o, outs[0]) < TOL
    assert rel_err(outs[0], factor_space_attention(q, kv)) > 1e-3  # the mask matters
    # a head-specific mask: heads of one group may see different positions
    hm = per_head.clone()
    hm[:, 1, :, :20] = False
    assert rel_err(factor_space_attention(q, kv, hm), rebuild_then_attend(q, kv, hm)) < TOL
    assert rel_err(factor_space_attention(q, kv, hm), outs[0]) > 1e-4


def test_bf16_runs_close():
    gen = torch.Generator().manual_seed(3)
    kv32 = random_kv(1, 3, 64, 512, (32, 32), [], 16, gen)
    q = torch.randn(1, 9, 1, 64, generator=gen)
    kv16 = kv32.to(torch.bfloat16)
    assert kv16.nbytes * 2 == kv32.nbytes and all(t.dtype == torch.bfloat16 for t in kv16.runs[0])
    out = factor_space_attention(q.bfloat16(), kv16)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, factor_space_attention(q, kv32)) < 3e-2
    assert rel_err(out, rebuild_then_attend(q.bfloat16(), kv16)) < 3e-2


def test_attend_dispatch_and_clear_errors():
    gen = torch.Generator().manual_seed(4)
    kv = random_kv(1, 2, 8, 10, (2, 2), [], 3, gen)
    q = torch.randn(1, 4, 1, 8, generator=gen)
    assert torch.equal(attend("factor", q, kv), factor_space_attention(q, kv))
    with pytest.raises(ValueError, match="route"):
        attend("dense", q, kv)
    with pytest.raises(ValueError, match="r_K"):
        LowRankKV([(torch.zeros(1, 2, 5, 3), torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 5, 3),
                    torch.zeros(1, 2, 3, 8))]).validate()
    with pytest.raises(ValueError, match="positions"):
        LowRankKV([(torch.zeros(1, 2, 5, 3), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 6, 3),
                    torch.zeros(1, 2, 3, 8))]).validate()
    with pytest.raises(ValueError, match=r"runs\[0\] must be 4-D"):
        LowRankKV([(torch.zeros(2, 5, 3), torch.zeros(1, 2, 3, 8), torch.zeros(1, 2, 5, 3),
                    torch.zeros(1, 2, 3, 8))]).validate()
    with pytest.raises(ValueError, match="both k_exact and v_exact"):
        LowRankKV([], torch.zeros(1, 2, 3, 8), None).validate()
    with pytest.raises(ValueError, match="multiple"):
        factor_space_attention(torch.randn(1, 3, 1, 8), kv)
    with pytest.raises(ValueError, match="head_dim"):
        factor_space_attention(torch.randn(1, 4, 1, 16), kv)
    with pytest.raises(ValueError, match="attention mask"):
        factor_space_attention(q, kv, torch.ones(1, 1, 1, kv.length + 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="nothing to attend"):
        LowRankKV([], None, None).validate()
    with pytest.raises(TypeError, match="tiered_attention"):
        kv.shape                                   # a dense attention function gets a clear error


def test_nbytes_matches_cost_model_storage():
    gen = torch.Generator().manual_seed(5)
    d, bulk, r, w = 64, 1000, 16, 32
    kv = random_kv(1, 1, d, bulk, (r, r), [], w, gen)
    for route in ("rebuild", "factor"):
        c = step_cost(route, bulk + w, d, r, window=w)
        assert c.bytes_stored == kv.nbytes
    assert step_cost("dense", bulk + w, d, r).bytes_stored == 2 * (bulk + w) * d * 4


def test_cost_model_orders_routes():
    d, g = 64, 3
    for n in (1024, 8192):
        dense = step_cost("dense", n, d, d, group=g)
        for r in (16, 32):
            reb = step_cost("rebuild", n, d, r, window=32, group=g)
            fac = step_cost("factor", n, d, r, window=32, group=g)
            assert fac.flops < dense.flops < reb.flops
            assert fac.bytes_read < dense.bytes_read < reb.bytes_read
            assert fac.bytes_stored == reb.bytes_stored < dense.bytes_stored
        # rebuild pays S r d per head; factor space pays G S r: the ratio grows with d / G
        reb, fac = step_cost("rebuild", n, d, 32, group=g), step_cost("factor", n, d, 32, group=g)
        assert reb.flops / fac.flops > 10
    # full rank, G = 1: factor space does the same matmul work as dense plus the small r d terms
    full = step_cost("factor", 4096, d, d)
    dense = step_cost("dense", 4096, d, d)
    assert full.flops - dense.flops == 2 * (2 * d * d)
    # explicit stream segments must add up
    with pytest.raises(ValueError, match="add up"):
        step_cost("factor", 100, d, 8, window=10, segments=[(50, 8, 8)])
    rows = cost_table([1024, 2048], d, [32, 16], window=32, group=g)
    assert len(rows) == 2 * (1 + 2 * 2)


@pytest.mark.smollm2
def test_real_smollm2_heads(smollm2):
    """K/V/Q captured from a real SmolLM2 forward (GQA 9:3, d = 64): factor space == rebuild."""
    from lowrank_lib.hf import capture_qkv

    model, tok = smollm2
    text = ("The tower is 324 metres tall, about the same height as an 81-storey building, and the tallest "
            "structure in Paris. Its base is square, measuring 125 metres on each side. ") * 4
    ids = tok(text, return_tensors="pt").input_ids[:, :160]
    caps = capture_qkv(model, ids, layers=[0, 15, 29])
    assert set(caps) == {0, 15, 29}
    w = 16
    for layer, (q, k, v) in caps.items():
        assert q.shape[1] == 9 and k.shape[1] == 3 and k.shape[-1] == 64
        last_q = q[:, :, -1:]
        for r in (16, 32, 64):
            bulk = svd_run(k[:, :, :-w - 40], v[:, :, :-w - 40], r)
            block = svd_run(k[:, :, -w - 40:-w], v[:, :, -w - 40:-w], r // 2)
            for kv in (LowRankKV([bulk], k[:, :, -w:], v[:, :, -w:]),
                       LowRankKV([bulk, block], k[:, :, -w:], v[:, :, -w:])):
                assert rel_err(factor_space_attention(last_q, kv), rebuild_then_attend(last_q, kv)) < TOL
        full = svd_kv(k[:, :, :-w], v[:, :, :-w], 64, k_exact=k[:, :, -w:], v_exact=v[:, :, -w:])
        assert rel_err(factor_space_attention(last_q, full), dense_attention(last_q, k, v)) < 1e-4, layer
