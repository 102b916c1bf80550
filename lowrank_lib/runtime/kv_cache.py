"""Static dense KV cache, allocated once, with the live length in device memory.

Layout per layer: ``[B, Hkv, Smax, D]`` ("bhsd") for the sdpa and Triton backends (each head's
history is one contiguous [Smax, D] block, what a decode dot-product reads) or ``[B, Smax, Hkv, D]``
("bshd") for ``flash_attn_with_kvcache``, which wants that layout. GQA is native: only the Hkv
key/value heads are stored.

Batches are left padded: slot ``s`` of row ``b`` holds a real token iff ``pad[b] <= s < length``;
its RoPE position is ``s - pad[b]``. ``length`` (int64 [1]) and ``pad`` (int64 [B]) live on the
device and are updated in place, so a captured graph reads the live values on replay.
"""
from __future__ import annotations

import torch


class CacheFullError(RuntimeError):
    """A request needs more slots than the static cache holds (the engine never truncates)."""


class StaticKVCache:
    """Dense per-layer K/V buffers + device-side length and pad tensors.

    Parameters
    ----------
    n_layers, batch, max_len, kv_heads, head_dim : sizes; memory = 2 * L * B * Smax * Hkv * D.
    layout : ``"bhsd"`` or ``"bshd"``.
    latent_dims : for ``kv="rebuild"``: per layer ``(r_k, r_v)``; the cache then stores the
        rank-space latents [B, Smax, r] instead of dense K/V.
    """

    def __init__(self, n_layers: int, batch: int, max_len: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, layout: str = "bhsd",
                 latent_dims: list[tuple[int, int]] | None = None):
        if layout not in ("bhsd", "bshd"):
            raise ValueError(f"layout {layout!r}: use 'bhsd' or 'bshd'")
        self.layout, self.batch, self.max_len = layout, batch, max_len
        self.kv_heads, self.head_dim = kv_heads, head_dim
        self.rebuild = latent_dims is not None
        if self.rebuild:
            self.k = [torch.zeros(batch, max_len, rk, dtype=dtype, device=device) for rk, _ in latent_dims]
            self.v = [torch.zeros(batch, max_len, rv, dtype=dtype, device=device) for _, rv in latent_dims]
        else:
            shape = (batch, kv_heads, max_len, head_dim) if layout == "bhsd" else (batch, max_len, kv_heads, head_dim)
            # one buffer [2L, ...]: k of layer i is kv[2i], v is kv[2i+1]; an eager step slices the live
            # prefix of ALL layers with two dispatches (slice + unbind) instead of two per layer.
            self.kv = torch.zeros((2 * n_layers, *shape), dtype=dtype, device=device)
            views = self.kv.unbind(0)
            self.k, self.v = list(views[0::2]), list(views[1::2])
        self.length = torch.zeros(1, dtype=torch.long, device=device)
        self.pad = torch.zeros(batch, dtype=torch.long, device=device)
        self.any_pad = False
        self.host_len = 0  # mirror of ``length`` for eager slicing (never read inside a graph)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def reset(self, pad: torch.Tensor) -> None:
        """Start a new request; ``pad`` [b] left-pad counts (b <= max batch)."""
        if pad.shape[0] > self.batch:
            raise CacheFullError(f"batch {pad.shape[0]} exceeds the cache's max_batch {self.batch}")
        self.pad.zero_()
        self.pad[: pad.shape[0]].copy_(pad)
        self.length.zero_()
        self.host_len = 0
        self.any_pad = bool((pad > 0).any())   # host flag (one sync per request, never in a step)

    def check_room(self, needed: int) -> None:
        if needed > self.max_len:
            raise CacheFullError(
                f"request needs {needed} cache slots (prompt + new tokens) but the static cache holds "
                f"max_seq_len={self.max_len}; build the Engine with a larger EngineConfig.max_seq_len")

    def views(self, B: int, live: int | None) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Per-layer K and V views for rows [0, B) and slots [0, live) (all Smax slots if None)."""
        if self.rebuild or (live is None and B == self.batch):
            return self.k, self.v
        kv = self.kv[:, :B] if B != self.batch else self.kv
        if live is not None:
            kv = kv[:, :, :, :live] if self.layout == "bhsd" else kv[:, :, :live]
        vs = kv.unbind(0)
        return list(vs[0::2]), list(vs[1::2])

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        """Write new entries at slots ``pos`` [T] (device tensor).

        k, v : [B, Hkv, T, D] (dense) or [B, T, r] (rebuild latents).
        """
        B = k.shape[0]
        K, V = self.k[layer], self.v[layer]
        if B != self.batch:
            K, V = K[:B], V[:B]
        if self.rebuild:
            K.index_copy_(1, pos, k)
            V.index_copy_(1, pos, v)
        elif self.layout == "bhsd":
            K.index_copy_(2, pos, k)
            V.index_copy_(2, pos, v)
        else:
            K.index_copy_(1, pos, k.transpose(1, 2))
            V.index_copy_(1, pos, v.transpose(1, 2))
