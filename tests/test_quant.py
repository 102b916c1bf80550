"""lowrank_lib.quant: the spec's quantized storage and product (QUANT_SPEC, issue 30), against an independent numpy
reference written from the spec (int64 group sums, a scalar fp32 loop over groups)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowrank_lib.quant import (GROUPS, QuantizedTensor, dequantize, pack_int4, qmatmul, quantize,
                               quantize_activations, quantized_nbytes, unpack_int4)


def ref_quantize(W: np.ndarray, bits: int, g: int):
    """(q int64 [out, in_pad], scale fp16 [out, G]) straight from the spec, in numpy."""
    qmax = {8: 127, 4: 7}[bits]
    out, inp = W.shape
    p = -(-inp // g) * g
    Wp = np.zeros((out, p), np.float32)
    Wp[:, :inp] = W.astype(np.float32)
    amax = np.abs(Wp.reshape(out, p // g, g)).max(-1)
    scale = (amax / np.float32(qmax)).astype(np.float16)
    s32 = np.repeat(scale.astype(np.float32), g, 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(s32 > 0, np.rint(Wp / s32), 0)           # np.rint: round half to even
    return np.clip(q, -qmax, qmax).astype(np.int64), scale


def ref_qmatmul(x: np.ndarray, q: np.ndarray, scale: np.ndarray, g: int, bias=None) -> np.ndarray:
    """fp32 result (before the final cast) of the spec's product."""
    n, inp = x.shape
    out, p = q.shape
    xp = np.zeros((n, p), np.float32)
    xp[:, :inp] = x.astype(np.float32)
    G = p // g
    xa = np.abs(xp.reshape(n, G, g)).max(-1)
    y = np.zeros((n, out), np.float32)
    for r in range(n):
        for j in range(G):
            if xa[r, j] == 0:
                xq = np.zeros(g, np.int64)
                xs = np.float32(0)
            else:
                inv = np.float32(32767) / xa[r, j]
                xq = np.clip(np.rint(xp[r, j * g:(j + 1) * g] * inv), -32767, 32767).astype(np.int64)
                xs = xa[r, j] / np.float32(32767)
            isum = q[:, j * g:(j + 1) * g] @ xq                 # exact int64
            y[r] = y[r] + isum.astype(np.float32) * (scale[:, j].astype(np.float32) * xs)
    if bias is not None:
        y = y + bias.astype(np.float32)
    return y


# --------------------------------------------------------------------------- int4 packing
def test_int4_packing_round_trips_every_code_and_layout():
    q = torch.tensor([[-8, -7, -1, 0, 1, 7, 3, -3]], dtype=torch.int8)
    p = pack_int4(q)
    # byte k: column 2k in the low nibble, 2k + 1 in the high nibble, each as q + 8
    assert p.dtype == torch.uint8 and p.tolist() == [[0 + (1 << 4), 7 + (8 << 4), 9 + (15 << 4), 11 + (5 << 4)]]
    assert torch.equal(unpack_int4(p), q)
    allq = torch.arange(-8, 8, dtype=torch.int8).repeat(5, 2)[:, torch.randperm(32)]
    assert torch.equal(unpack_int4(pack_int4(allq)), allq)
    with pytest.raises(ValueError, match=r"\[-8, 7\]"):
        pack_int4(torch.tensor([[8, 0]], dtype=torch.int8))
    with pytest.raises(ValueError, match="even"):
        pack_int4(torch.zeros(2, 3, dtype=torch.int8))


# --------------------------------------------------------------------------- quantize / dequantize
@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("group", GROUPS)
def test_quantize_matches_the_spec_and_bounds_the_error(bits, group):
    torch.manual_seed(bits * 1000 + group)
    W = torch.randn(13, 300) * torch.logspace(-3, 2, 300)       # widely varying group magnitudes, in % group != 0
    qt = quantize(W, bits, group)
    q, scale = ref_quantize(W.numpy(), bits, group)
    assert torch.equal(qt.scale, torch.from_numpy(scale))
    assert torch.equal(qt.codes().long(), torch.from_numpy(q))
    assert qt.data.dtype == (torch.int8 if bits == 8 else torch.uint8)
    assert qt.nbytes == quantized_nbytes(13, 300, bits, group) == qt.data.numel() * qt.data.element_size() + \
        2 * qt.scale.numel()
    Wd = dequantize(qt)
    assert Wd.shape == W.shape and Wd.dtype == torch.float32
    s = qt.scale.float().repeat_interleave(group, 1)[:, :300]
    assert ((W - Wd).abs() <= s / 2).all()                       # |W - W'| <= scale / 2, per element
    assert torch.equal(qt.codes()[:, 300:], torch.zeros_like(qt.codes()[:, 300:]))   # padded columns are zero


