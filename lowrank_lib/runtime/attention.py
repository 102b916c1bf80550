"""Attention backend registry for the dense store's decode step.

Every backend implements ``decode(q, K, V, cursor, mask)``; it only attends (the store has already
written the current token's k/v at slot ``cursor.length``: one place appends, not every kernel):

    q      [B, Hkv, G, D]   the current token's post-RoPE queries (G = Hq / Hkv, GQA native)
    K, V                    this layer's cache views (eager: only the live slots; graphs: all Smax)
    cursor                  ``length`` [1] (this token's slot, not yet advanced) and ``pad`` [B] on device
    mask   [B, 1, 1, S]     additive mask over slots (sdpa only), or None
    ->     [B, Hq * D]

Backends: ``flash_attn`` (``flash_attn_with_kvcache`` over ``length + 1`` slots from device memory,
left padding via ``cache_leftpad``), ``triton`` (our graph-safe decode kernel: reads the length and
pad counts from device memory, loops only over live slots), ``lrk_attend`` (our compiled AVX-512 or AVX2 CPU
kernel, ``runtime/kernels``: reads the length and pad counts, loops only over live slots) and
``sdpa`` (portable; under graphs it attends over all Smax slots with a
device-built mask). CUDA-only modules are imported lazily: the CPU path never touches them.

Each backend declares what it can do in :data:`BACKENDS` (a :class:`~lowrank_lib.runtime.kv.BackendCaps`: devices,
dtypes, ISA, native kernel or not, packages, whether it reads lengths from device memory or needs the store's
mask, its KV layout) and ``select_backend`` and the stores read those fields: no behaviour is chosen by name.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .backend import Backend, BackendCaps, BackendChoice, select


def lrk_attend_unavailable(device: torch.device, head_dim: int, dtype: torch.dtype, kernels: str = "auto") -> str | None:
    """Why our compiled CPU decode-attention kernel (``lrk_attend``) cannot run (None: it can)."""
    return BACKENDS["lrk_attend"].caps.unavailable(device, dtype, kernels, head_dim=head_dim)


def select_backend(requested: str, device: torch.device, head_dim: int, dtype: torch.dtype,
                   kernels: str = "auto") -> BackendChoice:
    """Pick a backend of :data:`BACKENDS` and say why (``runtime.backend.select``): ``"auto"`` takes the first of
    :data:`AUTO_ORDER` whose declared capabilities allow it here; a named one runs or raises, saying why.
    ``kernels``: ``EngineConfig.kernels`` (``"portable"`` rules out every native backend; ``"lrk"`` makes ``auto``
    require the native one on a device it serves)."""
    return select(BACKENDS, AUTO_ORDER, requested, device, head_dim, dtype, kernels)


# --------------------------------------------------------------------------- sdpa
def sdpa_decode(q, K, V, cursor, mask):
    B, Hkv, G, D = q.shape
    # GQA without repeat_kv: the G query heads of a group are the "query length" of one KV head.
    o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
    # reshape, not view: CUDA's fused kernels may return o in another memory order (seen on an H200)
    return o.reshape(B, Hkv * G * D)


def fused_decode(q, K, V, cursor, mask):
    """sdpa_decode written as broadcast-multiply-reduce, for a ``torch.compile``-d step only.

    Inductor fuses each reduction into one vectorised loop over the cache (no SDPA call, no [S]
    temporaries in memory): on the 2-core CPU a SmolLM2 step over 576 slots drops from 26.8 to
    23.9 ms. Eagerly this would materialise [B, Hkv, G, S, D] products, so the engine uses it only
    while compiling (``EngineConfig.fused_compile``)."""
    B, Hkv, G, D = q.shape
    s = (q[:, :, :, None, :] * K[:, :, None, :, :]).sum(-1) * D ** -0.5        # [B, Hkv, G, S]
    if mask is not None:
        s = s + mask
    o = (s.softmax(-1)[..., None] * V[:, :, None, :, :]).sum(-2)               # [B, Hkv, G, D]
    return o.reshape(B, Hkv * G * D)


# --------------------------------------------------------------------------- flash_attn
def flash_decode(q, K, V, cursor, mask):
    from flash_attn import flash_attn_with_kvcache

    B, Hkv, G, D = q.shape
    # the store already wrote this token at slot `length`: attend over length + 1 slots (no k/v to append).
    # cache_leftpad is passed ALWAYS (zeros without padding): a host-side "any padding?" branch would be
    # baked into a captured graph and replayed for later, padded requests (flash-attn >= 2.6).
    seqlens = (cursor.length + 1).to(torch.int32).expand(B).contiguous()
    o = flash_attn_with_kvcache(q.reshape(B, 1, Hkv * G, D), K, V, cache_seqlens=seqlens, causal=True,
                                cache_leftpad=cursor.pad[:B].to(torch.int32))
    return o.reshape(B, Hkv * G * D)


# --------------------------------------------------------------------------- triton
_TRITON_KERNEL = None


def _triton_kernel():
    """Build (once) the Triton decode kernel; imported lazily so CPU never needs triton."""
    global _TRITON_KERNEL
    if _TRITON_KERNEL is not None:
        return _TRITON_KERNEL
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_attn(Q, K, V, O, LEN, PAD, sqb, sqh, skb, skh, sks, sob, soh, scale,
                     G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        # one program per (batch row, query head); online softmax over live slots [pad, length]
        b = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // G
        n = tl.load(LEN)
        start = tl.load(PAD + b)
        d = tl.arange(0, D)
        q = tl.load(Q + b * sqb + h * sqh + d).to(tl.float32) * scale
        m_i = tl.full((1,), -1e30, tl.float32)
        l_i = tl.zeros((1,), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        base = b * skb + kvh * skh
        for s0 in range(0, n, BLOCK):
            offs = s0 + tl.arange(0, BLOCK)
            ok = (offs >= start) & (offs < n)
            kk = tl.load(K + base + offs[:, None] * sks + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            s = tl.sum(kk * q[None, :], 1)
            s = tl.where(ok, s, -1e30)
            m_new = tl.maximum(m_i, tl.max(s, 0))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new)
            p = tl.where(ok, p, 0.0)
            vv = tl.load(V + base + offs[:, None] * sks + d[None, :], mask=ok[:, None], other=0.0).to(tl.float32)
            acc = acc * alpha + tl.sum(p[:, None] * vv, 0)
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new
        out = acc / l_i
        tl.store(O + b * sob + h * soh + d, out.to(O.dtype.element_ty))

    _TRITON_KERNEL = _decode_attn
    return _decode_attn


def _triton_launch(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, n: torch.Tensor, pad: torch.Tensor,
                   G: int) -> torch.Tensor:
    """q [B, Hq, D] contiguous, K/V [B, Hkv, S, D] (stride-1 last dim), n [1] slots written, pad [>=B]."""
    B, Hq, D = q.shape
    o = torch.empty_like(q)
    _triton_kernel()[(B, Hq)](q, K, V, o, n, pad, q.stride(0), q.stride(1), K.stride(0), K.stride(1), K.stride(2),
                              o.stride(0), o.stride(1), D ** -0.5, G=G, D=D, BLOCK=64)
    return o


_TRITON_OP = None


def _triton_op():
    """The launch as a torch custom op (built once): the dispatcher then sees the kernel as ONE op, so
    torch.compile treats it as opaque and a CUDA-graph capture, or the CPU emulator of one
    (``tests/graph_emulator.py``), records it with its device-side length/pad arguments."""
    global _TRITON_OP
    if _TRITON_OP is None:
        op = torch.library.custom_op("lowrank_lib::triton_decode_attention", _triton_launch, mutates_args=())
        op.register_fake(lambda q, K, V, n, pad, G: torch.empty_like(q))
        _TRITON_OP = op
    return _TRITON_OP


def triton_decode(q, K, V, cursor, mask):
    """q [B, Hkv, G, D]; K/V the store's buffers (all slots); reads length and pad from device memory."""
    B, Hkv, G, D = q.shape
    # the kernel reads n = slots written; this token was just written at slot `length`
    o = _triton_op()(q.reshape(B, Hkv * G, D).contiguous(), K, V, cursor.length + 1, cursor.pad, G)
    return o.view(B, Hkv * G * D)


