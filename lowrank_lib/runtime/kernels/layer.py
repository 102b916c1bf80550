"""The fused decode layer (``layer.cpp``): whether an engine's decode step runs ONE op per layer, and its arguments.

``EngineConfig(fused_layer=...)``: ``"auto"`` (where it can run, else today's step, with the reason), ``"off"``
(never) or ``"on"`` (always, or an error saying why not). It can run when what the op fuses is what the engine
would run anyway, decided from capabilities, never from backend names:

- the decode GEMVs are our packed kernels (:attr:`GemvChoice.packed`; ``kernels="portable"`` rules them out);
- the KV store is the dense store itself (:class:`~lowrank_lib.runtime.kv.dense.DenseKV`, not a subclass) and its
  attention backend is the native kernel the op runs inside itself (``BackendCaps.in_fused_layer``: ``lrk_attend``,
  reading the ``bhsd`` buffer and the cursor from memory); or a store that offers the tiered layout of
  ``lowrank_lib.kv`` (its ``fused_tiers_unavailable()``, part of the ``KVStore`` protocol, returns None:
  ``kv.MethodStore`` with a tiered attention the op runs, ``lrk_tiers``, and a method that appends each token's exact
  k / v), which the op then reads with ``tiers.cpp``'s kernel (``lowrank_lrk::decode_layer_tiers``); any other store
  keeps its own append / attend;
- every projection group is packed (one stage-1 matrix: ``pack_qkv`` / ``pack_mlp``), its low-rank members in one
  segmented stage-2 call: fp32 / bf16 packs (``lrk::pack``), or quantized factors (int8 / int4,
  :class:`~lowrank_lib.runtime.packing.QuantizedProjectionGroup` with its ``qgemv`` blobs: where the packed
  ``qgemv`` kernel has code for this CPU, else the group runs ``qmatmul`` and the step stays per-op); each group of a
  layer is either kind, and says so itself (``ProjectionGroup.fused_readable()``);
- the MLP activation is SiLU; at most :data:`~lowrank_lib.runtime.kernels.gemv.LRK_MAX_ROWS` rows (``max_batch``).

:class:`FusedLayer` holds one layer's weight list and integer description (``layer.cpp``'s header gives the format);
it becomes a plan of ``layer.cpp`` (parsed once); calling it is one ``torch.ops.lowrank_lrk.decode_layer`` (or
``decode_layer_tiers``) call naming the plan. On the dense store the engine runs all its layers as one
:class:`FusedStack` (``lowrank_lib.runtime.kernels.layer``'s ``decode_stack``: one call per step, one extern call in a
``torch.compile``-d step); on a tiered store, and while a profiler marks layers (``Engine.layer_sections``), one call
per layer.

:func:`phase_times` reads the op's own phase timers (:data:`PHASES`): where a decode token's time goes inside the
layers (issue 29's breakdown; ``lowrank_lib.runtime.profiling.token_breakdown`` turns them into ms per token).
"""
from __future__ import annotations

import weakref
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from . import ops

FUSED_MODES = ("auto", "off", "on")
#: decode_layer's timed phases, in layer.cpp's order: the call's checks / plan lookup / scratch (prolog), both RMSNorms,
#: the four projection groups' GEMVs, RoPE + the KV write, attention, the residual adds, SiLU(gate) * up
PHASES = ("prolog", "rmsnorm", "qkv_gemv", "rope_kv_write", "attention", "o_gemv", "residual", "gate_up_gemv",
          "silu_mul", "down_gemv")
#: the phases that are GEMVs (weights streamed), by the engine group each reads
GEMV_PHASES = {"qkv_gemv": "qkv", "o_gemv": "o", "gate_up_gemv": "gate_up", "down_gemv": "down"}


@contextmanager
def phase_times():
    """Turn decode_layer's phase timers on for the block; the yielded dict then holds ``calls`` and the seconds
    spent in each of :data:`PHASES` by the fused-layer calls inside it (summed over calls and layers)."""
    ops.layer_profile(True)                      # drops what an earlier block left
    got: dict = {}
    try:
        yield got
    finally:
        calls, *ns = ops.layer_profile(False)
        got.update(calls=calls, **{p: n * 1e-9 for p, n in zip(PHASES, ns)})


@dataclass(frozen=True)
class FusedChoice:
    """Whether the decode step runs the fused layer op, and why."""

    enabled: bool
    reason: str

    @property
    def name(self) -> str:
        return "lrk_decode_layer" if self.enabled else "per-op"


