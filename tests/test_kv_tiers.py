"""The tiered KV layout (``lowrank_lib.kv.tiers``): attention over exact rows, low-rank runs and appended rows
equals dense attention over the rebuilt rows; bytes are every tensor held; int8 factors round-trip."""
import pytest
import torch

from lowrank_lib.kv.tiers import Run, Segment, TieredLayer, attend_portable, quantize_rows


def random_layer(B=2, H=3, d=16, seed=0, dtype=torch.float64, empty_ok=False, pos=False):
    """Random segments (0-5 exact rows, 0-2 runs of 1-6 rows and ranks 1-3) and their dense rows."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=dtype)
    ri = lambda lo, hi: int(torch.randint(lo, hi, (), generator=g))
    segs, dense = [], []
    for b in range(B):
        row = []
        for h in range(H):
            ne = ri(0, 5) + (0 if empty_ok else 1)
            k, v = rnd(ne, d), rnd(ne, d)
            runs, ks, vs = [], [k], [v]
            for _ in range(ri(0, 3)):
                n, rk, rv = ri(1, 7), ri(1, 4), ri(1, 4)
                r = Run(rnd(n, rk), rnd(rk, d), rnd(n, rv), rnd(rv, d),
                        torch.arange(n, dtype=torch.int16) if pos else None)
                runs.append(r)
                ks.append(r.a_k @ r.b_k)
                vs.append(r.a_v @ r.b_v)
            row.append(Segment(k, v, torch.arange(ne, dtype=torch.int16) if pos else None, runs))
            dense.append((torch.cat(ks), torch.cat(vs)))
        segs.append(row)
    return segs, dense


def reference(q, dense, kn, vn, H):
    """Dense attention over [segment rows ; appended rows], causal among the appended ones."""
    B, Hq, ql, d = q.shape
    G, t = Hq // H, kn.shape[2]
    out = torch.empty_like(q)
    for b in range(B):
        for h in range(H):
            K, V = dense[b * H + h]
            n0 = K.shape[0]
            K, V = torch.cat([K, kn[b, h]]), torch.cat([V, vn[b, h]])
            keep = torch.ones(ql, n0 + t, dtype=torch.bool)
            keep[:, n0:] = torch.ones(ql, t, dtype=torch.bool).tril(t - ql)
            s = (q[b, h * G:(h + 1) * G] * d ** -0.5) @ K.T
            out[b, h * G:(h + 1) * G] = s.masked_fill(~keep, float("-inf")).softmax(-1) @ V
    return out


@pytest.mark.parametrize("seed", range(4))
def test_attention_equals_dense_over_rebuilt_rows(seed):
    B, H, G, d = 2, 3, 2, 16
    segs, dense = random_layer(B, H, d, seed)
    layer = TieredLayer.build(segs)
    g = torch.Generator().manual_seed(100 + seed)
    kn, vn = torch.randn(B, H, 5, d, generator=g, dtype=torch.float64), torch.randn(B, H, 5, d, generator=g,
                                                                                     dtype=torch.float64)
    layer.append(kn[:, :, :2], vn[:, :, :2])
    layer.append(kn[:, :, 2:], vn[:, :, 2:])            # grows past the first capacity
    q = torch.randn(B, H * G, 3, d, generator=g, dtype=torch.float64)
    torch.testing.assert_close(attend_portable(layer, q), reference(q, dense, kn, vn, H), rtol=1e-12, atol=1e-12)
    for s in range(B * H):                              # dense() rebuilds the same rows
        K, V = layer.dense(s)
        b, h = divmod(s, H)
        torch.testing.assert_close(K, torch.cat([dense[s][0], kn[b, h]]))


def test_device_side_count_masks_unwritten_slots():
    B, H, G, d = 1, 3, 3, 16
    segs, dense = random_layer(B, H, d, 7)
    layer = TieredLayer.build(segs)
    layer.reserve(8)
    kn, vn = torch.randn(B, H, 3, d, dtype=torch.float64), torch.randn(B, H, 3, d, dtype=torch.float64)
    for i in range(3):
        layer.append(kn[:, :, i:i + 1], vn[:, :, i:i + 1], slot=torch.tensor([i]))
    assert layer.n_new == 0                            # device slots: the caller's counter is the count
    layer.k_new[:, :, 3:] = 1e3                        # garbage past the written rows must not be read
    q = torch.randn(B, H * G, 1, d, dtype=torch.float64)
    torch.testing.assert_close(attend_portable(layer, q, n_new=torch.tensor([3])), reference(q, dense, kn, vn, H))
    torch.testing.assert_close(attend_portable(layer, q, n_new=3), reference(q, dense, kn, vn, H))


def test_bytes_count_every_tensor_and_the_rows_written():
    segs, _ = random_layer(2, 3, 16, 3, dtype=torch.float32, pos=True)
    layer = TieredLayer.build(segs)
    held = sum(t.numel() * t.element_size() for t in (
        layer.k_exact, layer.v_exact, layer.e_off, layer.runs, layer.r_off, layer.a_k, layer.a_v, layer.b_k,
        layer.b_v, layer.pos_exact, layer.pos_mid))
    assert layer.nbytes == held
    layer.reserve(10)
    layer.append(torch.zeros(2, 3, 1, 16), torch.zeros(2, 3, 1, 16))
    assert layer.nbytes == held + 2 * 2 * 3 * 16 * 4
    assert layer.allocated_nbytes == held + 2 * 2 * 3 * 10 * 16 * 4
    e, m = layer.segment_counts()
    assert sum(e) == layer.counts()["exact"] and sum(m) == layer.counts()["mid"]


def test_int8_factors_are_rowwise_quantised_and_attended_dequantised():
    B, H, G, d = 1, 2, 2, 16
    segs, _ = random_layer(B, H, d, 5, dtype=torch.float32)
    q8 = TieredLayer.build(segs, quant8=True)
    assert q8.a_k.dtype == torch.int8 and q8.k_scale.dtype == torch.float16
    # the dequantised factors are what attention reads: rebuild a float layer from them and compare
    deq = [[Segment(*q8.segment(b * H + h)[:2], None,
                    [Run(*q8.run_factors(j)) for j in q8.segment(b * H + h)[2]]) for h in range(H)] for b in range(B)]
    ref = TieredLayer.build(deq)
    q = torch.randn(B, H * G, 1, d)
    torch.testing.assert_close(attend_portable(q8, q), attend_portable(ref, q), rtol=1e-5, atol=1e-6)
    x = torch.randn(5, 4)
    qi, sc = quantize_rows(x, torch.float32)
    assert (qi.abs() <= 127).all() and torch.allclose(qi.float() * sc[:, None], x, atol=float(sc.max()) / 2 + 1e-7)



def test_a_rank_zero_int8_run_packs_and_attends_as_its_absence():
    """A run whose key (or value) rank is 0 (a budget that leaves no direction): int8 packing must not fail, and the
    run's zero-rank side adds nothing (keys score 0, values add 0)."""
    d, n = 16, 6
    g = torch.Generator().manual_seed(3)
    k, v = torch.randn(4, d, generator=g), torch.randn(4, d, generator=g)
    run = Run(torch.zeros(n, 0), torch.zeros(0, d), torch.randn(n, 2, generator=g), torch.randn(2, d, generator=g))
    qi, sc = quantize_rows(torch.zeros(n, 0), torch.float16)
    assert qi.shape == (n, 0) and sc.shape == (n,) and (sc > 0).all()
    q8 = TieredLayer.build([[Segment(k, v, None, [run])]], quant8=True)
    fp = TieredLayer.build([[Segment(k, v, None, [run])]])
    q = torch.randn(1, 2, 1, d, generator=g)
    out, ref = attend_portable(q8, q), attend_portable(fp, q)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)         # int8 value factors: ~1 % per entry

