"""Quantized factors (issue 30): group-wise symmetric int8 / int4 codes with fp16 scales, and their product.

The ONE semantic is ``/work/coord/QUANT_SPEC.md`` (summarised here; the packed kernels ``ops.qgemv`` implement the
same math and equal this portable path up to fp32 summation order):

* weights W [out, in] -> :class:`QuantizedTensor`: groups of ``group`` columns along the reduction dim (in), padded
  with zero columns to ``in_pad``; ``scale[o, j] = fp16(amax / qmax)`` (qmax 127 or 7), ``q = clamp(round_half_even(
  W / float32(scale)), -qmax, qmax)``; stored as int8 [out, in_pad] (8 bits) or nibble-packed uint8 [out, in_pad / 2]
  (4 bits: column 2k in the LOW nibble of byte k, 2k + 1 in the HIGH one, each as q + 8);
* activations x [N, in] -> int16 per row and group (:func:`quantize_activations`), scale ``xs = amax / 32767``;
* codes are rounded to nearest (:func:`quantize`) or chosen by GPTQ for a calibration input moment (:func:`gptq`):
  the same storage either way;
* product (:func:`qmatmul`): exact integer group sums, then ``y = sum_j float32(isum_j) * (scale_j * xs_j)`` in fp32,
  in the order j = 0, 1, ..., plus the bias, rounded once to x's dtype.

A leaf of the package (torch only), so the representation (``factorized``), the formats and the runtime share it.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["BITS", "GROUPS", "DEFAULT_GROUP", "QMAX", "X_QMAX", "QuantizedTensor", "quantize", "dequantize", "pack_int4",
           "unpack_int4", "quantize_blocks", "gptq", "quantize_activations", "qmatmul", "padded", "quantized_nbytes", "storage_shapes"]

BITS = (8, 4)
GROUPS = (32, 64, 128, 256)
#: the default group, from measured quality: SmolLM2, SVD-LLM v1 keep 0.8, 4 x 2048 WikiText-2 windows
#: (``benchmarks/results/quant_quality_smollm2_keep0.8_w4x2048.json``): int8 perplexity vs bf16 factors +0.20 % at
#: group 32, +0.73 % at 64, +1.27 % at 128 (the 0.5 % target holds at 32 only); and 32 is also the fewest bytes
#: there (93.3 / 94.1 / 95.4 MB): ranks padded to 64 or 128 columns cost more than the extra scales
DEFAULT_GROUP = 32
QMAX = {8: 127, 4: 7}
#: the activations' int16 range (symmetric)
X_QMAX = 32767
#: float64 elements of one block of exact group sums in :func:`qmatmul` (bounds its temporary memory)
_BLOCK = 1 << 22
#: fp32 elements of one block of rows in :func:`quantize` (1 MB: the block's passes run in cache; the whole matrix at
#: once made every pass a trip to memory: 7.8 ns per element against 1.2 here, measured on the 2-core VM)
_QBLOCK = 1 << 18


def _scale(amax: torch.Tensor, qmax: int) -> torch.Tensor:
    """The spec's group scales: ``fp16(amax / qmax)``, the division in fp32 (inf where it overflows fp16)."""
    return _div(amax, torch.full_like(amax, qmax)).to(torch.float16)


def _div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """IEEE fp32 division of two tensors of one shape (``scalar / tensor`` in torch is ``reciprocal * scalar``, and
    a division by a scalar may be a multiplication by its reciprocal on some devices: two roundings, not the spec's
    one)."""
    return torch.div(a, b)


def _check_bits_group(bits, group) -> None:
    if isinstance(bits, bool) or bits not in BITS:
        raise ValueError(f"bits={bits!r}: use one of {BITS}")
    if isinstance(group, bool) or group not in GROUPS:
        raise ValueError(f"group={group!r}: use one of {GROUPS} (columns per scale along the reduction dim)")


