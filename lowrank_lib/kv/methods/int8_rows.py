"""Eviction with its kept rows held in 8 bits: the control of the composed cache's low-rank tier.

``composed-kvzip-q8`` is KVzip's ranking + an exact tier + an 8-bit rank-8 low-rank tier. Whether the low-rank
tier itself helps is measured against THIS method at the same bytes: the same KVzip ranking and global
allocation, no low-rank tier, and every kept row (key and value) stored as int8 with one fp16 scale per row
(:func:`~lowrank_lib.kv.tiers.quantize_rows`, the composed cache's own quantiser). A kept token costs
``2 d + 4`` bytes + its position per KV head instead of ``2 d elt`` + position, so the budget keeps about
``2 elt`` times as many tokens as fp eviction would.

The rows are really held as int8 (:class:`Int8RowsLayer`: ``k_exact`` / ``v_exact`` are dequantised on every
read, never stored in floating point), so the layer's ``tier_nbytes`` are the bytes held, as for every method.
Rows appended after the prefill stay exact (as in every method's accumulate schedule).
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields

import torch

from ...eviction.budget import index_dtype
from ..method import Prefill, RowFit
from ..tiers import Segment, TieredLayer, descriptor_nbytes, quantize_rows
from .composed import Eviction, TierBytes, allocate, importance


def _scale_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float16 if float(x.abs().max()) / 127.0 < 6e4 else torch.float32   # as tiers.scale_dtype_for


class Int8RowsLayer(TieredLayer):
    """A :class:`TieredLayer` whose exact rows are held as int8 + one scale per row (``k_q``, ``k_s``, ``v_q``,
    ``v_s``); reading ``k_exact`` / ``v_exact`` dequantises, assigning them quantises."""

    @staticmethod
    def of(layer: TieredLayer) -> "Int8RowsLayer":
        return Int8RowsLayer(**{f.name: getattr(layer, f.name) for f in fields(layer)})

    def _get(self, t: str) -> torch.Tensor:
        q, s = self.__dict__[f"{t}_q"], self.__dict__[f"{t}_s"]
        return q.to(self.__dict__["_dtype"]) * s.to(self.__dict__["_dtype"])[:, None]

    def _set(self, t: str, x: torch.Tensor) -> None:
        self.__dict__["_dtype"] = x.dtype
        sdt = _scale_dtype(x) if x.numel() else torch.float16
        self.__dict__[f"{t}_q"], self.__dict__[f"{t}_s"] = quantize_rows(x, sdt)

    k_exact = property(lambda self: self._get("k"), lambda self, x: self._set("k", x))
    v_exact = property(lambda self: self._get("v"), lambda self, x: self._set("v", x))

    def _stored(self) -> list[torch.Tensor]:
        rest = [t for t in (self.e_off, self.runs, self.r_off, self.a_k, self.a_v, self.b_k, self.b_v, self.k_scale,
                            self.v_scale, self.pos_exact, self.pos_mid) if t is not None]
        return [self.__dict__[n] for n in ("k_q", "k_s", "v_q", "v_s")] + rest

    def block_exact_k(self) -> bool:
        """Never blocked: the rows are held as int8 with a scale per row (reading them dequantises)."""
        return False

    def pad_to_buckets(self, bucket=None) -> None:
        """As :meth:`TieredLayer.pad_to_buckets`, the padding counted at the int8 rows' real size."""
        size = lambda: sum(t.numel() * t.element_size() for t in self._stored())
        before, pad = size(), self.pad_nbytes
        super().pad_to_buckets(bucket)
        self.pad_nbytes = pad + size() - before


class _Int8RowBytes(TierBytes):
    """Tier costs with an exact row in int8: key + value entries, one fp16 scale each, its position."""

    @property
    def exact(self) -> int:
        return 2 * self.head_dim + 2 * 2 + self.idx


@dataclass
class Int8Eviction(Eviction):
    """The scorer's top tokens (KVzip, global allocation by default) held as int8 rows at ``budget``; the rest
    dropped. No low-rank tier."""

    mode: str = "global"
    capturable: bool = field(default=False, init=False)   # reads dequantise into a fresh tensor every call

    def fit_row(self, prefill: Prefill) -> RowFit:
        imp = importance(self.make_scorer(), prefill, self.window, self.obs_window, stats=False)
        K0 = prefill.keys[0]
        _, H, S, d = K0.shape
        L = prefill.n_layers
        cost = _Int8RowBytes(d, K0.element_size(), S)
        avail = self.budget * prefill.dense_nbytes() - L * descriptor_nbytes(H, 0)
        plans = allocate(imp.score, max(0.0, avail), cost, 0.0, self.mode)
        idt = index_dtype(S)
        return RowFit([[Segment(K[0, h][p.exact].clone(), V[0, h][p.exact].clone(), p.exact.to(idt))
                        for h, p in enumerate(plan[0])]
                       for K, V, plan in zip(prefill.keys, prefill.values, plans)])

    def fit(self, prefill: Prefill) -> list[TieredLayer]:
        return [Int8RowsLayer.of(layer) for layer in super().fit(prefill)]

    def describe(self, layers: list[TieredLayer], prefill: Prefill) -> dict:
        return super().describe(layers, prefill) | {"exact_rows": "int8"}
