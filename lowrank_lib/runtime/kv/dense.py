"""The dense KV store: static K/V buffers allocated once, the live length in device memory.

Layout: one buffer ``[2L, B, Hkv, Smax, D]`` ("bhsd": each head's history one contiguous [Smax, D]
block, what a decode dot-product reads; the sdpa and Triton kernels) or ``[2L, B, Smax, Hkv, D]``
("bshd", what ``flash_attn_with_kvcache`` reads); k of layer i is entry 2i, v is 2i + 1, so an eager
step slices the live prefix of ALL layers with two dispatches (slice + unbind) instead of two per layer.
GQA is native: only the Hkv key/value heads are stored. Memory = 2 L B Smax Hkv D elements, held from
allocation on (``nbytes``), whatever the request.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..attention import BACKENDS, select_backend
from ..kernels import ops as lrk_ops
from .base import BackendChoice, KVSpec, StepContext, slot_mask


@dataclass
class DenseStep(StepContext):
    """Decode context of the dense store: per-layer K/V views (eager: the live prefix; graphs: all slots)."""

    k: list[torch.Tensor] = field(default_factory=list)
    v: list[torch.Tensor] = field(default_factory=list)


class DenseKV:
    """Static dense K/V cache (the engine's default store)."""

    name = "dense"
    stores_latents = False
    capturable = True

    def __init__(self):
        self.backend: BackendChoice | None = None
        self.kv: torch.Tensor | None = None

    # ------------------------------------------------------------------ allocation
    def allocate(self, spec: KVSpec) -> None:
        self.spec, self.cursor = spec, spec.cursor
        self.backend = select_backend(spec.attention, spec.device, spec.head_dim, spec.dtype, spec.kernels)
        self.layout = self.backend.layout
        B, S, H, D = spec.max_batch, spec.max_seq_len, spec.n_kv_heads, spec.head_dim
        shape = (B, H, S, D) if self.layout == "bhsd" else (B, S, H, D)
        full = (2 * spec.n_layers, *shape)
        if self.backend.caps.native and torch.device(spec.device).type == "cpu":
            # our kernel streams this buffer every token: in the kernels' huge-page arena, as the weights are (the KV
            # read is ~1/4 of a SmolLM2 int4 token at 512 tokens; paired steps: 4-5 % faster than 4 KB pages)
            self.kv = lrk_ops.arena_zeros(full, spec.dtype)
        else:
            self.kv = torch.zeros(full, dtype=spec.dtype, device=spec.device)
        views = self.kv.unbind(0)
        self.k, self.v = list(views[0::2]), list(views[1::2])
        self._slots = torch.arange(S, device=spec.device)
        impl = BACKENDS[self.backend.name]
        self._decode = impl.fn
        # the form a torch.compile-d step traces instead (sdpa's broadcast-multiply-reduce), where the backend has one
        self._compiled_decode = impl.compiled_fn if spec.fused_compile else None
        self._needs_mask = self.backend.caps.needs_mask

    @property
    def nbytes(self) -> int:
        return 0 if self.kv is None else self.kv.numel() * self.kv.element_size()

    def shape_key(self):
        return ()          # buffers never change: one capture per batch size serves every request

    def report(self) -> dict:
        return {"store": self.name, "layout": self.layout, "buffer_bytes": self.nbytes}

    def fused_tiers_unavailable(self) -> str:
        return "one dense buffer, not a tiered layout (the fused layer reads the buffer itself: decode_layer)"

    # ------------------------------------------------------------------ prefill
    def reset(self, B: int, T: int, ids=None) -> None:
        pass

    def store_prefill(self, layer: int, q, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v [B, Hkv, T, D] post-RoPE -> slots [0, T)."""
        K, V = self.k[layer], self.v[layer]
        if k.shape[0] != self.spec.max_batch:
            K, V = K[:k.shape[0]], V[:k.shape[0]]
        self._write(K, V, k, v, self._slots[:k.shape[2]])

    def end_prefill(self) -> None:
        pass

    def _write(self, K: torch.Tensor, V: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """k, v [B, Hkv, T, D] into buffers (views) K, V at slots ``pos`` [T], in the store's layout."""
        if self.layout == "bhsd":
            K.index_copy_(2, pos, k)
            V.index_copy_(2, pos, v)
        else:
            K.index_copy_(1, pos, k.transpose(1, 2))
            V.index_copy_(1, pos, v.transpose(1, 2))

    # ------------------------------------------------------------------ decode
    def views(self, B: int, live: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V views for rows [0, B) and slots [0, live) (all Smax slots if None)."""
        if live is None and B == self.spec.max_batch:
            return self.k, self.v
        kv = self.kv[:, :B] if B != self.spec.max_batch else self.kv
        if live is not None:
            kv = kv[:, :, :, :live] if self.layout == "bhsd" else kv[:, :, :live]
        vs = kv.unbind(0)
        return list(vs[0::2]), list(vs[1::2])

    def step_context(self, B: int, live: int | None, rope: torch.Tensor) -> DenseStep:
        Ks, Vs = self.views(B, live)
        # a backend that reads the cursor's length and pad counts from device memory needs no mask
        mask = slot_mask(self.cursor, self._slots, B, live, self.spec.dtype) if self._needs_mask else None
        return DenseStep(B, 1, False, rope, mask, self.cursor.length, live, Ks, Vs)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: DenseStep) -> None:
        """The current token's k/v [B, Hkv, 1, D] -> slot ``cursor.length`` (into the step's views)."""
        self._write(ctx.k[layer], ctx.v[layer], k, v, ctx.pos)

    def attend(self, layer: int, q: torch.Tensor, ctx: DenseStep) -> torch.Tensor:
        """q [B, Hkv, G, D] over this layer's slots -> [B, Hq * D] (the backend's kernel)."""
        attn = self._compiled_decode if self._compiled_decode and torch.compiler.is_compiling() else self._decode
        return attn(q, ctx.k[layer], ctx.v[layer], self.cursor, ctx.mask)