# --------------------------------------------------------------------------- lrk_attend
def lrk_attend_decode(q, K, V, cursor, mask):
    """Our AVX-512 / AVX2 kernel (``runtime/kernels/lrk.cpp``): slots ``pad[b] <= s <= length`` of each row,
    scores and softmax in fp32, G query heads per KV head (GQA native), any head_dim multiple of 16."""
    from .kernels.ops import attend

    return attend(q, K, V, cursor.length, cursor.pad, q.shape[-1] ** -0.5)


_HALF = (torch.float16, torch.bfloat16)
#: the decode-attention backends: name -> kernel and capabilities (a new backend is one entry)
BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("lrk_attend", lrk_attend_decode, BackendCaps(
        devices=("cpu",), dtypes=(torch.float32, torch.bfloat16), isa="avx2", native=True, reads_device_layout=True,
        head_dims=tuple(range(16, 129, 16))),
        "our compiled decode-attention kernel (AVX-512 or AVX2 + FMA, reads the cursor's length/pad)"),
    Backend("flash_attn", flash_decode, BackendCaps(
        devices=("cuda",), dtypes=_HALF, packages=("flash_attn",), reads_device_layout=True, layout="bshd"),
        "flash_attn_with_kvcache (half precision, lengths and left padding from device memory)"),
    Backend("triton", triton_decode, BackendCaps(
        devices=("cuda",), packages=("triton",), interpreter_env="TRITON_INTERPRET", reads_device_layout=True,
        head_dims=(16, 32, 64, 128, 256)), "our Triton decode kernel (lengths and pad counts from device memory)"),
    Backend("sdpa", sdpa_decode, BackendCaps(needs_mask=True),
            "portable path (torch sdpa over the store's slot mask)", compiled_fn=fused_decode),
)}
#: ``attention="auto"``: the first of these that can run here
AUTO_ORDER = ("lrk_attend", "flash_attn", "triton", "sdpa")


def prefill_attention(q, k, v, mask):
    """q [B, Hq, T, D], k/v [B, Hkv, T, D], mask [B, 1, T, T] additive -> [B, Hq, T, D] (sdpa)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
