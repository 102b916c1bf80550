"""The KV decode-speed measurement behind ``python -m lowrank_lib.bench kv-decode``: KV methods served by the engine
adapter against the engine's dense store, the same context, the same step mode, interleaved repeats.

Per context and thread count, each system is its own :class:`~lowrank_lib.runtime.Engine` (the dense store, or a
:class:`~lowrank_lib.kv.engine_adapter.MethodStore` of a registry method at a budget) that prefilled the same
prompt (each step one fused op per layer where the engine can, ``fused_layer`` in each row: the dense store's
``decode_layer`` or a tiered store's ``decode_layer_tiers``); decode ms/token is the median over every step of every round (:mod:`lowrank_lib.timing`); attention ms/token is the
median time of one decode attention of every layer through the store
(:func:`lowrank_lib.runtime.profiling.decode_attention`, after the last step), twice: back to back (``attn_ms_per_token``,
what the rows up to kv_decode_41 hold) and each call after a flush of the CPU caches (``attn_cold_ms_per_token``,
:func:`lowrank_lib.host.cache_flusher`). Inside a step the weights stream through the caches between two attentions,
so the cold time is the one a step pays; back to back, a store that fits in the last-level cache (the composed cache
at the small budgets) is read from the cache and looks faster than it is in a step. Everything a row says comes from the engine's own report: the step mode, the attention kernel and why.
"""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

__all__ = ["KVDecodeConfig", "SPEED_CONTEXT", "SPEED_TARGETS", "build_engines", "kv_decode", "table", "targets"]

#: issue 29's targets for the composed cache (a method named ``composed*``) at an 8k context: decode speed against
#: the dense store of the same run, at least ``bound`` x at each ``budget``, at every thread count (data, as
#: ``eval.peer_targets.TARGETS`` are for the peer runs)
SPEED_CONTEXT = 8000
SPEED_TARGETS = ((0.5, 1.15), (0.25, 1.3), (0.125, 1.4))


@dataclass
class KVDecodeConfig:
    """What ``bench kv-decode`` measures (the command's options)."""

    model: str = "smollm2"
    prompt_len: list[int] = field(default_factory=lambda: [8000])          # context lengths
    methods: list[str] = field(default_factory=lambda: ["composed-kvzip-q8"])
    budget: list[float] = field(default_factory=lambda: [0.5, 0.25, 0.125])
    gen_len: int = 32                     # decode steps timed per round and system
    repeats: int = 3                      # rounds
    threads: list[int] = field(default_factory=lambda: [1])
    # the engine's step mode for every system: "none" (eager, the engine's own default and what `bench peer` runs; at
    # 8k, 1 thread as fast as the compiled whole step or faster: dense 29.6 / 29.3 ms in kv_decode_12 / _13 against 30.1
    # in _11) or "whole-step"
    graph: str = "none"
    # every engine's dtype: None (the model's own: fp32 for the dequantised SmolLM2, every run up to kv_decode_13) or
    # "bf16" (what `bench peer` measures, half the KV bytes)
    dtype: str | None = None
    attention: str = "auto"               # MethodStore attention backend
    seed: int = 0

    def to_dict(self) -> dict:
        return asdict(self)


def build_engines(cfg: KVDecodeConfig, model, tok, ids, C: int) -> dict:
    """{(label, budget): engine} for the dense store and every method at every budget, each prefilled on
    ``ids[:, :C]`` (its own prefill: a method fits inside its engine, KVzip's reconstruction forward included)."""
    import time

    from ..kv import MethodStore, make_method
    from ..runtime import Engine, EngineConfig

    ecfg = EngineConfig(max_batch=1, max_seq_len=C + cfg.gen_len * cfg.repeats * len(cfg.threads) + 8, graph=cfg.graph,
                        dtype=cfg.dtype)
    systems = [("dense", None)] + [(m, b) for m in cfg.methods for b in cfg.budget]
    out = {}
    for label, b in systems:
        kv = None if b is None else MethodStore(make_method(label, b), tok, cfg.attention)
        eng = Engine(model, ecfg, kv=kv)
        t0 = time.perf_counter()
        eng.prefill(ids[:, :C])
        eng.prepare(1)                      # compile / capture apart from the timed steps
        print(f"context {C}: {label}{'' if b is None else f'@{b:g}'} prefill+fit+compile "
              f"{time.perf_counter() - t0:.1f} s", flush=True)
        out[(label, b)] = eng
    return out


