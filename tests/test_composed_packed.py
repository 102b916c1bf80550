"""The packed layout of the composed tiers (``composed.kv.pack`` / ``attend_packed`` / ``attend_layer``): equal to
the ragged per-head reference ``attend`` on random ragged tiers (fp and int8 factors, heads without a low-rank tier
or without exact rows, ranks below the row's, appended rows under the causal or a given mask, GQA, batch rows > 1),
and its bytes counted exactly: the packed tensors, offsets, head ids and rank padding, nothing held twice."""
from __future__ import annotations

import copy

import pytest
import torch

from lowrank_lib.composed.kv import (ATTEND_MODES, HeadTiers, Q8, PackedLayer, attend, attend_layer, attend_packed,
                                     pack, tiers_nbytes)

D, H, G = 16, 3, 2


def _head(gen, ne, nm, rk, rv, q8, dtype):
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=dtype)
    ht = HeadTiers(rnd(ne, D), rnd(ne, D), torch.randperm(64, generator=gen)[:ne].to(torch.int16))
    if nm:
        a_k, a_v = rnd(nm, rk), rnd(nm, rv)
        if q8:
            a_k, a_v = Q8.quantize(a_k), Q8.quantize(a_v)
        ht.a_k, ht.b_k, ht.a_v, ht.b_v = a_k, rnd(rk, D), a_v, rnd(rv, D)
        ht.pos_mid = torch.arange(nm, dtype=torch.int16)
    return ht


def _tiers(seed, q8, dtype=torch.float64, B=2):
    """Ragged rows: counts and ranks drawn per head, some heads without a low-rank tier or without exact rows."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for b in range(B):
        row = []
        for h in range(H):
            ne = int(torch.randint(0, 9, (), generator=gen))
            nm = int(torch.randint(0, 8, (), generator=gen)) if (b + h + seed) % 3 else 0
            ne = max(ne, 1) if nm == 0 else ne
            rk, rv = (int(torch.randint(1, 5, (), generator=gen)) for _ in range(2))
            row.append(_head(gen, ne, nm, rk, rv, q8, dtype))
        rows.append(row)
    return rows


def _io(seed, B, ql, t, dtype=torch.float64):
    gen = torch.Generator().manual_seed(100 + seed)
    q = torch.randn(B, H * G, ql, D, generator=gen, dtype=dtype)
    kn = torch.randn(B, H, t, D, generator=gen, dtype=dtype) if t else None
    vn = torch.randn(B, H, t, D, generator=gen, dtype=dtype) if t else None
    return q, kn, vn


@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("ql,t,mask", [(1, 0, None), (1, 5, None), (3, 7, None), (3, 7, "bool"), (2, 6, "add")])
@pytest.mark.parametrize("seed", range(4))
def test_packed_attention_equals_the_ragged_reference(q8, ql, t, mask, seed):
    B = 2
    heads = _tiers(seed, q8)
    q, kn, vn = _io(seed, B, ql, t)
    m = None
    if mask is not None:
        keep = torch.rand(B, 1, ql, t, generator=torch.Generator().manual_seed(seed)) > 0.3
        keep[..., -1] = True
        m = keep if mask == "bool" else torch.zeros(B, 1, ql, t, dtype=q.dtype).masked_fill(~keep, float("-inf"))
    ref = attend(q, copy.deepcopy(heads), kn, vn, 0.3, m)          # on tensors that are not views of a pack
    layer = pack(heads)
    out = attend_packed(q, layer, kn, vn, 0.3, m)
    assert out.shape == ref.shape and out.dtype == q.dtype
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)     # softmax in fp32 in both
    torch.testing.assert_close(attend(q, heads, kn, vn, 0.3, m), ref, rtol=1e-5, atol=1e-6)  # over the views
    for mode in ATTEND_MODES:
        torch.testing.assert_close(attend_layer(q, layer, kn, vn, 0.3, m, mode=mode), ref, rtol=1e-5, atol=1e-6)


def test_packed_attention_fp32_and_a_single_row():
    heads = _tiers(7, True, torch.float32, B=1)
    q, kn, vn = _io(7, 1, 1, 4, torch.float32)
    ref = attend(q, copy.deepcopy(heads), kn, vn)
    torch.testing.assert_close(attend_packed(q, pack(heads), kn, vn), ref, rtol=1e-5, atol=1e-6)


def _storages(layer: PackedLayer) -> int:
    """Bytes of the distinct storages the packed rows and the heads' positions reference."""
    seen = {}
    for pr in layer.rows:
        for t in (pr.k_exact, pr.v_exact, pr.e_lo, pr.e_hi, pr.a_k, pr.a_v, pr.b_k, pr.b_v, pr.m_lo, pr.m_hi,
                  pr.mid_heads):
            for x in ((t.q, t.scale) if isinstance(t, Q8) else (t,)):
                if x is not None:
                    seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    for row in layer.heads:
        for h in row:
            for x in (h.pos_exact, h.pos_mid):
                if x is not None:
                    seen[x.untyped_storage().data_ptr()] = x.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("q8", [False, True])
@pytest.mark.parametrize("seed", range(3))
def test_packed_bytes_are_counted_exactly(q8, seed):
    heads = _tiers(seed, q8, torch.float32)
    ragged = tiers_nbytes(heads)
    expect_extra = 0
    for row in heads:
        expect_extra += 2 * H * 8                                   # e_lo, e_hi (int64)
        mids = [h for h in row if h.n_mid]
        if mids:
            r = max(max(h.rank_k, h.rank_v) for h in mids)
            expect_extra += 3 * len(mids) * 8                       # m_lo, m_hi, mid_heads
            for h in mids:
                for a, rank in ((h.a_k, h.rank_k), (h.a_v, h.rank_v)):
                    elt = a.q.element_size() if isinstance(a, Q8) else a.element_size()
                    expect_extra += h.n_mid * (r - rank) * elt + (r - rank) * D * 4   # zero columns of A, rows of B
    layer = pack(heads)
    assert layer.nbytes == ragged + expect_extra
    assert layer.nbytes == _storages(layer)                         # every byte of every storage, nothing else
    assert tiers_nbytes(heads) == ragged                            # the heads are views: their own count is unchanged
    for row, pr in zip(heads, layer.rows):                         # ... into the packed storage (nothing held twice)
        for h in row:
            assert h.k_exact.untyped_storage().data_ptr() == pr.k_exact.untyped_storage().data_ptr()
            if h.n_mid:
                a = h.a_k.q if isinstance(h.a_k, Q8) else h.a_k
                pa = pr.a_k.q if isinstance(pr.a_k, Q8) else pr.a_k
                assert a.untyped_storage().data_ptr() == pa.untyped_storage().data_ptr()


def test_packed_attention_refuses_what_it_cannot_read():
    heads = _tiers(1, False, torch.float32, B=1)
    heads[0][1] = HeadTiers(torch.zeros(0, D), torch.zeros(0, D), torch.zeros(0, dtype=torch.int16))
    layer = pack(heads)
    q, kn, vn = _io(1, 1, 1, 3, torch.float32)
    with pytest.raises(ValueError, match="holds no token"):
        attend_packed(q, layer, None, None)
    torch.testing.assert_close(attend_packed(q, layer, kn, vn), attend(q, heads, kn, vn), rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="unknown composed attention mode"):
        attend_layer(q, layer, kn, vn, mode="fast")
