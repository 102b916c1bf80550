"""The seam between the decode engine and its KV storage: the ``KVStore`` protocol, its step context,
the one position counter.

The engine owns the model math (projections, RoPE, MLP, sampling loop) and ONE :class:`Cursor`; a store
owns what is kept of past tokens and how the current token attends to it. Per request::

    store.reset(B, T, ids)                     # new request [B, T] (the cursor was reset by the engine)
    store.store_prefill(i, q, k, v)            # every layer i, the prompt's post-RoPE q/k/v (exact)
    store.end_prefill()                        # e.g. compress, fill static buffers (shape_key may change)
    per decode step:
        ctx = store.step_context(B, live, rope)   # once per step: masks, views, lengths (typed)
        store.append(i, k, v, ctx)                # THE one place the current token's K/V are written
        out = store.attend(i, q, ctx)             # this layer's attention output
    engine: cursor.advance()                   # THE one place the position moves

Shapes (Hq = G * Hkv query heads, D head dim): prefill ``q [B, Hq, T, D]``, ``k/v [B, Hkv, T, D]``; decode
``q [B, Hkv, G, D]``, ``k/v [B, Hkv, 1, D]``, ``attend -> [B, Hq * D]``. A store that keeps rank-space
latents instead of K/V (``stores_latents``: the rebuild route) receives ``[B, T, r]`` latents instead of
k/v and rebuilds keys with :attr:`KVSpec.expand`. Under graphs (``live is None``) every read covers the
store's whole static buffers with validity from device-side lengths, so a capture made for one
``(B, shape_key())`` replays for every later step and request with the same key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Protocol, runtime_checkable

import torch

from ..backend import BackendChoice

NEG_INF = float("-inf")


class CacheFullError(RuntimeError):
    """A request needs more slots than the engine holds (the engine never truncates)."""


class Cursor:
    """The ONE position counter of a request, in device memory for captured graphs.

    ``length`` [1] int64: slots written = the slot of the next token; ``pad`` [max_batch] int64: left-pad
    slots per row (slot ``s`` of row ``b`` is a real token iff ``pad[b] <= s < length``; its RoPE
    position is ``s - pad[b]``); ``host``: the host mirror of ``length`` (eager slicing only, never read
    inside a graph); ``any_pad``: whether this request has padding (one host sync per request).
    Only :meth:`advance` moves the position; :meth:`reset` starts a request.
    """

    def __init__(self, max_batch: int, capacity: int, device):
        self.max_batch, self.capacity = max_batch, capacity
        self.length = torch.zeros(1, dtype=torch.long, device=device)
        self.pad = torch.zeros(max_batch, dtype=torch.long, device=device)
        self.host = 0
        self.any_pad = False

    def reset(self, pad: torch.Tensor) -> None:
        """Start a request; ``pad`` [b] left-pad counts (b <= max_batch)."""
        if pad.shape[0] > self.max_batch:
            raise CacheFullError(f"batch {pad.shape[0]} exceeds EngineConfig.max_batch={self.max_batch}")
        self.pad.zero_()
        self.pad[: pad.shape[0]].copy_(pad)
        self.length.zero_()
        self.host = 0
        self.any_pad = bool((pad > 0).any())

    def advance(self, n: int = 1) -> None:
        """Move the position by ``n`` tokens (after a prefill of n, after every decode step)."""
        self.length.add_(n)
        self.host += n

    def check_room(self, needed: int) -> None:
        if needed > self.capacity:
            raise CacheFullError(
                f"request needs {needed} cache slots (prompt + new tokens) but the engine holds "
                f"max_seq_len={self.capacity}; build the Engine with a larger EngineConfig.max_seq_len")


@dataclass
class KVSpec:
    """What the engine tells a store at allocation: geometry, limits, dtype/device, the cursor."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    max_batch: int
    max_seq_len: int
    dtype: torch.dtype
    device: torch.device
    cursor: Cursor
    graphs: bool = False                 # decode runs captured / compiled: static shapes, device lengths
    attention: str = "auto"              # the requested attention backend (EngineConfig.attention)
    fused_compile: bool = True           # EngineConfig.fused_compile
    kernels: str = "auto"                # EngineConfig.kernels (whether our compiled CPU kernels may run)
    latent_dims: list[tuple[int, int]] | None = None   # per layer (r_k, r_v): k/v stage-1 widths
    expand: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None
    # ^ (layer, 1 = k | 2 = v, latents [..., r]) -> [..., Hkv * D]: the U factor of that projection
    rope_table: torch.Tensor | None = None   # [max_seq_len, 2, D] (cos, sin) per position
    rope_at: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]] | None = None
    # ^ positions [n] -> (cos, sin) [n, D] fp32 at ANY position (the model's rotary module, its scaling included)
    probe: Callable[[torch.Tensor, list], list] | None = None
    # ^ (ids [b, n], past [(k, v) [b, Hkv, P, D] per layer]) -> per layer (q [b, Hq, n, D], k [b, Hkv, n, D]):
    #   a forward of ``ids`` after ``past`` (positions P ..), nothing stored (Engine.probe; model-scope scorers)