def padded(n: int, group: int) -> int:
    """``ceil(n / group) * group``: the reduction dim padded to whole groups."""
    return -(-n // group) * group


def quantized_nbytes(out: int, inp: int, bits: int, group: int) -> int:
    """Bytes of codes + scales of an [out, in] matrix: ``bits * out * in_pad / 8 + 2 * out * in_pad / group``."""
    p = padded(inp, group)
    return bits * out * p // 8 + 2 * out * p // group


def storage_shapes(out: int, inp: int, bits: int, group: int) -> tuple[tuple, tuple]:
    """``((codes dtype, codes shape), (scales dtype, scales shape))`` of the canonical storage of an [out, in]
    matrix: int8 [out, in_pad] or uint8 [out, in_pad / 2]; fp16 [out, in_pad / group]."""
    _check_bits_group(bits, group)
    p = padded(inp, group)
    data = (torch.int8, (out, p)) if bits == 8 else (torch.uint8, (out, p // 2))
    return data, (torch.float16, (out, p // group))


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """int8 codes [out, n] in [-8, 7], n even -> uint8 [out, n / 2]: column 2k in the low nibble, 2k + 1 in the
    high nibble, each stored as q + 8."""
    if q.dim() != 2 or q.shape[1] % 2:
        raise ValueError(f"pack_int4 needs 2-D codes with an even number of columns, got {tuple(q.shape)}")
    if q.dtype != torch.int8:
        raise TypeError(f"pack_int4 needs int8 codes, got {q.dtype}")
    if q.numel() and (int(q.min()) < -8 or int(q.max()) > 7):
        raise ValueError(f"int4 codes must lie in [-8, 7], got [{int(q.min())}, {int(q.max())}]")
    u = (q.to(torch.int16) + 8).to(torch.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).contiguous()


def unpack_int4(p: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: uint8 [out, n / 2] -> int8 codes [out, n]."""
    if p.dim() != 2 or p.dtype != torch.uint8:
        raise TypeError(f"unpack_int4 needs 2-D uint8 bytes, got {p.dtype} {tuple(p.shape)}")
    lo = (p & 15).to(torch.int8) - 8
    hi = (p >> 4).to(torch.int8) - 8
    return torch.stack([lo, hi], -1).reshape(p.shape[0], 2 * p.shape[1])


class QuantizedTensor(nn.Module):
    """A quantized matrix [out, in] in the canonical storage of the spec: ``data`` (int8 [out, in_pad], or uint8
    [out, in_pad / 2] for 4 bits) and ``scale`` (fp16 [out, in_pad / group]), both buffers.

    A module, so ``model.to(device)``, ``state_dict`` and sharing (one object referenced by several
    ``LowRankLinear``: a shared basis stays one) work as for an ``nn.Parameter``. A dtype cast of the model never
    touches it: the codes and the fp16 scales are the stored bytes (only device moves apply).
    """

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, bits: int, group: int, shape):
        super().__init__()
        _check_bits_group(bits, group)
        out, inp = (int(s) for s in shape)
        if out < 1 or inp < 1:
            raise ValueError(f"shape {tuple(shape)}: a quantized matrix needs out >= 1 and in >= 1")
        want, swant = storage_shapes(out, inp, bits, group)
        if data.dtype != want[0] or tuple(data.shape) != want[1]:
            raise ValueError(f"{bits}-bit codes of a {out}x{inp} matrix (group {group}) are {want[0]} {want[1]}, "
                             f"got {data.dtype} {tuple(data.shape)}")
        if scale.dtype != swant[0] or tuple(scale.shape) != swant[1]:
            raise ValueError(f"scales of a {out}x{inp} matrix (group {group}) are {swant[0]} {swant[1]}, got "
                             f"{scale.dtype} {tuple(scale.shape)}")
        if data.device != scale.device:
            raise ValueError(f"codes on {data.device} but scales on {scale.device}")
        self.bits, self.group = int(bits), int(group)
        self.shape = torch.Size((out, inp))
        self.register_buffer("data", data)
        self.register_buffer("scale", scale)

    # ------------------------------------------------------------------ geometry
    @property
    def in_pad(self) -> int:
        return padded(self.shape[1], self.group)

    @property
    def groups(self) -> int:
        return self.in_pad // self.group

    @property
    def qmax(self) -> int:
        return QMAX[self.bits]

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        """Codes + scales, the bytes a product reads."""
        return self.data.numel() * self.data.element_size() + self.scale.numel() * self.scale.element_size()

    def dim(self) -> int:
        return 2

    def codes(self) -> torch.Tensor:
        """The codes as int8 [out, in_pad] (a view for 8 bits, unpacked for 4)."""
        return self.data if self.bits == 8 else unpack_int4(self.data)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight ``float32(scale) * q`` [out, in] (exact in fp32), cast to ``dtype``."""
        return dequantize(self, dtype)

    def _apply(self, fn, recurse=True):
        # device moves only: a dtype cast of the model (model.to(torch.bfloat16)) must not touch codes or scales
        dev = fn(torch.empty(0, dtype=torch.float32, device=self.data.device)).device
        if dev != self.data.device:
            self.data = self.data.to(dev)
            self.scale = self.scale.to(dev)
        return self

    def extra_repr(self) -> str:
        return f"shape={tuple(self.shape)}, bits={self.bits}, group={self.group}"


def quantize(W: torch.Tensor, bits: int, group: int) -> QuantizedTensor:
    """W [out, in] (fp32 / bf16 / fp16) -> :class:`QuantizedTensor` (the spec's rounding, computed in fp32).

    Raises ValueError for bits or group outside the spec, a non-2-D or non-float W, NaN / Inf entries, or a group
    whose scale ``amax / qmax`` overflows fp16 (that matrix is not quantizable at this group)."""
    _check_bits_group(bits, group)
    if not isinstance(W, torch.Tensor) or W.dim() != 2:
        raise ValueError(f"quantize needs a 2-D matrix [out, in], got {getattr(W, 'shape', type(W))}")
    if not W.is_floating_point():
        raise ValueError(f"quantize needs a floating-point matrix, got {W.dtype}")
    out, inp = W.shape
    if out < 1 or inp < 1:
        raise ValueError(f"quantize needs a non-empty matrix, got {tuple(W.shape)}")
    W = W.detach()
    return quantize_blocks((out, inp), lambda r0, r1: W[r0:r1], bits, group, W.device)


def quantize_blocks(shape, block, bits: int, group: int, device=None) -> QuantizedTensor:
    """:func:`quantize` of the [out, in] matrix whose rows ``r0:r1`` are ``block(r0, r1)`` (a float tensor), one
    block of rows at a time: bit for bit the same codes and scales, and a matrix decoded block by block (Dobi's codes,
    ``formats.dobi``) is never held whole. Same errors as :func:`quantize`. (Blocks in two Python threads were no
    faster on the 2-core VM: 0.62-0.94 against 0.84-0.87 GB/s of Dobi codes.)"""
    _check_bits_group(bits, group)
    out, inp = (int(s) for s in shape)
    p, qmax = padded(inp, group), QMAX[bits]
    q = torch.empty(out, p, dtype=torch.int8, device=device)
    scale = torch.empty(out, p // group, dtype=torch.float16, device=device)
    rows = max(1, _QBLOCK // p)

    def one(r0: int) -> None:           # a block of rows: its fp32 temporaries stay in cache for every pass
        r1 = min(out, r0 + rows)
        Wf = torch.zeros(r1 - r0, p, device=device) if p != inp else torch.empty(r1 - r0, p, device=device)
        Wf[:, :inp] = block(r0, r1)     # fp32, contiguous, zero-padded to whole groups
        Wg = Wf.view(-1, p // group, group)
        amax = Wg.abs().amax(-1)                                # NaN propagates (aminmax: 7x slower, measured)
        sc = _scale(amax, qmax)
        if not torch.isfinite(sc).all():
            _unquantizable(out, rows, block, r0, Wg, sc, bits, group, qmax)
        scale[r0:r1] = sc
        sf = sc.to(torch.float32)
        # a zero scale (a zero group, or amax / qmax below fp16's range) divides by 1: |W| that small rounds to 0
        Wg.div_(torch.where(sf > 0, sf, 1.0)[..., None]).round_().clamp_(-qmax, qmax)
        q[r0:r1] = Wf

    for r0 in range(0, out, rows):
        one(r0)
    data = q if bits == 8 else pack_int4(q)
    return QuantizedTensor(data.contiguous(), scale, bits, group, (out, inp))


def gptq(W: torch.Tensor, H: torch.Tensor, bits: int, group: int, damp: float = 0.01,
         block: int = 128) -> QuantizedTensor:
    """W [out, in] -> :class:`QuantizedTensor` in the spec's storage, codes chosen by GPTQ (Frantar et al., "GPTQ:
    Accurate Post-Training Quantization for Generative Pre-trained Transformers", ICLR 2023, Algorithm 1) for the
    input second moment ``H`` [in, in] (X^T X over calibration tokens): columns quantized left to right, each
    column's rounding error spread over the columns not yet quantized through the Cholesky factor of H^-1 (with
    ``damp`` times H's mean diagonal added: the paper's dampening, raised tenfold while H stays indefinite), in lazy
    blocks of ``block`` columns. Every group's scale is the spec's ``fp16(amax / qmax)`` of the group's weights as
    the error feedback has left them when the group starts (groups in column order; no act-order), so the
    codes decode, pack and multiply exactly as :func:`quantize`'s. This minimises ``||(W - dequantize) X^T||``
    rather than the weight error: with a diagonal H nothing is spread and the codes equal :func:`quantize`'s.

    Same errors as :func:`quantize`, and ValueError for an H that is not [in, in] or not finite."""
    _check_bits_group(bits, group)
    if not isinstance(W, torch.Tensor) or W.dim() != 2 or not W.is_floating_point():
        raise ValueError(f"gptq needs a 2-D float matrix [out, in], got {getattr(W, 'shape', type(W))}")
    out, inp = W.shape
    if not isinstance(H, torch.Tensor) or tuple(H.shape) != (inp, inp):
        raise ValueError(f"gptq needs H [in, in] = [{inp}, {inp}], got {tuple(getattr(H, 'shape', ()))}")
    if not torch.isfinite(W).all():
        quantize(W, bits, group)                        # its error names the first NaN / Inf
    if not torch.isfinite(H).all():
        raise ValueError("gptq: H has NaN / Inf entries")
    p, qmax = padded(inp, group), QMAX[bits]
    Hd = torch.eye(p, dtype=torch.float64, device=W.device)
    Hd[:inp, :inp] = H.detach().to(torch.float64)
    Wf = torch.zeros(out, p, dtype=torch.float32, device=W.device)
    Wf[:, :inp] = W.detach().to(torch.float32)
    dead = torch.diagonal(Hd) <= 0                      # an input never seen: its weights meet only zeros
    Hd[dead, dead] = 1.0
    Wf[:, dead] = 0.0
    lam = damp * float(torch.diagonal(Hd).mean())
    for _ in range(6):
        L, info = torch.linalg.cholesky_ex(Hd + lam * torch.eye(p, dtype=torch.float64, device=W.device))
        if int(info) == 0:
            break
        lam *= 10
    else:
        raise ValueError("gptq: H is not positive definite even after dampening")
    Hinv = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True).to(torch.float32)
    q = torch.empty(out, p, dtype=torch.int8, device=W.device)
    scale = torch.empty(out, p // group, dtype=torch.float16, device=W.device)
    block = max(group, int(block) // group * group)     # whole groups per block: a group's scale sees its columns
    for b0 in range(0, p, block):
        b1 = min(p, b0 + block)
        W1, Hb = Wf[:, b0:b1].clone(), Hinv[b0:b1, b0:b1]
        E = torch.empty_like(W1)
        for i in range(b1 - b0):
            c = b0 + i
            if c % group == 0:                          # the group's scale, from its weights as they are now
                amax = W1[:, i:i + group].abs().amax(-1)
                sc = _scale(amax, qmax)
                if not torch.isfinite(sc).all():
                    o = int(torch.isinf(sc).nonzero()[0])
                    raise ValueError(f"gptq: row {o} group {c // group} has max |W| = {float(amax[o]):.6g} after "
                                     f"the error feedback, its scale (/{qmax}) overflows fp16: not quantizable at "
                                     f"{bits} bits, group {group}")
                scale[:, c // group] = sc
                sf = sc.to(torch.float32)
                sd = torch.where(sf > 0, sf, 1.0)
            w = W1[:, i]
            qc = _div(w, sd).round_().clamp_(-qmax, qmax)
            q[:, c] = qc.to(torch.int8)
            e = (w - qc * sf) / Hb[i, i]
            W1[:, i:] -= e[:, None] * Hb[i, i:][None, :]
            E[:, i] = e
        Wf[:, b1:] -= E @ Hinv[b0:b1, b1:]
    data = q if bits == 8 else pack_int4(q)
    return QuantizedTensor(data.contiguous(), scale, bits, group, (out, inp))


def _unquantizable(out: int, rows: int, block, r0: int, Wg: torch.Tensor, sc: torch.Tensor, bits: int, group: int,
                   qmax: int):
    """The error of :func:`quantize_blocks` for a block whose scales are not finite: NaN / Inf anywhere in the
    matrix first (its first such entry), else the first group (from row ``r0`` on) whose scale overflows fp16."""
    for a in range(0, out, rows):
        bad = ~torch.isfinite(block(a, min(out, a + rows)))
        if bad.any():
            i, j = bad.nonzero()[0].tolist()
            raise ValueError(f"quantize: the matrix has NaN / Inf entries (first at {[a + i, j]})")
    o, j = torch.isinf(sc).nonzero()[0].tolist()
    raise ValueError(f"quantize: row {r0 + o} group {j} has max |W| = {float(Wg[o, j].abs().max()):.6g}, its scale "
                     f"(/{qmax}) overflows fp16: this matrix is not quantizable at {bits} bits, group {group}")


def dequantize(qt: QuantizedTensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float32(scale[o, j]) * q[o, k]`` [out, in] (exact in fp32: an 11-bit mantissa times a 7-bit code)."""
    out, inp = qt.shape
    q = qt.codes().to(torch.float32).view(out, qt.groups, qt.group)
    W = (q * qt.scale.to(torch.float32)[..., None]).view(out, qt.in_pad)[:, :inp]
    return W.to(dtype).contiguous()


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, in] -> (xq int16 [N, in_pad], xs fp32 [N, in_pad / group]), per row and group, computed in fp32:
    ``xq = clamp(round_half_even(x * (32767 / amax)), +-32767)``, ``xs = amax / 32767``; a group of zeros gives
    xq = 0 and xs = 0. NaN / Inf in a group make its ``xs`` non-finite, so the product is non-finite too."""
    if isinstance(group, bool) or group not in GROUPS:
        raise ValueError(f"group={group!r}: use one of {GROUPS}")
    if x.dim() != 2 or not x.is_floating_point():
        raise ValueError(f"quantize_activations needs a 2-D float x [N, in], got {x.dtype} {tuple(x.shape)}")
    n, inp = x.shape
    p = padded(inp, group)
    x32 = x.to(torch.float32)
    if p != inp:
        x32 = torch.nn.functional.pad(x32, (0, p - inp))
    xg = x32.view(n, p // group, group)
    xa = xg.abs().amax(-1)
    nz = xa != 0
    inv = torch.where(nz, _div(torch.full_like(xa, X_QMAX), torch.where(nz, xa, 1.0)), 0.0)
    xq = torch.round(xg * inv[..., None]).clamp_(-X_QMAX, X_QMAX)
    xq = torch.nan_to_num(xq, nan=0.0).to(torch.int16).view(n, p)
    return xq, _div(xa, torch.full_like(xa, X_QMAX))


def qmatmul(x: torch.Tensor, qt: QuantizedTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The spec's product ``y = x W^T (+ bias)`` for x [..., in] and W = ``qt`` [out, in] -> [..., out] in x's dtype.

    Group sums of int32(q) * int32(xq) are exact (computed in float64, where every partial sum is an integer below
    2^31 < 2^53, so any summation order gives the same value); the groups are then accumulated in fp32 in the order
    j = 0, 1, ...; the bias is added in fp32 and the result rounded once to x's dtype."""
    out, inp = qt.shape
    if x.shape[-1] != inp:
        raise ValueError(f"qmatmul: x has {x.shape[-1]} columns, the matrix reads {inp}")
    if bias is not None and tuple(bias.shape) != (out,):
        raise ValueError(f"qmatmul: bias has shape {tuple(bias.shape)}, expected ({out},)")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, inp)
    n, g, G = x2.shape[0], qt.group, qt.groups
    xq, xs = quantize_activations(x2, g)
    q = qt.codes().to(torch.float64).view(out, G, g).permute(1, 2, 0)          # [G, g, out]
    sc = qt.scale.to(torch.float32)                                             # [out, G]
    y = torch.zeros(n, out, dtype=torch.float32, device=x.device)
    rows = max(1, _BLOCK // max(1, G * out))
    for a in range(0, n, rows):
        b = min(n, a + rows)
        xb = xq[a:b].to(torch.float64).view(b - a, G, g).transpose(0, 1)        # [G, n, g]
        isum = torch.bmm(xb, q).to(torch.float32)                               # [G, n, out], exact integers
        acc = y[a:b]
        for j in range(G):
            acc += isum[j] * (sc[:, j][None, :] * xs[a:b, j][:, None])
    if bias is not None:
        y = y + bias.to(torch.float32)
    return y.to(x.dtype).reshape(*lead, out)
