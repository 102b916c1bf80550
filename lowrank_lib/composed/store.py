"""The composed cache as a runtime engine store (:class:`lowrank_lib.runtime.kv.KVStore`), eager decode.

    >>> eng = Engine(model, EngineConfig(max_seq_len=2200), kv=ComposedStore(ComposedConfig(scorer="h2o_norm"), 0.25))

- prefill: the engine's exact prefill (exact logits); each layer's post-RoPE q/k/v arrive through
  ``store_prefill`` and are held until ``end_prefill``, which scores every layer with the configured
  layer-scope policy, allocates the byte budget across layers and heads (:func:`~lowrank_lib.composed.plan.allocate`,
  the global allocation needs every layer's scores) and builds the tiers with the same
  :func:`~lowrank_lib.composed.build.build` the transformers cache uses; the prompt's dense K/V are then freed;
- decode: the current token's k/v go to a preallocated exact buffer per layer ([B, Hkv, max_seq_len - T, D]),
  and :func:`~lowrank_lib.composed.kv.attend` reads the tiers (factor space) and those rows under one softmax.

Limits (stated, not hidden): KVzip scores with a second forward of the HF model, so it is not available
here (score on the transformers path, :func:`~lowrank_lib.composed.build.compress`); the tiers are ragged,
so decode is eager only (``capturable = False``); left-padded batches are refused. Expected Attention reads
RoPE from the engine's table (frequencies recovered from its first rows, so future positions past
``max_seq_len`` are exact for standard, linear and llama3 scaling; a bf16 table gives bf16-accurate angles).

Bytes: ``nbytes`` = the packed tiers (:attr:`~lowrank_lib.composed.kv.PackedLayer.nbytes`: positions, offsets,
head ids and any rank padding included) + the appended-row buffers as allocated. ``attention``: ``"auto"``
(default) or ``"packed"`` (:func:`~lowrank_lib.composed.kv.attend_layer` over the packed layout), or ``"ragged"``
(the tiers as built, one tensor set per head, read by the per-head reference :func:`~lowrank_lib.composed.kv.attend`:
the store before the packed layout; ``packed_bytes`` is then the ragged count).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..eviction import SCORERS
from ..hf.cache import Observation
from ..hf.record import PrefillRecord
from ..runtime.kv import BackendChoice, KVSpec, StepContext
from .build import ComposedConfig, build, importance
from .cache import ComposedCache
from .kv import ATTEND_MODES, PackedLayer, attend, attend_layer, pack, tiers_nbytes


def _layer_bytes(layer) -> int:
    return layer.nbytes if isinstance(layer, PackedLayer) else tiers_nbytes(layer)


@dataclass
class TierStep(StepContext):
    """Decode context: the number of appended rows attention reads (this token included)."""

    n_new: int = 0


class ComposedStore:
    """Composed (exact + low-rank + dropped) store at ``budget`` of the dense prompt bytes."""

    name = "composed"
    stores_latents = False
    capturable = False

    def __init__(self, config: ComposedConfig | None = None, budget: float = 0.25, attention: str = "auto"):
        self.config = config or ComposedConfig(scorer="h2o_norm")
        if attention not in ATTEND_MODES:
            raise ValueError(f"unknown composed attention {attention!r}; choose from {ATTEND_MODES}")
        self.attention = attention
        if self.config.scorer not in SCORERS:
            raise ValueError(f"unknown scorer {self.config.scorer!r}; choose from {sorted(SCORERS)}")
        if getattr(SCORERS[self.config.scorer], "scope", "layer") == "model":
            raise ValueError(f"{self.config.scorer} scores with a forward of the transformers model: build its cache "
                             f"with lowrank_lib.composed.compress (the engine store takes layer-scope scorers)")
        self.budget = budget
        self.backend = BackendChoice("composed", f"exact + low-rank tiers packed per layer, one softmax in factor "
                                     f"space (composed.kv.attend_layer, mode {attention!r}); eager decode")
        self._layers: list = []
        self._k_new: list[torch.Tensor] = []
        self._v_new: list[torch.Tensor] = []
        self._info: dict = {}

    # ------------------------------------------------------------------ allocation
    def allocate(self, spec: KVSpec) -> None:
        self.spec, self.cursor = spec, spec.cursor

    def _policy(self):
        p = SCORERS[self.config.scorer]()
        if not hasattr(p, "bind"):
            return p
        table = self.spec.rope_table
        if table is None:
            raise ValueError(f"{self.config.scorer} needs RoPE: the engine gave no rope_table")

        # RoPE at any position from the table's first two rows: a cos(p theta), a sin(p theta) (the frequencies
        # theta < pi of standard, linear and llama3-scaled RoPE are the angles of row 1; a = row 0's cosine)
        t = table[:2].double()
        theta, a = torch.atan2(t[1, 1], t[1, 0]), t[0, 0]

        def rope(pos: torch.Tensor):
            ang = pos.to(theta.device).double()[:, None] * theta
            return (a * ang.cos()).float(), (a * ang.sin()).float()

        return replace(p, rope=rope)

    @property
    def nbytes(self) -> int:
        new = sum(t.numel() * t.element_size() for t in self._k_new + self._v_new)
        return sum(_layer_bytes(l) for l in self._layers) + new

    def shape_key(self):
        return None        # not capturable: no graph is ever keyed by this store

    def report(self) -> dict:
        return {"store": self.name, "budget": self.budget, "composed": self.config.to_dict(), "attention": self.attention,
                **self._info,
                "buffer_bytes": self.nbytes}

    # ------------------------------------------------------------------ prefill
    def reset(self, B: int, T: int) -> None:
        if self.cursor.any_pad:
            raise NotImplementedError("ComposedStore does not support left-padded batches: one prompt length per batch")
        self._B, self._T = B, T
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._obs: list[Observation] = []
        self._layers, self._k_new, self._v_new = [], [], []

    def store_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q [B, Hq, T, D], k/v [B, Hkv, T, D] post-RoPE: held until every layer has arrived."""
        self._keys.append(k)
        self._values.append(v)
        self._obs.append(Observation(q, self.spec.head_dim ** -0.5, torch.arange(k.shape[2], device=k.device)))

    def record(self) -> PrefillRecord:
        """The prompt's post-RoPE k / v and queries held since ``reset`` (every layer)."""
        if len(self._keys) != self.spec.n_layers:
            raise RuntimeError(f"ComposedStore: expected {self.spec.n_layers} layers in prefill, got {len(self._keys)}")
        return PrefillRecord(self._keys, self._values, self._obs, torch.empty(0))

    def scores(self, rec: PrefillRecord):
        """The configured scorer's :class:`~lowrank_lib.composed.build.Importance` of ``rec``."""
        cfg = self.config
        return importance(self._policy(), None, None, None, rec, cfg.window, cfg.obs_window, stats=cfg.mid_share > 0)

    def end_prefill(self) -> None:
        rec = self.record()
        self.load(build(rec, self.scores(rec), self.budget, self.config))

    def load(self, cache: ComposedCache) -> None:
        """Hold ``cache``'s tiers (built from this request's prefill, ``reset(B, T)`` called) packed, and allocate
        the appended rows; the prompt's dense K/V are freed. ``end_prefill`` = score + build + load; a caller
        building several budgets from one prefill scores once and loads each."""
        spec, B, T = self.spec, self._B, self._T
        # packed: the ragged heads become views of the packed tensors; "ragged": the tiers as built, per head
        self._layers = [l.heads if self.attention == "ragged" else pack(l.heads) for l in cache.layers]
        cap = spec.max_seq_len - T
        z = lambda: torch.zeros(B, spec.n_kv_heads, cap, spec.head_dim, dtype=spec.dtype, device=spec.device)
        self._k_new = [z() for _ in range(spec.n_layers)]
        self._v_new = [z() for _ in range(spec.n_layers)]
        dense = 2 * spec.n_layers * B * spec.n_kv_heads * T * spec.head_dim * spec.dtype.itemsize
        self._info = {"tier_bytes": cache.info["plan_bytes"], "tiers": cache.tier_counts(), "dense_prompt_bytes": dense}
        self._info["packed_bytes"] = sum(_layer_bytes(l) for l in self._layers)  # + offsets, head ids, rank padding
        self._info["tier_ratio"] = self._info["tier_bytes"] / max(1, self._info["dense_prompt_bytes"])
        self._keys, self._values, self._obs = [], [], []    # the prompt's dense K/V are freed

    # ------------------------------------------------------------------ decode
    def step_context(self, B: int, live: int | None, rope: torch.Tensor) -> TierStep:
        if live is None:
            raise RuntimeError("ComposedStore decodes eagerly (ragged tiers): run the engine without graphs")
        return TierStep(B, 1, False, rope, None, self.cursor.length, live, live - self._T)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: TierStep) -> None:
        """The current token's k/v [B, Hkv, 1, D] -> appended row ``n_new - 1``."""
        self._k_new[layer][:, :, ctx.n_new - 1] = k[:, :, 0]
        self._v_new[layer][:, :, ctx.n_new - 1] = v[:, :, 0]

    def attend(self, layer: int, q: torch.Tensor, ctx: TierStep) -> torch.Tensor:
        """q [B, Hkv, G, D] -> [B, Hq * D]: tiers + appended rows, one softmax."""
        B, Hkv, G, D = q.shape
        n = ctx.n_new
        tiers, q = self._layers[layer], q.reshape(B, Hkv * G, 1, D)
        kn, vn = self._k_new[layer][:B, :, :n], self._v_new[layer][:B, :, :n]
        o = (attend_layer(q, tiers, kn, vn, D ** -0.5, mode=self.attention) if isinstance(tiers, PackedLayer)
             else attend(q, tiers, kn, vn, D ** -0.5))
        return o.reshape(B, Hkv * G * D)