def test_quantize_edge_values():
    W = torch.zeros(2, 64)
    W[0, 0] = 1e-9                                             # amax / 127 underflows fp16: scale 0, codes 0
    W[1, :32] = torch.linspace(-2.5, 2.5, 32)
    qt = quantize(W, 8, 32)
    assert qt.scale[0, 0] == 0 and (qt.codes()[0] == 0).all()
    assert qt.scale[1, 1] == 0 and (qt.codes()[1, 32:] == 0).all()   # an all-zero group
    assert qt.codes()[1, 0] == -127 and qt.codes()[1, 31] == 127
    assert torch.equal(quantize(W.to(torch.bfloat16), 8, 32).codes(), quantize(W.to(torch.bfloat16).float(), 8, 32).codes())


@pytest.mark.parametrize("bad, match", [
    (dict(bits=3), "bits=3"), (dict(bits=True), "bits=True"), (dict(group=48), "group=48"), (dict(group=0), "group=0"),
])
def test_quantize_rejects_bad_bits_and_groups(bad, match):
    kw = dict(bits=8, group=32) | bad
    with pytest.raises(ValueError, match=match):
        quantize(torch.randn(4, 64), **kw)


def test_quantize_rejects_hostile_matrices():
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(64), 8, 32)
    with pytest.raises(ValueError, match="2-D"):
        quantize(torch.randn(2, 2, 64), 8, 32)
    with pytest.raises(ValueError, match="floating"):
        quantize(torch.ones(2, 64, dtype=torch.int32), 8, 32)
    W = torch.randn(3, 64)
    W[1, 5] = float("nan")
    with pytest.raises(ValueError, match=r"NaN / Inf.*\[1, 5\]"):
        quantize(W, 8, 32)
    W = torch.randn(3, 64)
    W[2, 40] = 1e7                                             # 1e7 / 127 > 65504: the fp16 scale overflows
    with pytest.raises(ValueError, match="row 2 group 1.*overflows fp16"):
        quantize(W, 8, 32)
    W[2, 40] = 65504 * 127 * 0.999                              # just below: quantizable
    assert torch.isfinite(quantize(W, 8, 32).scale).all()


def test_quantized_tensor_validates_its_storage():
    qt = quantize(torch.randn(5, 70), 4, 32)
    with pytest.raises(ValueError, match="4-bit codes"):
        QuantizedTensor(qt.codes(), qt.scale, 4, 32, (5, 70))
    with pytest.raises(ValueError, match="scales"):
        QuantizedTensor(qt.data, qt.scale.float(), 4, 32, (5, 70))
    with pytest.raises(ValueError, match="codes of a 5x64"):
        QuantizedTensor(qt.data, qt.scale, 4, 32, (5, 64))      # in 64 -> 2 groups, the codes hold 3
    with pytest.raises(ValueError, match="scales"):
        QuantizedTensor(qt.data, qt.scale[:, :2], 4, 32, (5, 70))
    # a model-wide dtype cast never touches codes or scales
    m = torch.nn.Module()
    m.q = qt
    m.to(torch.bfloat16)
    assert m.q.scale.dtype == torch.float16 and m.q.data.dtype == torch.uint8
    assert set(dict(m.named_buffers())) == {"q.data", "q.scale"}


