"""The KV-method abstraction: what a method fits from (:class:`Prefill`), what it declares and does (:class:`KVMethod`).

A KV method is ONE dataclass: its options and its math. From a prefill (every layer's post-RoPE K, V and, where it
needs them, Q) it fits one :class:`~lowrank_lib.kv.tiers.TieredLayer` per layer at its byte ``budget``; decode
appends the new tokens (``append``) and attends over the tiers (``attend``, the one tiered attention);
``nbytes`` is what the layers really hold. Two generic adapters serve every method with no per-method code:
:class:`lowrank_lib.kv.hf_adapter.KVCache` (a transformers ``Cache``) and
:class:`lowrank_lib.kv.engine_adapter.MethodStore` (the engine's ``KVStore``).

Declared, never probed (typed fields of the base, set by each method):

    needs_queries : the prefill's post-RoPE queries are read (adapters record them only then)
    scope         : "layer", or "model" (fitting runs a forward of the model on top of the prefill: KVzip's
                    reconstruction; each adapter provides it as ``Prefill.probe``)
    window        : newest prefill tokens kept exact
    capturable    : decode may run under graph capture / the compiled engine step

Budget, one meaning everywhere: the fraction of the dense KV bytes of the prompt that the fitted state really
holds (indices, positions and scales included), per batch row. Method-specific knobs (AttSVD's r/d, the paper's
compression ratio) are derived from it and reported beside it (:meth:`KVMethod.describe`).

Batches: every row is fitted on its own valid (unpadded) tokens, as a batch of one (:meth:`Prefill.row`), so a
method never sees padding and a padded batch holds exactly what its rows would hold alone.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, Callable, ClassVar

import torch

from ..eviction.base import Observation, Rope
from ..runtime.kv import Backend
from .tiers import Segment, TieredLayer, attend

#: (row b, input ids [1, n]) -> per layer (q [1, Hq, n, d], k [1, H, n, d]): post-RoPE queries and the input's own
#: keys of a forward of ``ids`` on top of row b's whole prefill (positions continue after it); nothing is kept
ProbeFn = Callable[[int, torch.Tensor], list[tuple[torch.Tensor, torch.Tensor]]]


@dataclass(eq=False)
class Prefill:
    """One request's prefill as every adapter hands it to a method (post-RoPE, every layer).

    keys, values : per layer [B, H, S, d]; queries : per layer [B, Hq, S, d], or None when no method needs them;
    scaling : the softmax scale; valid : [B, S] bool, False at left-pad slots (None: no padding);
    ids : [B, S] token ids (model-scope scorers rebuild the context); probe : :data:`ProbeFn` (model scope);
    rope : positions -> (cos, sin) (Expected Attention); tokenizer : for model-scope prompts (None: fixed ids);
    last_logits : [B, V] the prefill's last logits, where the adapter kept them;
    memo : budget-independent work shared by every method fitted from this prefill (scores, statistics).
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    queries: list[torch.Tensor] | None
    scaling: float
    valid: torch.Tensor | None = None
    ids: torch.Tensor | None = None
    probe_row: ProbeFn | None = None
    rope: Rope | None = None
    tokenizer: Any = None
    last_logits: torch.Tensor | None = None
    memo: dict = field(default_factory=dict)
    _rows: dict = field(default_factory=dict, repr=False)
    _obs: dict = field(default_factory=dict, repr=False)

    # ------------------------------------------------------------------ shape
    @property
    def length(self) -> int:
        return self.keys[0].shape[-2]

    @property
    def n_layers(self) -> int:
        return len(self.keys)

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def kv_heads(self) -> int:
        return self.keys[0].shape[1]

    @property
    def head_dim(self) -> int:
        return self.keys[0].shape[-1]

    @property
    def dtype(self) -> torch.dtype:
        return self.keys[0].dtype

    def pad(self, b: int) -> int:
        """Left-pad slots of row ``b``."""
        return 0 if self.valid is None else int((~self.valid[b]).sum())

    def dense_nbytes(self) -> int:
        """Bytes a dense cache holds for the real (unpadded) prompt tokens of every row: the budget's 100 %."""
        n = self.batch * self.length - sum(self.pad(b) for b in range(self.batch))
        return 2 * self.n_layers * self.kv_heads * n * self.head_dim * self.keys[0].element_size()

    # ------------------------------------------------------------------ one row
    def row(self, b: int) -> "Prefill":
        """Row ``b`` alone on its valid tokens (batch 1, no padding; its own memo), built once per row."""
        if self.batch == 1 and self.valid is None:
            return self
        if b not in self._rows:
            p = self.pad(b)
            sl = lambda ts: None if ts is None else [t[b:b + 1, :, p:] for t in ts]
            probe = None if self.probe_row is None else (lambda _, x, b=b: self.probe_row(b, x))
            self._rows[b] = Prefill(sl(self.keys), sl(self.values), sl(self.queries), self.scaling, None,
                                    None if self.ids is None else self.ids[b:b + 1, p:], probe, self.rope,
                                    self.tokenizer, None if self.last_logits is None else self.last_logits[b:b + 1])
        return self._rows[b]

    def probe(self, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A forward of ``ids`` [1, n] on top of this (one-row) prefill: per layer (q [1, Hq, n, d], k [1, H, n, d])."""
        if self.probe_row is None:
            raise ValueError("this prefill has no probe forward (a model-scope method needs the adapter's)")
        if self.batch != 1 or self.valid is not None:
            raise ValueError("Prefill.probe runs on one unpadded row: use prefill.row(b).probe(ids)")
        return self.probe_row(0, ids)

    @property
    def obs(self) -> list[Observation]:
        """Every layer's :meth:`observation` (one unpadded row)."""
        return [self.observation(i) for i in range(self.n_layers)]

    def observation(self, i: int) -> Observation:
        """What a layer-scope scorer observes of layer ``i`` (one unpadded row: positions 0 .. S-1)."""
        if self.batch != 1 or self.valid is not None:
            raise ValueError("Prefill.observation is per unpadded row: use prefill.row(b).observation(i)")
        if i not in self._obs:
            q = None if self.queries is None else self.queries[i]
            pos = torch.arange(self.length, device=self.keys[i].device)
            self._obs[i] = Observation(q, self.scaling, pos, self.keys[i], rope=self.rope)
        return self._obs[i]


@dataclass
class RowFit:
    """What a method fits of one unpadded row: per layer, per KV head a :class:`Segment`; per layer what it
    reports of that fit (ranks, spectra summaries; not held, not counted)."""

    segments: list[list[Segment]]
    info: list[dict] | None = None


@dataclass
class KVMethod:
    """Base of every KV method (see the module docstring).

    budget : fraction of the dense KV bytes of the prompt the method may hold after the prefill (None where the
        method has its own rule, e.g. AttSVD's rank or energy rule; the bytes then are an outcome). What it really
        holds is reported as ``describe()["budget"]``.
    window : newest prefill tokens kept exact (None: the method's default, resolved at construction).
    """

    budget: float | None = 1.0
    window: int | None = None
    needs_queries: bool = field(default=False, init=False)
    scope: str = field(default="layer", init=False)
    capturable: bool = field(default=True, init=False)
    name: str = field(default="", init=False)
    #: "dense" | "lowrank" | "eviction" | "composed" (tables group by it)
    kind: ClassVar[str] = ""
    #: int8 low-rank factors (one scale per token row)
    quant8: ClassVar[bool] = False

    def __post_init__(self):
        if self.budget is not None and not self.budget > 0:
            raise ValueError(f"{type(self).__name__}: budget must be > 0 (a fraction of the dense KV bytes), "
                             f"got {self.budget}")
        if self.window is not None and self.window < 0:
            raise ValueError(f"{type(self).__name__}: window must be >= 0, got {self.window}")

    # ------------------------------------------------------------------ to implement
    def fit_row(self, prefill: Prefill) -> RowFit:
        """The fit of one unpadded row (``prefill`` has batch 1): per layer, per KV head its :class:`Segment`."""
        raise NotImplementedError

    # ------------------------------------------------------------------ the generic part
    def fit(self, prefill: Prefill) -> list[TieredLayer]:
        """One :class:`TieredLayer` per layer: every row fitted on its own valid tokens, then packed."""
        rows = [self.fit_row(prefill.row(b)) for b in range(prefill.batch)]
        layers = []
        for i in range(prefill.n_layers):
            layer = TieredLayer.build([r.segments[i] for r in rows], self.uses_quant8(), prefill.dtype,
                                      prefill.keys[i].device)
            layer.info = [r.info[i] if r.info else {} for r in rows]
            layers.append(layer)
        return layers

    def uses_quant8(self) -> bool:
        return self.quant8

    def append(self, layer: TieredLayer, k: torch.Tensor, v: torch.Tensor, slot: torch.Tensor | None = None) -> None:
        """The new tokens' k, v [B, H, t, d] after the prefill: appended exactly (the accumulate schedule)."""
        layer.append(k, v, slot)

    def attend(self, layer: TieredLayer, q: torch.Tensor, scale: float | None = None, n_new=None,
               backend: str | Backend = "portable") -> torch.Tensor:
        """q [B, Hq, q_len, d] over the layer's tiers and appended rows -> [B, Hq, q_len, d] (``backend``: an entry
        of ``kv.tiers.BACKENDS`` or its name, see :func:`~lowrank_lib.kv.tiers.attend`)."""
        return attend(layer, q, scale, n_new, backend)

    def nbytes(self, layers: list[TieredLayer]) -> int:
        return sum(l.nbytes for l in layers)

    def options(self) -> dict:
        """Every option of this method (its dataclass fields) as plain values, the name included."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def describe(self, layers: list[TieredLayer], prefill: Prefill) -> dict:
        """What the fitted state is: ``budget``, the fraction of the dense prompt bytes it really holds (bytes held
        over dense bytes, = ``bytes_ratio``), ``budget_target`` the budget it was asked for (None where a rank or
        an energy rule sized it), tier counts, and each method's own derived knobs (subclasses add them)."""
        dense = prefill.dense_nbytes()
        held = sum(l.tier_nbytes for l in layers)
        c = [l.counts() for l in layers]
        ratio = held / max(1, dense)
        return {"method": self.name, "kind": self.kind, "budget": ratio, "budget_target": self.budget,
                "bytes_held": held, "dense_bytes": dense, "bytes_ratio": ratio,
                "tokens_exact": sum(x["exact"] for x in c), "tokens_lowrank": sum(x["mid"] for x in c)}
