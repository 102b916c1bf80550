"""The rebuild store ("naive", ``EngineConfig(kv="rebuild")``): the paper's slow low-rank decode.

The k/v history is kept as rank-space latents (the stage-1 outputs h_k = V_k x, h_v = V_v x,
[B, Smax, r] per layer) and the dense K/V of the WHOLE history is rebuilt every step (U h, then RoPE at
every position), then attended with sdpa: work grows with the history, so it runs eagerly only.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..attention import BACKENDS
from ..rope import rotate_half
from .base import BackendChoice, KVSpec, StepContext, slot_mask


class RebuildKV:
    """Latent history + per-step rebuild (the baseline every dense-KV mechanism is measured against)."""

    name = "rebuild"
    stores_latents = True
    capturable = False

    def __init__(self):
        self.backend = BackendChoice("sdpa", "kv='rebuild' rebuilds K/V in torch and attends with sdpa",
                                     BACKENDS["sdpa"].caps)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def allocate(self, spec: KVSpec) -> None:
        if spec.latent_dims is None or spec.expand is None or spec.rope_table is None:
            raise ValueError("RebuildKV needs the engine's latent widths, expand() and RoPE table in its KVSpec")
        self.spec, self.cursor = spec, spec.cursor
        B, S = spec.max_batch, spec.max_seq_len
        z = lambda r: torch.zeros(B, S, r, dtype=spec.dtype, device=spec.device)
        self.k = [z(rk) for rk, _ in spec.latent_dims]
        self.v = [z(rv) for _, rv in spec.latent_dims]
        self._slots = torch.arange(S, device=spec.device)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def shape_key(self):
        return ()

    def report(self) -> dict:
        return {"store": self.name, "buffer_bytes": self.nbytes,
                "latent_dims": [list(d) for d in self.spec.latent_dims]}

    def fused_tiers_unavailable(self) -> str:
        return "it rebuilds K / V from latents every step"

    def reset(self, B: int, T: int, ids=None) -> None:
        pass

    def store_prefill(self, layer: int, q, hk: torch.Tensor, hv: torch.Tensor) -> None:
        """Latents hk [B, T, r_k], hv [B, T, r_v] -> slots [0, T)."""
        self._write(layer, hk, hv, self._slots[:hk.shape[1]])

    def end_prefill(self) -> None:
        pass

    def step_context(self, B: int, live: int | None, rope: torch.Tensor) -> StepContext:
        if live is None:
            raise RuntimeError("the rebuild store runs eagerly only (its work grows with the history)")
        return StepContext(B, 1, False, rope, slot_mask(self.cursor, self._slots, B, live, self.spec.dtype),
                           self.cursor.length, live)

    def append(self, layer: int, hk: torch.Tensor, hv: torch.Tensor, ctx: StepContext) -> None:
        """The current token's latents [B, 1, r] -> slot ``cursor.length``."""
        self._write(layer, hk, hv, ctx.pos)

    def _write(self, layer: int, hk: torch.Tensor, hv: torch.Tensor, pos: torch.Tensor) -> None:
        K, V = self.k[layer], self.v[layer]
        if hk.shape[0] != self.spec.max_batch:
            K, V = K[:hk.shape[0]], V[:hk.shape[0]]
        K.index_copy_(1, pos, hk)
        V.index_copy_(1, pos, hv)

    def attend(self, layer: int, q: torch.Tensor, ctx: StepContext) -> torch.Tensor:
        """Rebuild K, V [B, n, Hkv, D] of the n live slots (U h, RoPE per position), then sdpa."""
        spec, B, n = self.spec, q.shape[0], ctx.live
        Hkv, D = spec.n_kv_heads, spec.head_dim
        K = spec.expand(layer, 1, self.k[layer][:B, :n])               # [B, n, Hkv*D]  (rebuilt)
        V = spec.expand(layer, 2, self.v[layer][:B, :n])
        posn = (self._slots[:n][None, :] - self.cursor.pad[:B, None]).clamp_min(0)
        csn = spec.rope_table[posn]                                     # [B, n, 2, D]
        K = K.view(B, n, Hkv, D)
        K = K * csn[:, :, :1] + rotate_half(K) * csn[:, :, 1:]
        o = F.scaled_dot_product_attention(q, K.transpose(1, 2), V.view(B, n, Hkv, D).transpose(1, 2),
                                           attn_mask=ctx.mask)
        return o.reshape(B, spec.n_heads * D)