def kv_decode(cfg: KVDecodeConfig, on_context=None) -> dict:
    """Run the measurement; ``on_context(result_so_far)`` after every context (the command rewrites its file there).
    Returns {rows, config, machine, load_average, copy_gbs, note}."""
    import torch

    from .. import models
    from ..host import cache_flusher, copy_bandwidth, load_average, machine
    from ..runtime.profiling import decode_attention, greedy_steps
    from ..timing import interleaved, summary
    from .kv_sweep import frontier_windows

    model, tok = models.load(cfg.model)
    model.eval()
    meta = {"config": cfg.to_dict(), "machine": machine(), "load_average": {"start": load_average()},
            "copy_gbs": round(copy_bandwidth(torch.device("cpu")), 2), "note": "interleaved rounds (rotated order), medians over every step; "
            "attention = one decode attention of every layer through the store (runtime.profiling.decode_attention), back to "
            "back (attn_ms_per_token) and after a flush of the CPU caches (attn_cold_ms_per_token: what a step pays)"}
    flush = cache_flusher()
    rows: list[dict] = []
    for C in cfg.prompt_len:
        ids = frontier_windows(tok, model, 1, C + 1, cfg.seed)[:1]
        engines = build_engines(cfg, model, tok, ids, C)
        tok_next = {k: ids[:, C] for k in engines}

        for th in cfg.threads:
            torch.set_num_threads(th)
            if th != cfg.threads[0]:        # a compiled step keeps the thread count it was compiled with
                for eng in engines.values():
                    eng.invalidate()
                    eng.prepare(1)
            with torch.no_grad():
                steps = interleaved(greedy_steps(engines, tok_next), cfg.repeats, cfg.gen_len,
                                    progress=lambda r: print(f"context {C}, {th} thread(s): round {r + 1}/"
                                                             f"{cfg.repeats}", flush=True))
                attn = interleaved({k: decode_attention(e) for k, e in engines.items()}, cfg.repeats, 5)
                cold = interleaved({k: decode_attention(e) for k, e in engines.items()}, cfg.repeats, 5, before=flush)
            d_ms, d_at = summary(steps[("dense", None)])["median_ms"], summary(attn[("dense", None)])["median_ms"]
            d_cold = summary(cold[("dense", None)])["median_ms"]
            for (label, b), eng in engines.items():
                rep = eng.report()
                st, at, ac = summary(steps[(label, b)]), summary(attn[(label, b)]), summary(cold[(label, b)])
                fit = rep["kv_store"].get("fit", {})
                rows.append(dict(
                    system=label, budget=b, context=C, threads=th, dtype=str(eng.dtype).replace("torch.", ""),
                    graph=rep["graph"], graph_impl=rep["graph_impl"],
                    fused_layer=rep["fused_layer"], fused_layer_reason=rep["fused_layer_reason"],
                    attention_kernel=(rep["kv_store"].get("attention") or rep["backend"]),
                    attention_reason=rep["backend_reason"], gemv=rep["gemv"],
                    decode_ms_per_token=round(st["median_ms"], 3), decode_iqr_ms=[round(st["q1_ms"], 3),
                                                                                  round(st["q3_ms"], 3)],
                    attn_ms_per_token=round(at["median_ms"], 3), ratio_vs_dense=round(st["median_ms"] / d_ms, 3),
                    speedup_vs_dense=round(d_ms / st["median_ms"], 3), attn_ratio_vs_dense=round(at["median_ms"] / d_at, 3),
                    attn_cold_ms_per_token=round(ac["median_ms"], 3),
                    attn_cold_ratio_vs_dense=round(ac["median_ms"] / d_cold, 3),
                    kv_bytes_held=rep["kv_cache_bytes"] if b is None else fit.get("bytes_held"),
                    bytes_ratio=1.0 if b is None else fit.get("bytes_ratio"),
                    compiles_s=[round(c.get("seconds", 0.0), 2) for c in rep["compiles"]]))
        # the kernel features the engines ran with: all the CPU has, or fewer under $LOWRANK_LIB_ISA (an AVX2 run on
        # an AVX-512 host is the AVX2 code on this host's memory, not an AVX2 host)
        isa = (rep.get("kernels") or {}).get("isa")
        meta["kernel_isa"] = {**({"limit": os.environ["LOWRANK_LIB_ISA"]} if os.environ.get("LOWRANK_LIB_ISA") else {}),
                              **({"flags": isa} if isa is not None else {})}
        meta["load_average"][f"after_context_{C}"] = load_average()
        if on_context is not None:
            on_context({"rows": rows, "targets": targets(rows, cfg.model), **meta})
        engines.clear()                     # free this context's engines before the next
    return {"rows": rows, "targets": targets(rows, cfg.model), **meta}


