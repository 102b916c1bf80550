"""Python entry points of the compiled ops (``torch.ops.lowrank_lrk``); see ``lrk.cpp`` and ``tiers.cpp`` for the
layouts.

Call :func:`lowrank_lib.runtime.kernels.build.load` first (the registry does). Each function is a
plain call of the op, so ``torch.compile`` traces it as one extern kernel call.
"""
from __future__ import annotations

import torch

from .build import NAMESPACE


def _ops():
    return getattr(torch.ops, NAMESPACE)


def pack(W: torch.Tensor) -> torch.Tensor:
    """W [out, in] (fp32 / bf16 / int8) -> the packed 1-D layout of ``lrk.cpp``."""
    return _ops().pack(W)


def unpack(P: torch.Tensor, out: int, inp: int) -> torch.Tensor:
    """The inverse of :func:`pack`: W [out, in] (a new tensor)."""
    return _ops().unpack(P, out, inp)


def gemv(x: torch.Tensor, Ps: list[torch.Tensor], outs: list[int], ins: list[int], xoffs: list[int]) -> torch.Tensor:
    """y [N, sum outs]: matrix m reads columns [xoffs[m], xoffs[m] + ins[m]) of x [N, X]."""
    return _ops().gemv(x, Ps, outs, ins, xoffs)


def attend(q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, length: torch.Tensor, pad: torch.Tensor,
           scale: float) -> torch.Tensor:
    """Decode attention: q [B, Hkv, G, D] over slots pad[b] <= s <= length of K/V [>=B, Hkv, S, D]."""
    return _ops().attend(q, K, V, length, pad, scale)


def tier_attend(q: torch.Tensor, k_exact: torch.Tensor, v_exact: torch.Tensor, e_off: torch.Tensor,
                runs: torch.Tensor, r_off: torch.Tensor, a_k: torch.Tensor, a_v: torch.Tensor, b_k: torch.Tensor,
                b_v: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                k_new: torch.Tensor | None, v_new: torch.Tensor | None, n_new: torch.Tensor,
                scale: float) -> torch.Tensor:
    """Fused decode attention over one tiered KV layer (``tiers.cpp``; the layout of ``kv/tiers.py``):
    q [B, H, G, d] over each segment's exact rows, low-rank runs (factor space) and the first ``n_new`` [1]
    appended rows of k_new / v_new [B, H, cap, d], one fp32 softmax per query head -> [B, H * G * d]. (Calls the
    overload directly: the packet's overload resolution costs a few microseconds per layer in an eager step.)"""
    return _ops().tier_attend.default(q, k_exact, v_exact, e_off, runs, r_off, a_k, a_v, b_k, b_v, k_scale, v_scale,
                              k_new, v_new, n_new, scale)


def tier_prefetch() -> bool:
    """Whether :func:`tier_attend`'s exact-row loops prefetch in software in this process (``$LOWRANK_LIB_TIER_PF``,
    else off on AMD CPUs with AVX-512, on elsewhere; the same bits either way)."""
    return bool(_ops().tier_prefetch())


def tier_chunk(n: int = 0) -> int:
    """:func:`tier_attend`'s tokens per online-softmax update before the call; ``n`` > 0 sets it for the process (a
    multiple of 16, at most the built maximum, 4096 and the default: long chunks measured fastest), 0 only reads it.
    The AVX2 code takes fewer where a chunk's K and V rows would pass 256 KB (1024 rows at d 64 in bf16: its V rows,
    prefetched into L2 while the keys are scored, must still be there for the values). The result changes by fp32
    rounding only (the tests cut tiers into many chunks with it)."""
    return int(_ops().tier_chunk(n))


