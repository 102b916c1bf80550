"""The AttSVD factor store: the runtime engine's KV store for AttSVD, read in factor space.

    >>> eng = Engine(model, EngineConfig(max_seq_len=2100), kv=AttSVDStore(AttSVDConfig(ratio=0.5)))

It implements :class:`lowrank_lib.runtime.kv.KVStore` (the runtime never imports this package):

- prefill: the engine's exact dense prefill (exact logits); each layer's post-RoPE q/k/v arrive through
  ``store_prefill`` and are compressed at once by :func:`~lowrank_lib.attsvd.basis.compress_prefill`
  (Algorithm 2, attention-aware, GQA-aware, the same call the transformers cache makes); no dense K/V
  of the prompt is ever held for more than one layer;
- decode: static, preallocated buffers per layer: A_K, A_V [B, Hkv, S_pad, r], B_K, B_V [B, Hkv, r, d]
  and the exact window [B, Hkv, W_cap, d]; the current token's k/v are written in place at a
  device-side slot (``append``), scores / output come from
  :func:`~lowrank_lib.attsvd.factor_space.attend_factors`, one softmax over bulk and window with a mask
  built on the device from the cursor's length and the left-pad counts.

Bucketing policy (graph capture): the bulk length S_b is padded up to a multiple of ``bucket``
(S_pad; padded rows are masked) and the window buffer holds W_cap = max_seq_len - S_pad + bucket
slots, so every prompt whose bulk falls in the same bucket has identical buffer shapes: a captured
decode step (CUDA graph, or ``torch.compile`` on CPU) is reused within a bucket; a new bucket gives a new
``shape_key()`` and the engine's graph runner captures again. Without graphs the buffers have the exact
sizes (S_pad = S_b, W_cap = max_seq_len - S_b) and decode slices the live rows. S_b itself is a
device tensor, so nothing host-side is baked into a graph. Only the accumulate mode is supported
(stream mode appends frozen blocks: a static version needs a block pool; not implemented).

Bytes: ``nbytes`` = what the static buffers hold; ``report()`` adds the AttSVD accounting of the
compressed prompt (``LowRankKV.nbytes`` per layer: the numbers ``AttSVDCache.memory()`` gives).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runtime.kv import BackendChoice, KVSpec, StepContext, additive_mask
from .basis import compress_prefill
from .config import AttSVDConfig
from .factor_space import attend_factors
from .kv import LowRankKV


@dataclass
class FactorStep(StepContext):
    """Decode context of the AttSVD store: live bulk / window rows and this token's window slot."""

    n_bulk: int = 0                     # bulk rows read (eager: S_b; graphs: S_pad, masked past S_b)
    n_win: int = 0                      # window rows read (eager: live - S_b; graphs: W_cap)
    slot: torch.Tensor | None = None    # [1] window slot of this token = cursor.length - S_b (device)