def fused_layer_unavailable(gemv, store, groups, act_is_silu: bool, max_batch: int) -> str | None:
    """Why the fused layer cannot serve this engine (None: it can)."""
    from ..kv.dense import DenseKV
    from .gemv import LRK_MAX_ROWS

    if not gemv.packed:
        return f"the decode GEMVs run {gemv.name} ({gemv.reason})"
    if type(store) is not DenseKV:
        why = store.fused_tiers_unavailable()
        if why is not None:
            return f"the {store.name!r} KV store keeps its own append and attention ({why})"
    elif not store.backend.caps.in_fused_layer:
        return (f"the dense store's attention is {store.backend.name} ({store.backend.reason}), not the native kernel "
                f"the fused layer runs")
    if not all(g.pack for g in groups):
        return ("a projection group is not packed (pack_qkv / pack_mlp off, or a quantized group with a dense "
                "member)")
    slow = next((g for g in groups if g.quantized and g.qgemv_reason is not None), None)
    if slow is not None:
        return f"the quantized group {'/'.join(slow.names)} cannot run qgemv ({slow.qgemv_reason})"
    odd = next((g for g in groups if not g.fused_readable()), None)
    if odd is not None:
        return (f"the group {'/'.join(odd.names)} is not one packed stage-1 matrix and one segmented stage-2 call of "
                f"our kernels")
    if not act_is_silu:
        return "the MLP activation is not SiLU"
    if max_batch > LRK_MAX_ROWS:
        return f"max_batch {max_batch} > {LRK_MAX_ROWS} rows (the packed kernel's decode limit)"
    return None


def quant_summary(groups) -> str:
    """``"int8 group 32 factors through qgemv (avx512_vnni) in 96 of 120 groups"``, or "" without quantized groups."""
    q = [g for g in groups if g.quantized]
    if not q:
        return ""

    kinds = sorted({(g.bits, g.group) for g in q}, reverse=True)
    what = " / ".join(f"int{b} group {gr}" for b, gr in kinds)
    return f"{what} factors through qgemv ({ops.qgemv_isa()}) in {len(q)} of {len(groups)} groups"


def select_fused_layer(mode: str, gemv, store, groups, act_is_silu: bool, max_batch: int) -> FusedChoice:
    """The decode-step form of an engine (``EngineConfig.fused_layer``), with the reason."""
    if mode not in FUSED_MODES:
        raise ValueError(f"fused_layer={mode!r}: use one of {FUSED_MODES}")
    if mode == "off":
        return FusedChoice(False, "requested: fused_layer='off'")
    why = fused_layer_unavailable(gemv, store, groups, act_is_silu, max_batch)
    if why is None:
        qs = quant_summary(groups)
        return FusedChoice(True, f"{'requested' if mode == 'on' else 'auto'}: one lowrank_lrk::decode_layer call per "
                                 f"layer ({gemv.name} GEMVs, {store.backend.name} attention{'; ' + qs if qs else ''})")
    if mode == "on":
        raise RuntimeError(f"fused_layer='on' cannot run: {why}")
    return FusedChoice(False, f"auto: per-op step ({why})")


def _describe(g) -> tuple[list[int], list[torch.Tensor]]:
    """One packed ProjectionGroup as layer.cpp reads it: qbits, qgroup, rows1, has_b1, nseg, (out, in, xoff)*, has_b2,
    nmem, (src, off, width)* and its tensors S, [b1], U*, [b2] (a quantized group: qpack blobs, bits and group)."""
    if g.quantized:
        seg = g.qseg
        S, Ps = g.S_q, [] if seg is None else [g.U_q[i].P for i in seg["members"]]
        meta = [g.bits, g.group]
    else:
        seg = g.seg
        S, Ps = g.S_p, [] if seg is None else list(seg["Ps"])
        meta = [0, 0]
    meta += [S.out, int(g.S_bias is not None)]
    ws = [S.P] + ([g.S_bias] if g.S_bias is not None else [])
    y_off = {}
    if seg is None:
        meta += [0, 0]
    else:
        meta.append(len(Ps))
        at = 0
        for i, o, n, xo in zip(seg["members"], seg["outs"], seg["ins"], seg["xoffs"]):
            meta += [o, n, xo]
            y_off[i] = at
            at += o
        ws += Ps
        meta.append(int(seg["bias"] is not None))
        ws += [seg["bias"]] if seg["bias"] is not None else []
    meta.append(len(g.members))
    for i, m in enumerate(g.members):
        if i in y_off:
            meta += [1, y_off[i], g.out_features[i]]
        else:
            meta += [0, g.offsets[m.first], g.sizes[m.first]]
    return meta, ws