@dataclass
class StepContext:
    """What every layer reads in one forward, built once per prefill / decode step.

    B, T : batch rows and rows per sequence (T = prompt length at prefill, 1 in decode).
    rope : [B*T, 2, 1, 1, D] (cos, sin) of each row's position.
    mask : prefill [B, 1, T, T] additive causal + pad mask; decode: the store's additive mask over the
        slots it reads, [B, 1, 1, S], or None.
    pos : prefill [T] slots; decode [1] the slot written (= cursor.length, a device tensor).
    live : decode, eager: slots read including this token; None under graphs (all slots).
    Stores extend it with what their ``attend`` reads (views, lengths).
    """

    B: int
    T: int
    prefill: bool
    rope: torch.Tensor
    mask: torch.Tensor | None
    pos: torch.Tensor
    live: int | None = None


@runtime_checkable
class KVStore(Protocol):
    """Storage of past tokens for :class:`lowrank_lib.runtime.Engine` (see the module docstring)."""

    name: str               # reported as Engine.report()["kv"]
    stores_latents: bool    # True: receives rank-space latents [B, T, r] instead of post-RoPE k/v
    capturable: bool        # decode may run under graph capture / torch.compile
    backend: BackendChoice  # set by allocate()

    def allocate(self, spec: KVSpec) -> None: ...

    def reset(self, B: int, T: int, ids: torch.Tensor | None = None) -> None: ...

    def store_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None: ...

    def end_prefill(self) -> None: ...

    def step_context(self, B: int, live: int | None, rope: torch.Tensor) -> StepContext: ...

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: StepContext) -> None: ...

    def attend(self, layer: int, q: torch.Tensor, ctx: StepContext) -> torch.Tensor: ...

    @property
    def nbytes(self) -> int: ...

    def shape_key(self) -> Hashable: ...

    def report(self) -> dict: ...

    def fused_tiers_unavailable(self) -> str | None: ...
    # ^ why the engine's fused decode layer cannot read this store as a tiered layout (None: it can, and the store
    #   offers ``fused_tier_args`` / ``fused_tier_layout`` / ``fused_appended``, as ``kv.MethodStore`` does); the
    #   dense store is read by the op as its own buffer instead (``runtime/kernels/layer.py``)


def additive_mask(ok: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """bool "may attend" -> additive mask (0 / -inf) in ``dtype``, same shape."""
    return torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, NEG_INF)


def slot_mask(cursor: Cursor, slots: torch.Tensor, B: int, live: int | None, dtype: torch.dtype):
    """The decode mask over slots [0, S) of a store that keeps one row per position (dense, rebuild).

    Graphs (``live`` None): real slots ``pad <= s <= length`` of all S; eager: only left-pad slots of the
    ``live`` prefix are masked (None without padding). -> [B, 1, 1, S | live] additive, or None.
    """
    if live is None:
        ok = (slots[None, :] >= cursor.pad[:B, None]) & (slots[None, :] <= cursor.length)
    elif cursor.any_pad:
        ok = slots[None, :live] >= cursor.pad[:B, None]
    else:
        return None
    return additive_mask(ok, dtype).view(B, 1, 1, -1)