def weight_prefetch() -> str:
    """How the GEMVs (``gemv``, ``qgemv``, the fused layer's) prefetch their weight stream in this process:
    ``"nta"`` (the default: each weight is read once a step, and the non-temporal hint measured 4-9 % faster per
    token on AMD Zen 4), ``"t0"`` (``$LOWRANK_LIB_PF_NTA=0`` at load) or ``"none"`` (built with ``-DLRK_PREFETCH=0``); the same bits
    either way."""
    return str(_ops().weight_prefetch())


def certified_head(x: torch.Tensor, Q: torch.Tensor, meta: torch.Tensor, P: torch.Tensor, V: int, max_fraction: float,
                   stats: torch.Tensor) -> torch.Tensor:
    """logits [N, V] of the certified LM head (``runtime/lm_head.py``); ``stats`` int64 [5] is updated in place."""
    return _ops().certified_head(x, Q, meta, P, V, max_fraction, stats)


def layer_plan(ln1: torch.Tensor | None, ln2: torch.Tensor | None, w: list[torch.Tensor], meta: list[int], hidden: int,
               head_dim: int, bf16: bool, eps: float, n_heads: int, n_kv: int, folded: bool, final_norm: bool = False,
               final_w: torch.Tensor | None = None) -> int:
    """One decode layer's weights (``w`` / ``meta`` from ``layer.py``, the norms, the geometry) parsed and checked once
    by ``layer.cpp``, which keeps references to the tensors: the plan's id, for :func:`decode_layer` /
    :func:`decode_layer_tiers`, until :func:`drop_layer_plan`. ``final_norm``: the layer's output is the model's final
    RMSNorm of it (times ``final_w`` if given; the last layer's plan)."""
    return int(_ops().layer_plan(ln1, ln2, w, meta, hidden, head_dim, bf16, eps, n_heads, n_kv, folded, final_norm,
                                 final_w))


def drop_layer_plan(plan: int) -> bool:
    """Forget a layer plan (its tensors are released); whether it was live. Its id is never given out again."""
    return bool(_ops().drop_layer_plan(plan))


def decode_layer(x: torch.Tensor, plan: int, rope: torch.Tensor, kv: torch.Tensor, layer: int, length: torch.Tensor,
                 pad: torch.Tensor) -> torch.Tensor:
    """One decode layer of the dense-KV engine in one call (``layer.cpp``; ``plan`` from :func:`layer_plan`): x [B, H]
    -> x after attention and MLP; writes the token's K/V at slot ``length`` of layer ``layer`` of ``kv`` in place."""
    return _ops().decode_layer.default(x, plan, rope, kv, layer, length, pad)


def decode_stack(x: torch.Tensor, plans: list[int], rope: torch.Tensor, kv: torch.Tensor, length: torch.Tensor,
                 pad: torch.Tensor) -> torch.Tensor:
    """:func:`decode_layer` of ``plans[i]`` over layer ``i`` of ``kv``, every layer in order, in one call: x [B, H] ->
    the last layer's output (the step's per-layer Python and dispatcher round trip paid once)."""
    return _ops().decode_stack.default(x, plans, rope, kv, length, pad)