class AttSVDStore:
    """AttSVD factor-space KV store for the runtime ``Engine`` (see the module docstring).

    Parameters
    ----------
    config : ``AttSVDConfig`` (rank rule, window w, attention-aware); mode "accumulate".
    bucket : bulk-length bucket of the graph policy.
    """

    name = "attsvd-factor"
    stores_latents = False
    capturable = True

    def __init__(self, config: AttSVDConfig | None = None, bucket: int = 256):
        self.config = config or AttSVDConfig(ratio=0.5)
        if self.config.mode != "accumulate":
            raise NotImplementedError("AttSVDStore supports AttSVD mode 'accumulate' (stream mode needs a static "
                                      "block pool); use the transformers path (attsvd.factor_cache) for stream mode")
        if bucket < 1:
            raise ValueError(f"bucket must be >= 1, got {bucket}")
        self.bucket = bucket
        self.backend = BackendChoice("factor_space", "AttSVD store: bulk read from its factors + exact window, "
                                     "one softmax (attsvd.factor_space)")
        self._key = None                  # (B, S_pad, W_cap, ranks): the shape key of captured graphs
        self._bufs: list[dict[str, torch.Tensor]] = []
        self._runs: list[list[tuple]] = []
        self._accounting: dict = {}

    # ------------------------------------------------------------------ allocation
    def allocate(self, spec: KVSpec) -> None:
        self.spec, self.cursor = spec, spec.cursor
        self._sb = torch.zeros(1, dtype=torch.long, device=spec.device)   # bulk length S_b (device)
        self._sb_host = 0
        self._slots = torch.arange(spec.max_seq_len, device=spec.device)

    def _alloc(self, B: int, s_pad: int, w_cap: int, rk: int, rv: int) -> dict[str, torch.Tensor]:
        z = lambda *shape: torch.zeros(*shape, dtype=self.spec.dtype, device=self.spec.device)
        H, D = self.spec.n_kv_heads, self.spec.head_dim
        return {"a_k": z(B, H, s_pad, rk), "b_k": z(B, H, rk, D), "a_v": z(B, H, s_pad, rv), "b_v": z(B, H, rv, D),
                "k_win": z(B, H, w_cap, D), "v_win": z(B, H, w_cap, D)}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for b in self._bufs for t in b.values())

    def shape_key(self):
        return self._key

    def report(self) -> dict:
        """The AttSVD accounting of the compressed prompt + the bytes the decode buffers hold."""
        return {"store": self.name, **self._accounting, "buffer_bytes": self.nbytes, "bucket": self.bucket,
                "attsvd": self.config.to_dict()}

    # ------------------------------------------------------------------ prefill
    def reset(self, B: int, T: int) -> None:
        c = self.cursor
        self._B, self._T = B, T
        self._valid = (self._slots[None, :T] >= c.pad[:B, None]) if c.any_pad else None    # [B, T]
        self._layers: list[LowRankKV] = []

    def store_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q [B, Hq, T, D], k/v [B, Hkv, T, D] post-RoPE -> one LowRankKV (the prompt bulk + exact window)."""
        self._layers.append(compress_prefill(k, v, q, self.config, self._valid, self.spec.head_dim ** -0.5))

    def end_prefill(self) -> None:
        """Copy every layer's LowRankKV into the static buffers (new buffers only for new shapes)."""
        spec, B, T = self.spec, self._B, self._T
        if len(self._layers) != spec.n_layers:
            raise RuntimeError(f"AttSVDStore: expected {spec.n_layers} layers in prefill, got {len(self._layers)}")
        s_b = max(0, T - self.config.window)
        if not spec.graphs:                   # eager: exact sizes, nothing padded
            s_pad, w_cap = s_b, spec.max_seq_len - s_b
        else:                                 # graphs: one buffer shape per bulk bucket
            s_pad = max(self.bucket, math.ceil(s_b / self.bucket) * self.bucket)
            w_cap = spec.max_seq_len - s_pad + self.bucket
        ranks = [(kv.rank_k, kv.rank_v) if s_b else (1, 1) for kv in self._layers]
        key = (B, s_pad, w_cap, tuple(ranks))
        if key != self._key:                  # new shapes: new buffers (graph captures are keyed by this)
            self._bufs = [self._alloc(B, s_pad, w_cap, rk, rv) for rk, rv in ranks]
            self._runs = [[(b["a_k"], b["b_k"], b["a_v"], b["b_v"])] if s_pad else [] for b in self._bufs]
            self._key = key
        for kv, buf in zip(self._layers, self._bufs):   # same shapes: overwrite in place (captured addresses)
            for t in buf.values():
                t.zero_()
            if s_b:
                a_k, b_k, a_v, b_v = kv.runs[0]
                buf["a_k"][:, :, :s_b].copy_(a_k)
                buf["b_k"].copy_(b_k)
                buf["a_v"][:, :, :s_b].copy_(a_v)
                buf["b_v"].copy_(b_v)
            buf["k_win"][:, :, :kv.window].copy_(kv.k_exact)
            buf["v_win"][:, :, :kv.window].copy_(kv.v_exact)
        stored = sum(kv.nbytes for kv in self._layers)
        dense = sum(2 * B * spec.n_kv_heads * T * spec.head_dim * kv.k_exact.element_size() for kv in self._layers)
        self._accounting = {"attsvd_stored_bytes": stored, "attsvd_dense_bytes": dense,
                            "attsvd_ratio": stored / max(1, dense), "bulk_len": s_b, "bulk_padded": s_pad,
                            "window_capacity": w_cap, "rank_k": ranks[0][0] if s_b else 0,
                            "rank_v": ranks[0][1] if s_b else 0}
        self._sb.fill_(s_b)
        self._sb_host = s_b
        self._layers = []                     # decode reads only the static buffers

    # ------------------------------------------------------------------ decode
    def step_context(self, B: int, live: int | None, rope: torch.Tensor) -> FactorStep:
        """Mask [B, 1, 1, S_pad + W_cap] (or the live rows) for the token at ``cursor.length``."""
        c, pos = self.cursor, self.cursor.length
        s_pad, w_cap = self._key[1], self._key[2]
        if live is not None:                                   # eager: exact sizes, host lengths
            n_bulk, n_win = self._sb_host, live - self._sb_host
            mask = None
            if c.any_pad:
                slots = torch.cat([self._slots[:n_bulk], self._slots[self._sb_host:live]])
                mask = additive_mask(slots[None, :] >= c.pad[:B, None], self.spec.dtype).view(B, 1, 1, -1)
        else:                                                  # graph: full buffers, device lengths
            n_bulk, n_win = s_pad, w_cap
            bulk = torch.arange(s_pad, device=pos.device)
            win = self._sb + torch.arange(w_cap, device=pos.device)
            ok = torch.cat([(bulk < self._sb)[None, :] & (bulk[None, :] >= c.pad[:B, None]),
                            (win <= pos)[None, :] & (win[None, :] >= c.pad[:B, None])], 1)
            mask = additive_mask(ok, self.spec.dtype).view(B, 1, 1, -1)
        return FactorStep(B, 1, False, rope, mask, pos, live, n_bulk, n_win, pos - self._sb)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: FactorStep) -> None:
        """The current token's k/v [B, Hkv, 1, D] -> its window slot."""
        buf = self._bufs[layer]
        buf["k_win"].index_copy_(2, ctx.slot, k)
        buf["v_win"].index_copy_(2, ctx.slot, v)

    def attend(self, layer: int, q: torch.Tensor, ctx: FactorStep) -> torch.Tensor:
        """q [B, Hkv, G, D] -> [B, Hq * D]: bulk read in factor space + exact window, one softmax."""
        buf = self._bufs[layer]
        B, Hkv, G, D = q.shape
        runs = self._runs[layer] if ctx.n_bulk else []
        o = attend_factors(q.reshape(B, Hkv * G, 1, D), runs, buf["k_win"][:, :, :ctx.n_win],
                           buf["v_win"][:, :, :ctx.n_win], ctx.mask)          # [B, Hq, 1, D]
        return o.reshape(B, Hkv * G * D)
