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
pad counts from device memory, loops only over live slots) and ``sdpa`` (portable; under graphs it
attends over all Smax slots with a device-built mask). CUDA-only modules are imported lazily: the CPU
path never touches them.
"""
from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from .kv.base import BackendChoice


def _has(mod: str) -> bool:
    try:
        return importlib.util.find_spec(mod) is not None
    except (ImportError, ValueError):
        return False


def select_backend(requested: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> BackendChoice:
    """Pick a backend and say why. Raises if an explicitly requested backend cannot run."""
    cuda = device.type == "cuda"
    fa_ok = cuda and _has("flash_attn") and dtype in (torch.float16, torch.bfloat16)
    tr_ok = cuda and _has("triton") and head_dim in (16, 32, 64, 128, 256)
    if requested == "flash_attn":
        if not fa_ok:
            raise RuntimeError(f"attention='flash_attn' needs CUDA, the flash_attn package and fp16/bf16 "
                               f"(device={device.type}, installed={_has('flash_attn')}, dtype={dtype})")
        return BackendChoice("flash_attn", "requested", "bshd")
    if requested == "triton":
        if not tr_ok:
            raise RuntimeError(f"attention='triton' needs CUDA, triton and a power-of-two head_dim "
                               f"(device={device.type}, installed={_has('triton')}, head_dim={head_dim})")
        return BackendChoice("triton", "requested", "bhsd")
    if requested == "sdpa":
        return BackendChoice("sdpa", "requested", "bhsd")
    if fa_ok:
        return BackendChoice("flash_attn", "auto: CUDA + flash_attn importable + half precision", "bshd")
    if tr_ok:
        why = "flash_attn not importable" if not _has("flash_attn") else f"flash_attn needs fp16/bf16, got {dtype}"
        return BackendChoice("triton", f"auto: CUDA + triton ({why})", "bhsd")
    return BackendChoice("sdpa", "auto: portable path" + (" (CPU device)" if not cuda else " (no flash_attn/triton)"),
                         "bhsd")


# --------------------------------------------------------------------------- sdpa
def sdpa_decode(q, K, V, cursor, mask):
    B, Hkv, G, D = q.shape
    # GQA without repeat_kv: the G query heads of a group are the "query length" of one KV head.
    o = F.scaled_dot_product_attention(q, K, V, attn_mask=mask)
    return o.view(B, Hkv * G * D)


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
    # the store already wrote this token at slot `length`: attend over length + 1 slots (no k/v to append)
    seqlens = (cursor.length + 1).to(torch.int32).expand(B).contiguous()
    kw = {"cache_leftpad": cursor.pad[:B].to(torch.int32)} if cursor.any_pad else {}   # flash-attn >= 2.6
    o = flash_attn_with_kvcache(q.reshape(B, 1, Hkv * G, D), K, V, cache_seqlens=seqlens, causal=True, **kw)
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


def triton_decode(q, K, V, cursor, mask):
    B, Hkv, G, D = q.shape
    Hq = Hkv * G
    q = q.reshape(B, Hq, D).contiguous()
    o = torch.empty_like(q)
    kern = _triton_kernel()
    # the kernel reads length = written slots; this token was just written at slot `length`
    n = cursor.length + 1
    kern[(B, Hq)](q, K, V, o, n, cursor.pad, q.stride(0), q.stride(1), K.stride(0), K.stride(1), K.stride(2),
                  o.stride(0), o.stride(1), D ** -0.5, G=Hq // Hkv, D=D, BLOCK=64)
    return o.view(B, Hq * D)


DECODE = {"sdpa": sdpa_decode, "flash_attn": flash_decode, "triton": triton_decode}


def prefill_attention(q, k, v, mask):
    """q [B, Hq, T, D], k/v [B, Hkv, T, D], mask [B, 1, T, T] additive -> [B, Hq, T, D] (sdpa)."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])