def decode_layer_tiers(x: torch.Tensor, plan: int, rope: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor,
                       k_exact: torch.Tensor, v_exact: torch.Tensor, e_off: torch.Tensor, runs: torch.Tensor,
                       r_off: torch.Tensor, a_k: torch.Tensor, a_v: torch.Tensor, b_k: torch.Tensor, b_v: torch.Tensor,
                       k_scale: torch.Tensor | None, v_scale: torch.Tensor | None, t0: torch.Tensor,
                       length: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """:func:`decode_layer` over a tiered KV layer (``kv/tiers.py``'s layout): the token's k / v are written at
    appended row ``length - t0`` of k_new / v_new [B, Hkv, cap, D] in place, and the attention is :func:`tier_attend`
    over the fitted tiers and the appended rows up to that one."""
    return _ops().decode_layer_tiers.default(x, plan, rope, k_new, v_new, k_exact, v_exact, e_off, runs, r_off, a_k,
                                             a_v, b_k, b_v, k_scale, v_scale, t0, length, pad)


def tier_layout(tiers: tuple[list, ...], n_kv: int) -> int:
    """A tiered store's layers validated once (every check :func:`tier_attend` makes of a layout), held by the library
    until :func:`drop_tier_layout`: ``tiers`` the 13 per-layer lists k_new, v_new, k_exact, v_exact, e_off, runs,
    r_off, a_k, a_v, b_k, b_v, k_scale, v_scale (entry i: layer i's, what :func:`decode_layer_tiers` takes; scales None
    for float factors). -> its id."""
    return int(_ops().tier_layout(*tiers, n_kv))


def drop_tier_layout(layout: int) -> bool:
    """Releases a :func:`tier_layout` (its tensors); False if it was not held."""
    return bool(_ops().drop_tier_layout(layout))


def decode_stack_tiers(x: torch.Tensor, plans: list[int], rope: torch.Tensor, layout: torch.Tensor, t0: torch.Tensor,
                       length: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """:func:`decode_layer_tiers` of ``plans[i]`` over tiered layer ``i`` of the :func:`tier_layout` whose id
    ``layout`` ([1] int64, read at run time) holds, every layer in order, in one call (on a team of the kernel pool's
    threads, as :func:`decode_stack`): writes each layer's appended row ``length - t0`` in place. Every plan is checked
    against the layout before the first layer runs; per step only the appended row is checked."""
    return _ops().decode_stack_tiers.default(x, plans, rope, layout, t0, length, pad)


def arena_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero tensor of ``shape`` in the weight arena (``arena.cpp``: 2 MB transparent huge pages; torch's allocator
    when the arena is off): for a buffer a kernel streams every token, as the dense KV store's."""
    n = 1
    for s in shape:
        n *= int(s)
    return _ops().arena_zeros(n, dtype).view(shape)


def layer_profile(on: bool) -> list[int]:
    """decode_layer's phase timers: [calls, ns per phase (``layer.PHASES``)] since the previous call (then reset),
    and the timers turned on or off."""
    return list(_ops().layer_profile(on))


def qpack(data: torch.Tensor, scale: torch.Tensor, bits: int, group: int, out: int, inp: int) -> torch.Tensor:
    """A quantized [out, inp] matrix in the canonical storage of ``lowrank_lib.quant`` (``data``: int8 [out, in_pad],
    or uint8 [out, in_pad / 2] nibbles for 4 bits; ``scale``: fp16 [out, in_pad / group]) -> the packed uint8 blob of
    ``qgemv.cpp`` (codes and scales of each 64-output block in the order the kernel streams them)."""
    return _ops().qpack(data, scale, bits, group, out, inp)


def qunpack(P: torch.Tensor, bits: int, group: int, out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact inverse of :func:`qpack`: (data, scale) in the canonical storage (new tensors)."""
    return _ops().qunpack(P, bits, group, out, inp)


def qgemv(x: torch.Tensor, Ps: list[torch.Tensor], outs: list[int], ins: list[int], xoffs: list[int], bits: int,
          group: int) -> torch.Tensor:
    """y [N, sum outs] in x's dtype (fp32 / bf16, N <= 8): matrix m (a :func:`qpack` blob) reads columns
    [xoffs[m], xoffs[m] + ins[m]) of x [N, X]; the spec's product (``quant.qmatmul`` without bias), bit for bit."""
    return _ops().qgemv(x, Ps, outs, ins, xoffs, bits, group)


def qgemv_isa() -> str:
    """Which code :func:`qgemv` runs now: ``"avx512_vnni"`` (vpdpwssd), ``"avx512bw"`` (vpmaddwd), ``"avx2"``, or
    ``"none"`` (it refuses: the portable path runs). Follows ``build.limit_isa`` / ``$LOWRANK_LIB_ISA``."""
    return _ops().qgemv_isa()