def test_hostile_layouts_are_refused_by_name():
    k = torch.zeros(2, 8)
    with pytest.raises(ValueError, match="disagree"):
        TieredLayer.build([[Segment(k, k, None, [Run(torch.zeros(3, 2), torch.zeros(2, 8), torch.zeros(4, 2),
                                                     torch.zeros(2, 8))])]])
    with pytest.raises(ValueError, match="every segment or for none"):
        TieredLayer.build([[Segment(k, k, torch.arange(2)), Segment(k, k, None)]])
    empty = TieredLayer.build([[Segment(torch.zeros(0, 8), torch.zeros(0, 8))]])
    with pytest.raises(ValueError, match="holds no token"):
        attend_portable(empty, torch.zeros(1, 1, 1, 8))


def test_rebuild_path_is_the_same_function():
    from lowrank_lib.kv.tiers import attend_rebuild

    B, H, G, d = 2, 3, 2, 16
    segs, dense = random_layer(B, H, d, 11)
    layer = TieredLayer.build(segs)
    kn, vn = torch.randn(B, H, 4, d, dtype=torch.float64), torch.randn(B, H, 4, d, dtype=torch.float64)
    layer.append(kn, vn)
    q = torch.randn(B, H * G, 2, d, dtype=torch.float64)
    torch.testing.assert_close(attend_rebuild(layer, q), attend_portable(layer, q), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(attend_rebuild(layer, q), reference(q, dense, kn, vn, H), rtol=1e-12, atol=1e-12)


def test_every_backend_declares_how_it_reads_the_layout():
    """The engine adapter keys compiled steps by the layout unless the backend reads it from device tensors: that
    fact comes from the registry (an unknown backend is refused, not silently keyed by the host layout)."""
    from lowrank_lib.kv.tiers import BACKENDS, reads_device_layout

    assert [reads_device_layout(b) for b in ("portable", "rebuild", "lrk_tiers")] == [False, False, True]
    assert all(reads_device_layout(n) == b.caps.reads_device_layout for n, b in BACKENDS.items())
    with pytest.raises(ValueError, match="unknown tiered attention"):
        reads_device_layout("triton")