def targets(rows: list[dict], shape: str | None = None) -> list[dict]:
    """:data:`SPEED_TARGETS` on every row they apply to (a composed method at :data:`SPEED_CONTEXT` tokens, at one
    of the budgets): the row's identity, the target, its bound and direction, the measured speed-up, whether met (the
    records of ``eval.peer_targets.evaluate``, plus ``budget`` and ``context``; ``shape``: the model, as the config
    names it)."""
    bounds = dict(SPEED_TARGETS)
    out = []
    for r in rows:
        b = r.get("budget")
        if r["system"].startswith("composed") and r["context"] == SPEED_CONTEXT and b in bounds:
            out.append({"shape": shape, "system": r["system"], "dtype": r["dtype"], "keep": None, "budget": b,
                        "context": r["context"], "lm_head": None, "threads": r["threads"], "factor_bits": None,
                        "target": f"composed_speedup_b{b:g}", "key": "speedup_vs_dense", "op": ">=",
                        "bound": bounds[b], "issue": 29, "measured": r["speedup_vs_dense"],
                        "met": r["speedup_vs_dense"] >= bounds[b]})
    return out


def _cold(r: dict) -> str:
    """The cold attention columns of a row (blank for rows written before they were measured)."""
    if r.get("attn_cold_ms_per_token") is None:
        return f"{'':>8} {'':>8}"
    return f"{r['attn_cold_ms_per_token']:>8.3f} {r['attn_cold_ratio_vs_dense']:>8.3f}"


def table(rows: list[dict]) -> str:
    head = (f"{'context':>7} {'thr':>3} {'system':<22}{'budget':>7} {'graph':<11}{'attention':<12}{'ms/tok':>8} "
            f"{'x dense':>8} {'attn ms':>8} {'x dense':>8} {'cold ms':>8} {'x dense':>8} {'bytes':>7}")
    lines = [head]
    for r in rows:
        b = "" if r["budget"] is None else f"{r['budget']:.3f}"
        lines.append(f"{r['context']:>7} {r['threads']:>3} {r['system']:<22}{b:>7} {r['graph']:<11}"
                     f"{r['attention_kernel']:<12}{r['decode_ms_per_token']:>8.2f} {r['ratio_vs_dense']:>8.3f} "
                     f"{r['attn_ms_per_token']:>8.3f} {r['attn_ratio_vs_dense']:>8.3f} {_cold(r)} {r['bytes_ratio']:>7.3f}")
    lines += [f"target {t['target']} ({t['system']}, {t['threads']} thread(s), issue {t['issue']}): "
              f"{t['measured']:.3f} vs {t['op']} {t['bound']}: " + ("met" if t["met"] else "NOT met")
              for t in targets(rows)]
    return "\n".join(lines)
