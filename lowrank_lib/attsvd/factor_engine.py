"""AttSVD factor-space KV mode for the decode runtime's ``Engine``.

:class:`FactorEngine` is an ``Engine`` (same packed projections, RoPE / norm folding, sampling loop,
timings) whose decode attention reads AttSVD factors in factor space instead of a dense KV cache:

- prefill: the engine's own dense prefill (exact logits); its post-RoPE queries arrive through the
  engine's ``prefill_kv`` hook and every layer's prompt bulk is factorized with the AttSVD cache's own
  compression (``AttSVDLayer`` update + observe: Algorithm 2, attention-aware, GQA-aware), then the
  transient dense K/V are freed;
- decode: static, preallocated buffers per layer: A_K, A_V [B, Hkv, S_pad, r], B_K, B_V [B, Hkv, r, d]
  and the exact window [B, Hkv, W_cap, d]; the current token's k/v are written in place at a
  device-side slot, scores / output come from :func:`factor_space_attention`, one softmax over bulk
  and window with a mask built on the device from ``cache.length`` and the left-pad counts.

Bucketing policy (graph capture): the bulk length S_b is padded up to a multiple of ``bucket``
(S_pad; padded rows are masked) and the window buffer holds W_cap = max_seq_len - S_pad + bucket
slots, so every prompt whose bulk falls in the same bucket has identical buffer shapes: a captured
decode step (CUDA graph, or ``torch.compile`` on CPU) is reused within a bucket and re-captured when
the bucket changes. Without graphs the buffers have the exact sizes (S_pad = S_b, W_cap =
max_seq_len - S_b) and decode slices the live rows. S_b itself is a
device tensor, so nothing host-side is baked into a graph. Only the accumulate mode is supported
(stream mode appends frozen blocks: a static version needs a block pool; not implemented).

Memory (``kv_report()``): the AttSVD accounting of the compressed prompt (factors + exact window,
the numbers ``AttSVDCache.memory()`` gives) and the bytes the engine's buffers actually hold.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..runtime.config import EngineConfig
from ..runtime.engine import Engine
from ..runtime.kv_cache import StaticKVCache
from ..hf.cache import Observation
from .cache import AttSVDLayer
from .config import AttSVDConfig
from .factor_space import factor_space_attention
from .kv import LowRankKV


@dataclass
class _LayerBuffers:
    a_k: torch.Tensor   # [B, Hkv, S_pad, r_K]
    b_k: torch.Tensor   # [B, Hkv, r_K, d]
    a_v: torch.Tensor   # [B, Hkv, S_pad, r_V]
    b_v: torch.Tensor   # [B, Hkv, r_V, d]
    k_win: torch.Tensor  # [B, Hkv, W_cap, d]
    v_win: torch.Tensor

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.__dict__.values())


class FactorEngine(Engine):
    """``Engine`` with the AttSVD factor-space KV mode (see the module docstring).

    Parameters
    ----------
    model : a Llama-family model in the one factorized representation (as for ``Engine``).
    config : ``EngineConfig``; ``kv`` must be "dense" (its prefill path is the one reused).
    attsvd : ``AttSVDConfig`` (rank rule, window w, attention-aware); mode "accumulate".
    bucket : bulk-length bucket of the graph policy.
    """

    def __init__(self, model, config: EngineConfig | None = None, attsvd: AttSVDConfig | None = None,
                 bucket: int = 256):
        config = config or EngineConfig()
        if config.kv != "dense":
            raise ValueError(f"FactorEngine replaces the KV mode itself: pass EngineConfig(kv='dense'), got {config.kv!r}")
        self.attsvd = attsvd or AttSVDConfig(ratio=0.5)
        if self.attsvd.mode != "accumulate":
            raise NotImplementedError("FactorEngine supports AttSVD mode 'accumulate' (stream mode needs a static "
                                      "block pool); use the transformers path (factor_cache) for stream mode")
        if bucket < 1:
            raise ValueError(f"bucket must be >= 1, got {bucket}")
        self.bucket = bucket
        super().__init__(model, config)
        self._q_capture: list[torch.Tensor] | None = None
        self._buf: list[_LayerBuffers] | None = None
        self._key = None                      # (B, S_pad): the shape key of captured graphs
        self._sb = torch.zeros(1, dtype=torch.long, device=self.device)   # bulk length S_b (device)
        self._sb_host = 0
        self._accounting = {}
        self._free_dense()                    # the dense cache exists only transiently, during prefill

    def _free_dense(self) -> None:
        c = self.cache
        c.kv, c.k, c.v = None, [], []

    # ------------------------------------------------------------------ prefill
    def prefill_kv(self, i, q, k, v, slots):
        """Dense K/V into the transient prompt cache, and the post-RoPE queries for Algorithm 2."""
        super().prefill_kv(i, q, k, v, slots)
        if self._q_capture is not None:
            self._q_capture.append(q)         # [B, Hq, T, D]

    @torch.no_grad()
    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """The engine's exact dense prefill, then AttSVD compression of every layer's prompt bulk."""
        B, T = input_ids.shape
        cfg = self.config
        # transient dense K/V of the prompt only (freed after compression). The cache object (and its
        # device-side length / pad tensors, which captured graphs read) stays the same.
        tmp = StaticKVCache(self.n_layers, cfg.max_batch, max(T, 2), self.n_kv, self.head_dim, self.dtype,
                            self.device, self.backend.layout)
        c = self.cache
        c.kv, c.k, c.v, c.max_len = tmp.kv, tmp.k, tmp.v, tmp.max_len
        self._q_capture = []
        try:
            logits = super().prefill(input_ids, attention_mask, all_logits)
        finally:
            caps, self._q_capture = self._q_capture, None
        if len(caps) != self.n_layers:
            raise RuntimeError(f"FactorEngine: expected queries of {self.n_layers} layers in prefill, saw {len(caps)}")
        self._compress(caps, B, T)
        self.cache.max_len = cfg.max_seq_len
        return logits

    def _compress(self, queries: list[torch.Tensor], B: int, T: int) -> None:
        c, D = self.cache, self.head_dim
        pad = c.pad[:B]
        slots = self._slots[:T]
        valid = slots[None, :] >= pad[:, None]                                  # [B, T]
        k_valid = None if bool(valid.all()) else valid
        w = self.attsvd.window
        s_b = max(0, T - w)
        if self.graphs is None:               # eager: exact sizes, nothing padded
            s_pad, w_cap = s_b, self.config.max_seq_len - s_b
        else:                                 # graphs: one buffer shape per bulk bucket
            s_pad = max(self.bucket, math.ceil(s_b / self.bucket) * self.bucket)
            w_cap = self.config.max_seq_len - s_pad + self.bucket
        layers, stored, dense = [], 0, 0
        for i, q in enumerate(queries):
            K, V = c.k[i][:B], c.v[i][:B]
            if self.backend.layout == "bshd":
                K, V = K.transpose(1, 2), V.transpose(1, 2)
            K, V = K[:, :, :T], V[:, :, :T]                                       # [B, Hkv, T, D]
            layer = AttSVDLayer(self.attsvd)
            layer.update(K, V)
            layer.observe(Observation(q, D ** -0.5, slots, k_valid, k_valid))
            stored += layer.nbytes
            dense += layer.dense_nbytes
            layers.append(layer)
        ranks = [(l.rank_k, l.rank_v) if s_b else (1, 1) for l in layers]
        key = (B, s_pad, w_cap, tuple(ranks))
        if key != self._key:                  # new shapes: new buffers, and graphs must be re-captured
            self._buf = [self._alloc(B, s_pad, w_cap, rk, rv) for rk, rv in ranks]
            if self.graphs is not None:
                self.graphs._state.clear()
            self._key = key
        for layer, buf in zip(layers, self._buf):  # same bucket: overwrite in place (captured addresses)
            self._fill(buf, layer, s_b)
        self._accounting = {"attsvd_stored_bytes": stored, "attsvd_dense_bytes": dense,
                            "attsvd_ratio": stored / max(1, dense), "bulk_len": s_b, "bulk_padded": s_pad,
                            "window_capacity": w_cap, "rank_k": ranks[0][0] if s_b else 0,
                            "rank_v": ranks[0][1] if s_b else 0}
        self._sb.fill_(s_b)
        self._sb_host = s_b
        self._free_dense()                    # decode reads only the factors and the window

    def _alloc(self, B: int, s_pad: int, w_cap: int, rk: int, rv: int) -> _LayerBuffers:
        z = lambda *shape: torch.zeros(*shape, dtype=self.dtype, device=self.device)
        Hkv, D = self.n_kv, self.head_dim
        return _LayerBuffers(z(B, Hkv, s_pad, rk), z(B, Hkv, rk, D), z(B, Hkv, s_pad, rv), z(B, Hkv, rv, D),
                             z(B, Hkv, w_cap, D), z(B, Hkv, w_cap, D))

    @staticmethod
    def _fill(buf: _LayerBuffers, layer: AttSVDLayer, s_b: int) -> None:
        """Copy a compressed layer into its static buffers (rows past S_b / past the window zeroed)."""
        for t in buf.__dict__.values():
            t.zero_()
        if s_b:
            a_k, b_k, a_v, b_v = layer.kv.runs[0]
            buf.a_k[:, :, :s_b].copy_(a_k)
            buf.b_k.copy_(b_k)
            buf.a_v[:, :, :s_b].copy_(a_v)
            buf.b_v.copy_(b_v)
        n = layer.keys.shape[-2]
        buf.k_win[:, :, :n].copy_(layer.keys)
        buf.v_win[:, :, :n].copy_(layer.values)

    # ------------------------------------------------------------------ decode
    def step_context(self, B: int, live: int | None):
        """(pos [1], cs, mask [B, 1, 1, S_pad + W_cap] or None, n_bulk, n_win) for the token at cache.length."""
        c = self.cache
        pos, cs = c.length, self._step_rope(B)
        s_pad, w_cap = self._buf[0].a_k.shape[2], self._buf[0].k_win.shape[2]
        if live is not None:                                   # eager: exact sizes, host lengths
            n_bulk, n_win = self._sb_host, live - self._sb_host
            if not self._any_pad:
                return pos, cs, None, n_bulk, n_win
            slots = torch.cat([self._slots[:n_bulk], self._slots[self._sb_host:live]])
            ok = slots[None, :] >= c.pad[:B, None]
        else:                                                  # graph: full buffers, device lengths
            n_bulk, n_win = s_pad, w_cap
            bulk = torch.arange(s_pad, device=self.device)
            win = self._sb + torch.arange(w_cap, device=self.device)
            ok = torch.cat([(bulk < self._sb)[None, :] & (bulk[None, :] >= c.pad[:B, None]),
                            (win <= pos)[None, :] & (win[None, :] >= c.pad[:B, None])], 1)
        return pos, cs, self._additive_mask(ok).view(B, 1, 1, -1), n_bulk, n_win

    def decode_attention(self, i, q, k, v, ctx):
        """q [B, Hkv, G, D], k/v [B, Hkv, 1, D] -> [B, Hq * D]: bulk read in factor space + exact window."""
        pos, _, mask, n_bulk, n_win = ctx
        buf = self._buf[i]
        B, Hkv, G, D = q.shape
        slot = pos - self._sb                                  # window slot of this token (device)
        buf.k_win.index_copy_(2, slot, k)
        buf.v_win.index_copy_(2, slot, v)
        segs = [(buf.a_k[:, :, :n_bulk], buf.b_k, buf.a_v[:, :, :n_bulk], buf.b_v)] if n_bulk else []
        kv = LowRankKV(segs, buf.k_win[:, :, :n_win], buf.v_win[:, :, :n_win])
        o = factor_space_attention(q.reshape(B, Hkv * G, 1, D), kv, mask)   # [B, Hq, 1, D]
        return o.reshape(B, Hkv * G * D)

    # ------------------------------------------------------------------ accounting
    def kv_report(self) -> dict:
        """AttSVD accounting of the compressed prompt + the bytes the decode buffers hold."""
        held = sum(b.nbytes for b in self._buf) if self._buf else 0
        return {**self._accounting, "buffer_bytes": held, "bucket": self.bucket}

    def report(self) -> dict:
        rep = super().report()
        rep["kv"] = "attsvd-factor"
        rep["kv_cache_bytes"] = self.kv_report()["buffer_bytes"]
        rep["attsvd"] = {**self.attsvd.to_dict(), **self.kv_report()}
        return rep
