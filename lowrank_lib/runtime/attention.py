"""Attention backend registry for the dense store's decode step.

Every backend implements ``decode(q, K, V, cursor, mask)``; it only attends (the store has already
written the current token's k/v at slot ``cursor.length``: one place appends, not every kernel):

    q      [B, Hkv, G, D]   the current token's post-RoPE queries (G = Hq / Hkv, GQA native)
    K, V                    this layer's cache views (eager: only the live slots; graphs: all Smax)
    cursor                  ``length`` [1] (this token's slot, not yet advanced) and ``pad`` [B] on device
    mask   [B, 1, 1, S]     additive mask over slots (sdpa only), or None
    ->     [B, Hq * D]

Backends: ``flash_attn`` (``flash_attn_with_kvcache`` over ``length + 1`` slots from device memory,
left padding via ``cache_leftpad``), ``triton`` (our graph-safe split-K decode kernels: chunks of slots in
parallel, then one combine; they read the length and pad counts from device memory and loop only over live slots), ``lrk_attend`` (our compiled AVX-512 or AVX2 CPU
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
_TRITON_KERNELS = None
#: slots per program of the Triton decode kernel's inner loop, and the most programs (splits) per query head
TRITON_BLOCK, TRITON_MAX_SPLITS = 64, 32


def _triton_kernels():
    """Build (once) the split-K Triton decode kernels; imported lazily so CPU never needs triton.

    Flash-decoding: one program per (row, query head, chunk of slots) writes its chunk's softmax partials
    (running max, sum, weighted values), a second kernel combines a head's chunks. One program per (row,
    head), walking every slot, left the H200 with 32 programs on 132 SMs at batch 1 (the step grew by
    2.8 us per slot of context, 2026-12-04). The chunking depends only on the buffer's slot count, never
    on the live length (read from device memory), so one capture serves every step."""
    global _TRITON_KERNELS
    if _TRITON_KERNELS is not None:
        return _TRITON_KERNELS
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_attn_part(Q, K, V, PO, PM, PL, LEN, PAD, sqb, sqh, skb, skh, sks, scale, CHUNK,
                          NS: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr):
        # program (row b, query head h, chunk sp): online softmax over live slots [pad, length) of the chunk
        b = tl.program_id(0)
        h = tl.program_id(1)
        sp = tl.program_id(2)
        kvh = h // G
        n = tl.load(LEN)
        start = tl.load(PAD + b)
        lo = sp * CHUNK
        hi = tl.minimum(lo + CHUNK, n)
        d = tl.arange(0, D)
        q = tl.load(Q + b * sqb + h * sqh + d).to(tl.float32) * scale
        m_i = tl.full((1,), -1e30, tl.float32)
        l_i = tl.zeros((1,), tl.float32)
        acc = tl.zeros((D,), tl.float32)
        base = b * skb + kvh * skh
        for s0 in range(lo, hi, BLOCK):
            offs = s0 + tl.arange(0, BLOCK)
            ok = (offs >= start) & (offs < hi)
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
        idx = (b * tl.num_programs(1) + h) * NS + sp
        tl.store(PO + idx * D + d, acc)
        one = tl.arange(0, 1)
        tl.store(PM + idx + one, m_i)
        tl.store(PL + idx + one, l_i)

    @triton.jit
    def _decode_attn_combine(PO, PM, PL, O, sob, soh, NS: tl.constexpr, NSP: tl.constexpr, D: tl.constexpr):
        # program (row b, query head h): the chunks' partials -> softmax-weighted output (empty chunks weigh 0)
        b = tl.program_id(0)
        h = tl.program_id(1)
        j = tl.arange(0, NSP)
        okj = j < NS
        p0 = (b * tl.num_programs(1) + h) * NS
        m = tl.load(PM + p0 + j, mask=okj, other=-1e30)
        l = tl.load(PL + p0 + j, mask=okj, other=0.0)
        w = tl.where(okj, tl.exp(m - tl.max(m, 0)), 0.0)
        d = tl.arange(0, D)
        acc = tl.load(PO + (p0 + j[:, None]) * D + d[None, :], mask=okj[:, None], other=0.0)
        out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
        tl.store(O + b * sob + h * soh + d, out.to(O.dtype.element_ty))

    _TRITON_KERNELS = _decode_attn_part, _decode_attn_combine
    return _TRITON_KERNELS


def triton_splits(S: int) -> tuple[int, int]:
    """(slots per chunk, chunks) of the split-K decode kernel over a buffer of S slots: chunks of whole
    64-slot blocks, at most :data:`TRITON_MAX_SPLITS` of them."""
    blocks = -(-S // TRITON_BLOCK)
    chunk = TRITON_BLOCK * -(-blocks // TRITON_MAX_SPLITS)
    return chunk, -(-S // chunk)


def _triton_launch(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, n: torch.Tensor, pad: torch.Tensor,
                   G: int) -> torch.Tensor:
    """q [B, Hq, D] contiguous, K/V [B, Hkv, S, D] (stride-1 last dim), n [1] slots written, pad [>=B]."""
    import triton

    B, Hq, D = q.shape
    chunk, ns = triton_splits(K.shape[2])
    o = torch.empty_like(q)
    po = torch.empty(B, Hq, ns, D, dtype=torch.float32, device=q.device)
    pm, pl = (torch.empty(B, Hq, ns, dtype=torch.float32, device=q.device) for _ in "ml")
    part, combine = _triton_kernels()
    part[(B, Hq, ns)](q, K, V, po, pm, pl, n, pad, q.stride(0), q.stride(1), K.stride(0), K.stride(1), K.stride(2),
                      D ** -0.5, chunk, NS=ns, G=G, D=D, BLOCK=TRITON_BLOCK)
    combine[(B, Hq)](po, pm, pl, o, o.stride(0), o.stride(1), NS=ns, NSP=triton.next_power_of_2(ns), D=D)
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
        head_dims=tuple(range(16, 129, 16)), in_fused_layer=True),
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