# --------------------------------------------------------------------------- activations and the product
def test_quantize_activations_matches_the_spec():
    x = torch.randn(3, 100)
    x[1, 32:64] = 0
    xq, xs = quantize_activations(x, 32)
    assert xq.dtype == torch.int16 and xq.shape == (3, 128) and xs.dtype == torch.float32 and xs.shape == (3, 4)
    assert xs[1, 1] == 0 and (xq[1, 32:64] == 0).all() and (xq[:, 100:] == 0).all()
    assert (xq.abs().view(3, 4, 32).amax(-1)[xs > 0] == 32767).all()      # each group's max reaches the range
    recon = xq.float().view(3, 4, 32) * xs[..., None]
    assert torch.allclose(recon.view(3, 128)[:, :100], x, rtol=0, atol=float(xs.max()) / 2 * 1.001)


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 9), out=st.integers(1, 40), inp=st.integers(1, 300), bits=st.sampled_from([8, 4]),
       group=st.sampled_from(GROUPS), bias=st.booleans(), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       seed=st.integers(0, 2 ** 31 - 1))
def test_qmatmul_equals_the_spec_reference(n, out, inp, bits, group, bias, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(out, inp, generator=g) * torch.exp(torch.randn(out, 1, generator=g))
    x = (torch.randn(n, inp, generator=g) * torch.exp(2 * torch.randn(1, inp, generator=g))).to(dtype)
    b = torch.randn(out, generator=g) if bias else None
    qt = quantize(W, bits, group)
    y = qmatmul(x, qt, b)
    assert y.dtype == dtype and y.shape == (n, out)
    ref = ref_qmatmul(x.float().numpy(), qt.codes().long().numpy(), qt.scale.numpy(), group,
                      None if b is None else b.numpy())
    # same integer sums, same fp32 order; only the fused multiply-add / operand rounding may differ by an ulp
    ref_t = torch.from_numpy(ref)
    assert torch.allclose(y.float(), ref_t.to(dtype).float(), rtol=2e-6 if dtype == torch.float32 else 8e-3,
                          atol=1e-30)
    # and it is a product with the dequantized weight, up to the activations' int16 rounding (<= xa / 65534 per
    # element of a group whose max is xa)
    Wd = dequantize(qt)
    dense = x.float() @ Wd.t() + (0 if b is None else b)
    xa = torch.nn.functional.pad(x.float().abs(), (0, qt.in_pad - inp)).view(n, qt.groups, group).amax(-1)
    wsum = torch.nn.functional.pad(Wd.abs(), (0, qt.in_pad - inp)).view(out, qt.groups, group).sum(-1)
    tol = (xa @ wsum.t()) / 65534 * 1.01 + (x.float().abs() @ Wd.abs().t()) * 1e-6 + 1e-30
    assert ((y.float() - dense).abs() <= tol + (dense.abs() * 8e-3 if dtype == torch.bfloat16 else 0)).all()


def test_qmatmul_is_exact_on_integer_inputs_and_keeps_leading_dims():
    # codes and activations that quantize exactly: the product is the integer one times the scales
    W = torch.tensor([[127.0] * 32 + [-127.0] * 32, [1.0, -1.0] * 32])
    qt = quantize(W, 8, 32)
    x = torch.full((2, 3, 64), 32767.0)
    y = qmatmul(x, qt)
    assert y.shape == (2, 3, 2)
    assert torch.equal(y[0, 0], torch.tensor([127.0 * 32767 * 32 - 127.0 * 32767 * 32, 0.0]))
    x[..., :32] = 1.0
    assert torch.equal(qmatmul(x, qt)[1, 2], torch.tensor([127.0 * 32 - 127.0 * 32767 * 32, 0.0]))


def test_qmatmul_propagates_nonfinite_activations_and_checks_shapes():
    qt = quantize(torch.randn(4, 64), 4, 32)
    x = torch.randn(3, 64)
    x[1, 3] = float("nan")
    x[2, 40] = float("inf")
    y = qmatmul(x, qt)
    assert torch.isfinite(y[0]).all() and not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).any()
    with pytest.raises(ValueError, match="63 columns"):
        qmatmul(torch.randn(2, 63), qt)
    with pytest.raises(ValueError, match="bias"):
        qmatmul(torch.randn(2, 64), qt, torch.zeros(3))


def test_qmatmul_blocks_rows_without_changing_the_result(monkeypatch):
    import lowrank_lib.quant as quant

    qt = quantize(torch.randn(24, 96), 8, 32)
    x = torch.randn(50, 96)
    full = qmatmul(x, qt)
    monkeypatch.setattr(quant, "_BLOCK", 24 * 3 * 7)           # 7 rows per block: 8 blocks, the last one short
    assert torch.equal(qmatmul(x, qt), full)
