"""The engine adapter: ONE ``KVStore`` (:mod:`lowrank_lib.runtime.kv`) that serves every KV method in the engine.

    >>> eng = Engine(model, EngineConfig(max_seq_len=8200, graph="compiled"), kv=MethodStore(make_method(
    ...     "composed-kvzip-q8", budget=0.25), tok))
    >>> out = eng.generate(ids, max_new_tokens=64)

- prefill: the engine's exact prefill (exact logits); every layer's post-RoPE q/k/v arrive through
  ``store_prefill`` (q kept only where the method reads queries) and are held until ``end_prefill``, which builds
  the :class:`~lowrank_lib.kv.method.Prefill` (the prompt ids, the engine's probe forward for model-scope scorers
  such as KVzip, RoPE at any position from the model's rotary module) and fits the method; the prompt's dense K/V
  are then freed and each layer preallocates room for the appended rows (``max_seq_len - T`` rounded up to a power
  of two);
- decode: ``append`` is the method's (accumulate: the token's k/v at a device-side slot), ``attend`` the ONE tiered
  attention over exact rows, low-rank runs (factor space) and appended rows, by the backend
  :func:`~lowrank_lib.kv.tiers.select_backend` picks (our fused CPU kernel where it runs, else the portable path);
  under graphs / the compiled step every length is read from device memory (``cursor.length - T``), so one capture
  per request (``shape_key``: the fitted layers' shapes) replays for every step. Under the fused kernel, which reads
  the layout from device tensors, every buffer is rounded up to a bucket (``TieredLayer.pad_to_buckets``: at most
  1/8 more, allocated but not held), so requests whose layers round alike share one capture; a backend that slices
  with host ints keys its captures by the layout too (never a replay over another request's layout).

- the fused decode layer: where the method appends exact rows (``KVMethod.append``) and the attention is the fused
  kernel, the engine's decode step runs ONE op per layer (``lowrank_lrk::decode_layer_tiers``: norms, GEMVs, RoPE,
  the append at row ``cursor.length - T``, ``tier_attend``, MLP), reading the layout through ``fused_tier_args``;
  the per-op step (``append`` / ``attend`` below) serves every other method and ``EngineConfig(fused_layer="off")``.

``capturable`` is the method's (AttSVD's stream mode reshapes its state every ``chunk`` tokens: eager).
``nbytes`` = the fitted tiers + the appended rows written; ``report()`` adds the allocation and the method's
description of its fit (bytes over the dense prompt bytes: the budget's meaning).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..runtime.kernels import ops as kernel_ops
from ..runtime.kv import KVSpec, StepContext
from .method import KVMethod, Prefill
from .tiers import BACKENDS, TieredLayer, select_backend


def _drop_layouts(ids: list[int]) -> None:
    try:
        while ids:
            kernel_ops.drop_tier_layout(ids.pop())
    except Exception:           # interpreter shutdown: the library may be gone already
        pass


@dataclass
class TierStep(StepContext):
    """Decode context: appended rows attention reads (host int eager; [1] device tensor under graphs) and the
    device slot this token is written to."""

    n_new: int | torch.Tensor | None = None
    slot: torch.Tensor | None = None


class MethodStore:
    """The runtime engine's store for any KV method (see the module docstring)."""

    stores_latents = False

    def __init__(self, method: KVMethod, tokenizer=None, attention: str = "auto"):
        self.method, self.tokenizer, self.attention = method, tokenizer, attention
        self.name = method.name or type(method).__name__
        self.capturable = method.capturable
        self.backend = None
        self._layout = torch.zeros(1, dtype=torch.long)   # this prefill's tier layout id (0: none)
        self._layout_ids: list[int] = []                    # held ids, dropped at the next prefill or with the store
        weakref.finalize(self, _drop_layouts, self._layout_ids)
        self._tier = None                     # the chosen kv.tiers.BACKENDS entry, resolved once at allocation
        self.layers: list[TieredLayer] = []
        self.fit_info: dict = {}

    # ------------------------------------------------------------------ allocation
    def allocate(self, spec: KVSpec) -> None:
        """Choose the tiered attention (``self.attention`` under the engine's ``kernels`` policy: ``"portable"`` turns
        the fused kernel off, ``"lrk"`` requires it) and the device-side prompt length. ``EngineConfig.attention``
        names a dense-cache backend, which this store does not run: anything but ``"auto"`` is refused (pass the
        tiered one as ``MethodStore(method, attention=...)``)."""
        if spec.attention != "auto":
            raise ValueError(f"EngineConfig(attention={spec.attention!r}) names a dense-cache attention; a MethodStore "
                             f"reads its tiers with MethodStore(..., attention=...) (one of 'auto', {', '.join(BACKENDS)})")
        self.spec, self.cursor = spec, spec.cursor
        self.backend = select_backend(self.attention, spec.device, spec.head_dim, spec.dtype, spec.kernels)
        self._tier = BACKENDS[self.backend.name]
        if spec.graphs and not self.backend.caps.capturable:
            raise ValueError(f"tiered attention {self.backend.name!r} reads host counts (eager only): use graph='none'")
        self._slots = torch.arange(spec.max_seq_len, device=spec.device)
        # the prompt length as a device scalar, filled in place per request: a captured / compiled step reads it
        # (a host int would be baked in, and requests of another length sharing the capture would write and read
        # the appended rows at the wrong slots)
        self._t_dev = torch.zeros((), dtype=torch.long, device=spec.device)

    @property
    def nbytes(self) -> int:
        """Bytes held: the fitted tiers + the appended rows written (under graphs counted from the cursor)."""
        if not self.layers:
            return 0
        if not self.spec.graphs:
            return sum(l.nbytes for l in self.layers)
        n = max(0, self.cursor.host - self._T)
        return sum(l.tier_nbytes + l.appended_nbytes(n) for l in self.layers)

    @property
    def allocated_nbytes(self) -> int:
        return sum(l.allocated_nbytes for l in self.layers)

    @property
    def device_layout(self) -> bool:
        """The backend reads the layout from device tensors (its declared ``caps.reads_device_layout``: the fused
        kernel); others slice with host ints."""
        return self.backend is not None and self.backend.caps.reads_device_layout

    def shape_key(self):
        """The layers' shapes (bucketed under the fused kernel); with a host-slicing backend the layout too, so a
        capture never replays over another request's layout."""
        return tuple(l.shape_key(layout=not self.device_layout) for l in self.layers)

    def report(self) -> dict:
        return {"store": "method", "method": self.name, "options": self.method.options(),
                "attention": self.backend.name if self.backend else None, **self.fit_info,
                "buffer_bytes": self.nbytes, "allocated_bytes": self.allocated_nbytes}

    # ------------------------------------------------------------------ prefill
    def reset(self, B: int, T: int, ids: torch.Tensor | None = None) -> None:
        self._B, self._T, self._ids = B, T, ids
        self._t_dev.fill_(T)
        self._k: list[torch.Tensor] = []
        self._v: list[torch.Tensor] = []
        self._q: list[torch.Tensor] = []
        self.layers = []

    def store_prefill(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """q [B, Hq, T, D], k/v [B, Hkv, T, D] post-RoPE: held until every layer has arrived."""
        self._k.append(k)
        self._v.append(v)
        if self.method.needs_queries:
            self._q.append(q)

    def _probe(self, b: int, x: torch.Tensor):
        p = int(self.cursor.pad[b])
        return self.spec.probe(x, [(k[b:b + 1, :, p:], v[b:b + 1, :, p:]) for k, v in zip(self._k, self._v)])

    def end_prefill(self) -> None:
        spec, B, T = self.spec, self._B, self._T
        if len(self._k) != spec.n_layers:
            raise RuntimeError(f"MethodStore: expected {spec.n_layers} layers in prefill, got {len(self._k)}")
        c = self.cursor
        valid = (self._slots[None, :T] >= c.pad[:B, None]) if c.any_pad else None
        prefill = Prefill(self._k, self._v, self._q if self.method.needs_queries else None, spec.head_dim ** -0.5,
                          valid, self._ids, self._probe, spec.rope_at, self.tokenizer)
        self.layers = self.method.fit(prefill)
        self.fit_info = {"fit": self.method.describe(self.layers, prefill)}
        arena = self.backend.caps.native and torch.device(spec.device).type == "cpu"
        for l in self.layers:
            if self.device_layout:
                l.block_exact_k()                          # 16-bit keys in the fused kernel's blocked layout
                l.pad_to_buckets()                         # requests that round alike share one compiled step
            l.reserve(1 << max(0, spec.max_seq_len - T - 1).bit_length())   # room to the end, a power of two
            if arena:                                      # our kernel streams them every token: huge pages
                l.place(kernel_ops.arena_zeros)
        self._register_layout()
        self._k, self._v, self._q = [], [], []            # the prompt's dense K/V are freed

    # ------------------------------------------------------------------ the fused decode layer
    def fused_tiers_unavailable(self) -> str | None:
        """Why the engine's fused decode layer (``runtime/kernels/layer.py``: one op per layer, RoPE, the append and
        this store's attention inside) cannot serve this store (None: it can): the tiered attention must be our fused
        kernel (``lrk_tiers``, which the op calls: ``BackendCaps.in_fused_layer``) and the method must append each token's exact k / v
        (``KVMethod.append``, what the op writes; AttSVD's stream mode, for one, folds tokens into its basis)."""
        if self.backend is None or not self.backend.caps.in_fused_layer:
            name = None if self.backend is None else self.backend.name
            return f"tiered attention {name}, not a kernel the fused layer runs (the fused lrk_tiers kernel)"
        if type(self.method).append is not KVMethod.append:
            return f"{type(self.method).__name__} appends tokens its own way"
        return None

    def fused_tier_args(self, layer: int) -> tuple:
        """The tiered layout of ``layer`` as ``lowrank_lrk::decode_layer_tiers`` reads it: k_new, v_new (written at
        row ``cursor.length - t0``), the fitted tiers, and t0 (the prompt length, a device scalar)."""
        L = self.layers[layer]
        return (L.k_new, L.v_new, L.k_exact, L.v_exact, L.e_off, L.runs, L.r_off, L.a_k, L.a_v, L.b_k, L.b_v,
                L.k_scale, L.v_scale, self._t_dev)

    def fused_tier_layout(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(layout, t0) as ``lowrank_lrk::decode_stack_tiers`` reads them: ``layout`` a [1] int64 tensor holding the
        id of this prefill's layers validated once by the library (``ops.tier_layout``, made at the end of the prefill
        and dropped at the next one or with the store: the same tensor for every request, so a compiled step replays),
        t0 the prompt length. Id 0 (no layout: the fused path cannot serve this store, or no prefill yet) is refused by
        the op."""
        return self._layout, self._t_dev

    def _register_layout(self) -> None:
        """Drop the previous prefill's tier layout; where the fused step can serve this store, validate the new
        layers once (``ops.tier_layout``) and publish the id in ``self._layout``."""
        _drop_layouts(self._layout_ids)
        self._layout.fill_(0)
        if self.fused_tiers_unavailable() is not None or not self.layers:
            return
        per = [self.fused_tier_args(i) for i in range(len(self.layers))]
        lid = kernel_ops.tier_layout(tuple([p[j] for p in per] for j in range(13)), self.spec.n_kv_heads)
        self._layout_ids.append(lid)
        self._layout.fill_(lid)

    def fused_appended(self, layer: int) -> None:
        """The fused op appended one row to ``layer``: an eager step counts it on the host (as ``TieredLayer.append``
        does); under graphs the count is the cursor's."""
        if not self.spec.graphs:
            self.layers[layer].n_new += 1

    # ------------------------------------------------------------------ decode
    def step_context(self, B: int, live: int | None, rope: torch.Tensor) -> TierStep:
        pos = self.cursor.length
        if live is None:                                   # graphs: device-side counts
            return TierStep(B, 1, False, rope, None, pos, None, pos - self._t_dev + 1, pos - self._t_dev)
        return TierStep(B, 1, False, rope, None, pos, live, None, None)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor, ctx: TierStep) -> None:
        """The current token's k/v [B, Hkv, 1, D] through the method (at the device slot under graphs)."""
        self.method.append(self.layers[layer], k, v, ctx.slot)

    def attend(self, layer: int, q: torch.Tensor, ctx: TierStep) -> torch.Tensor:
        """q [B, Hkv, G, D] -> [B, Hq * D]: every tier and the appended rows, one softmax."""
        B, Hkv, G, D = q.shape
        o = self.method.attend(self.layers[layer], q.reshape(B, Hkv * G, 1, D), D ** -0.5, ctx.n_new, self._tier)
        return o.reshape(B, Hkv * G * D)