class FusedLayer:
    """One engine layer as a plan of ``layer.cpp`` (``lowrank_lrk::layer_plan``: its weight list and integer
    description parsed once, the tensors held by the plan until this object is collected); a call passes the plan's
    id, so a decode step's layer costs one cheap op call (issue 29: the list marshalling and parsing cost ~20 us per
    layer)."""

    def __init__(self, engine, i: int):
        L = engine.layers[i]
        self.i = i
        self.meta: list[int] = []
        self.w: list[torch.Tensor] = []
        for g in (L.qkv, L.o, L.gate_up, L.down):
            m, ws = _describe(g)
            self.meta += m
            self.w += [t.contiguous() for t in ws]
        # a folded norm weight lives in an fp32 / bf16 group's stage-1 matrix; a quantized group keeps it as x_scale
        # (x * w after the unweighted norm: the op's norm with that weight, the same product and rounding)
        norm = lambda ln, g: (g.x_scale if g.quantized else None) if engine.fold_norm else ln
        self.ln1 = norm(L.ln1, L.qkv)
        self.ln2 = norm(L.ln2, L.gate_up)
        # the last layer also applies the model's final norm (the engine's _norm before the LM head)
        self.final = i == engine.n_layers - 1
        self.plan = ops.layer_plan(self.ln1, self.ln2, self.w, self.meta, engine.hidden, engine.head_dim,
                                   engine.dtype == torch.bfloat16, engine.eps, engine.n_heads, engine.n_kv, engine.fold,
                                   self.final, None if engine.fold_norm or not self.final else engine.norm)
        weakref.finalize(self, _drop_plan, self.plan)
        # the dense store's buffer, or a tiered store's layout: select_fused_layer admitted the dense store itself or
        # a store whose fused_tiers_unavailable() is None (the tiered protocol: fused_tier_args, fused_appended), the
        # same test here
        from ..kv.dense import DenseKV

        self.tiered = type(engine.kv) is not DenseKV

    def __call__(self, x: torch.Tensor, rope: torch.Tensor, store, length: torch.Tensor,
                 pad: torch.Tensor) -> torch.Tensor:
        """x [B, H] -> the layer's output (the last layer's: after the model's final norm, what the LM head reads);
        the token's k / v go to ``store`` (the engine's KV store: the dense buffer, or a tiered store's appended rows,
        whose layout the op's attention reads)."""
        if not self.tiered:
            return ops.decode_layer(x, self.plan, rope, store.kv, self.i, length, pad)
        out = ops.decode_layer_tiers(x, self.plan, rope, *store.fused_tier_args(self.i), length, pad)
        store.fused_appended(self.i)
        return out


class FusedStack:
    """Every :class:`FusedLayer` of an engine, run in order by ONE call per step: ``lowrank_lrk::decode_stack`` on the
    dense store, ``decode_stack_tiers`` on a tiered one (the store's ``fused_tier_layout``), both on a team of the
    kernel pool's threads (the per-layer Python and dispatcher round trip, ~4-5 % of a SmolLM2 token at one thread,
    paid once; on the composed cache at 3k tokens, paired: 13.94 -> 12.95 ms a step at 2 threads, 20.92 -> 20.78 at
    1). Holds the layers, so their plans live as long as it does."""

    def __init__(self, layers: list[FusedLayer]):
        if not layers or [f.i for f in layers] != list(range(len(layers))) or len({f.tiered for f in layers}) != 1:
            raise ValueError("FusedStack: every layer of the engine, in order, on one store")
        self.layers = layers
        self.plans = [f.plan for f in layers]
        self.tiered = layers[0].tiered

    def __call__(self, x: torch.Tensor, rope: torch.Tensor, store, length: torch.Tensor,
                 pad: torch.Tensor) -> torch.Tensor:
        """x [B, H] (the embedding) -> the last layer's output; every token's k / v go to ``store.kv`` (the dense
        store) or to each tiered layer's appended rows."""
        if not self.tiered:
            return ops.decode_stack(x, self.plans, rope, store.kv, length, pad)
        layout, t0 = store.fused_tier_layout()
        out = ops.decode_stack_tiers(x, self.plans, rope, layout, t0, length, pad)
        for f in self.layers:
            store.fused_appended(f.i)
        return out


def _drop_plan(plan: int) -> None:
    try:
        ops.drop_layer_plan(plan)
    except Exception:           # interpreter shutdown: the library may be gone already
        pass
