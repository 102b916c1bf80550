"""Counting what one decoded token costs: ATen dispatches (CPU) and kernel launches (CUDA).

**A dispatch** (THE definition notebooks 02 and 03 share): one ATen operator (or one call of our compiled
kernels, ``lowrank_lrk::``) reaching the dispatcher during a greedy decode step -- the runner's ``step`` plus the
argmax that picks the next token -- recorded by :class:`DispatchCounter` (a ``TorchDispatchMode``: views and in-place
ops included, as the Python->C++ overhead is paid per op), averaged over :data:`DISPATCH_TOKENS` steps after one
warm step (:func:`per_token_counts`). Eager runners are also broken down per decoder layer (the ops dispatched while
layer i runs; the rest -- embedding, final norm, LM head, argmax, the step's RoPE / context -- is ``outside_layers``).
``count_cuda_launches`` uses ``torch.profiler`` and counts host-side launch API calls
(``cudaLaunchKernel``/``cuLaunchKernel``/``cudaGraphLaunch``/memcpy/memset): a graph replay is ONE
launch, as in the paper's 1174 -> 54 count.

Where a token's time goes: :func:`token_breakdown` (the fused layer op's own phase timers: GEMVs, attention,
elementwise work, the op's fixed cost, and the rest of the step).

Timing runners side by side: :func:`timed_generations` (warm-up, then interleaved generations through the shared
decode loop) and :func:`greedy_steps` (one greedy step per runner, the unit of interleaved step timings).
"""
from __future__ import annotations

import gc
from collections import Counter
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from tqdm.auto import tqdm

from ..generation import greedy, run_generation
from ..timing import interleaved_samples
from .runner import Runner

__all__ = ["count_cuda_launches", "DISPATCH_TOKENS", "count_profiled_aten_ops", "CUDA_LAUNCH_NAMES", "decode_attention",
           "DispatchCounter", "greedy_steps", "layer_sections", "op_class", "OP_CLASSES", "per_token_counts", "timed_generations",
           "token_breakdown", "breakdown_table"]

OP_CLASSES = {
    "gemm": ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_int_mm", "mv", "dot", "gemv"),
    "attention": ("scaled_dot_product", "flash", "efficient_attention", "softmax", "_safe_softmax", "attend"),
    # our fused decode layer (runtime/kernels/layer.cpp): a whole layer in one call (decode_layer, decode_layer_tiers),
    # or every layer of the dense store in one call (decode_stack)
    "layer": ("decode_layer", "decode_layer_tiers", "decode_stack", "decode_stack_tiers"),
    "view": ("view", "_unsafe_view", "reshape", "transpose", "t", "permute", "slice", "select", "expand",
             "unsqueeze", "squeeze", "split", "split_with_sizes", "chunk", "as_strided", "alias", "unbind",
             "narrow", "detach", "_reshape_alias", "unflatten"),
    "copy/index": ("copy_", "cat", "index_copy_", "index_copy", "index", "index_put_", "index_select",
                   "clone", "contiguous", "_to_copy", "to", "embedding", "gather", "scatter", "stack",
                   "fill_", "zero_", "zeros", "empty", "ones", "full", "new_ones", "new_zeros", "arange",
                   "masked_fill_", "masked_fill", "where", "scalar_tensor", "empty_like", "zeros_like",
                   "lift_fresh", "_local_scalar_dense", "item", "new_empty", "empty_strided"),
}


def op_class(name: str) -> str:
    """'aten.mm.default' -> 'gemm' (our kernels' 'lowrank_lrk.gemv.default' too); elementwise/reductions
    default to 'elementwise'."""
    base = name.split(".")[1] if name.startswith(("aten.", "lowrank_lrk.")) else name.split(".")[0]
    if any(n in base for n in OP_CLASSES["attention"]):
        return "attention"
    for cls, names in OP_CLASSES.items():
        if base in names:
            return cls
    return "elementwise"


#: decode steps every dispatch count averages over (after one warm step): one number for notebooks 02 and 03
DISPATCH_TOKENS = 4


class DispatchCounter(TorchDispatchMode):
    """Counts ATen operators dispatched inside the ``with`` block (``counts``: op name -> n); ``by_section``: the
    same ops by the value ``section`` held when each was dispatched (``None`` unless a caller sets it, e.g. the
    decoder layer running: :func:`layer_sections`).

    Python's cyclic garbage collector is run on entry and held off inside the block: a finalizer of an object that
    died earlier (a dropped engine's ``weakref.finalize`` releasing its kernel plans, any ``__del__`` that calls an
    op) would otherwise run whenever an allocation inside the block triggers a collection, and its ops would be
    counted as the block's (seen as a flaky per-token count: 266.0 vs 266.67 in one test order)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()
        self.section = None
        self.by_section: Counter = Counter()
        self._gc_was_enabled = False

    def __enter__(self):
        gc.collect()
        self._gc_was_enabled = gc.isenabled()
        gc.disable()
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            if self._gc_was_enabled:
                gc.enable()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        self.by_section[self.section] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_class(self) -> dict[str, int]:
        out: Counter = Counter()
        for k, n in self.counts.items():
            out[op_class(k)] += n
        return dict(out)


CUDA_LAUNCH_NAMES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cudaGraphLaunch",
                     "cudaMemcpyAsync", "cudaMemsetAsync", "cuLaunchKernelEx")


def count_cuda_launches(fn, *args, **kw) -> tuple[int, dict[str, int]]:
    """Run fn under torch.profiler; return (host launch calls, their names' counts)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn(*args, **kw)
        torch.cuda.synchronize()
    c: Counter = Counter()
    for e in prof.events():
        if any(e.name.startswith(n) for n in CUDA_LAUNCH_NAMES):
            c[e.name] += 1
    return sum(c.values()), dict(c)


def count_profiled_aten_ops(fn, *args, **kw) -> Counter:
    """Top-level ``aten::`` ops recorded by torch.profiler while fn runs (works inside compiled code,
    where a TorchDispatchMode cannot run): ops called from Python / generated code, not the ops
    they dispatch internally. Inductor's fused C++ kernels are NOT dispatcher calls and are not
    counted; the GEMMs they call out to (``aten::mm``/``addmm``) are."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn(*args, **kw)
    ours = ("aten::", "lowrank_lrk::")         # lowrank_lrk: our compiled kernels (runtime/kernels), one call each
    c: Counter = Counter()
    for e in prof.events():
        if not e.name.startswith(ours):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith(ours):
            p = p.cpu_parent
        if p is None:
            c[e.name.replace("::", ".", 1)] += 1
    return c


@contextmanager
def layer_sections(runner: Runner, counter: DispatchCounter):
    """While inside, ``counter.section`` is i while decoder layer i of the eager ``runner`` runs (None elsewhere), by
    the runner's own :meth:`~lowrank_lib.runtime.runner.Runner.layer_sections`. Yields whether the runner has
    layers to mark."""
    undo = runner.layer_sections(lambda i: setattr(counter, "section", i))
    try:
        yield undo is not None
    finally:
        if undo is not None:
            undo()


def per_token_counts(runner: Runner, input_ids: torch.Tensor, n_tokens: int = DISPATCH_TOKENS,
                     attention_mask=None) -> dict:
    """Prefill, then count over ``n_tokens`` greedy decode steps of a :class:`Runner`; returns per-token averages
    (a compiled / captured runner is counted by the profiler: a dispatch mode cannot run inside compiled code).

    {'total': dispatches (CPU) or launches (CUDA) per token, 'by_class': {...}, 'kind': ...}; an eager runner on
    CPU adds 'per_layer' (the dispatches per token of each decoder layer, measured) and 'outside_layers'.
    """
    dev = runner.device
    logits = runner.prefill(input_ids, attention_mask)
    runner.prepare(input_ids.shape[0])
    tok = greedy(logits)
    logits = runner.step(tok)          # one warm step outside the count (lazy init, first-call paths)
    tok = greedy(logits)
    if dev.type == "cuda":
        def run():
            t = tok
            for _ in range(n_tokens):
                t = greedy(runner.step(t))
        total, names = count_cuda_launches(run)
        return {"kind": "cuda_launches", "total": total / n_tokens,
                "by_class": {k: v / n_tokens for k, v in names.items()}}
    t, layers = tok, {}
    if runner.compiled:
        def run():
            t = tok
            with torch.no_grad():
                for _ in range(n_tokens):
                    t = greedy(runner.step(t))
        counts = count_profiled_aten_ops(run)
        kind = "aten_ops_profiler (compiled step: fused kernels not counted)"
    else:
        counter = DispatchCounter()
        with layer_sections(runner, counter) as found, counter, torch.no_grad():
            for _ in range(n_tokens):
                logits = runner.step(t)
                t = greedy(logits)
        counts, kind = counter.counts, "aten_dispatches"
        if found:
            n_layers = 1 + max((k for k in counter.by_section if k is not None), default=-1)
            layers = {"per_layer": [counter.by_section.get(i, 0) / n_tokens for i in range(n_layers)],
                      "outside_layers": counter.by_section.get(None, 0) / n_tokens}
    # the argmax (sampling) is part of every system's loop; it is counted too
    by_class: Counter = Counter()
    for k, n in counts.items():
        by_class[op_class(k)] += n
    return {"kind": kind, "total": sum(counts.values()) / n_tokens,
            "by_class": {k: v / n_tokens for k, v in sorted(by_class.items())},
            "ops": {k: v / n_tokens for k, v in counts.most_common()}, **layers}


def decode_attention(engine, q: torch.Tensor | None = None):
    """One decode step's attention of every layer of ``engine``, through its KV store, as a function to call (and
    time): each call reads what the store holds at the engine's position (the store's ``step_context`` and
    ``attend``, the KVStore protocol), appends nothing and moves no cursor, so it runs any number of times after a
    prefill or between steps. ``q`` [B, Hkv, G, D]: the query every layer attends with (default: a seeded random
    one, batch 1, in the engine's dtype). An eager engine reads ``cursor + 1`` live slots; a compiled one's store
    reads its length from device memory (``live=None``), as its replayed step does."""
    if q is None:
        q = torch.randn(1, engine.n_kv, engine.n_heads // engine.n_kv, engine.head_dim,
                        generator=torch.Generator().manual_seed(1)).to(engine.device, engine.dtype)

    @torch.no_grad()
    def attend_all() -> None:
        ctx = engine.step_context(q.shape[0], None if engine.compiled else engine.cursor.host + 1)
        for i in range(engine.n_layers):
            engine.kv.attend(i, q, ctx)
    return attend_all


def greedy_steps(runners: dict, tokens: dict, seen: dict | None = None) -> dict:
    """Per runner (a :class:`~lowrank_lib.runtime.Runner`) a function running one greedy decode step, the unit the
    interleaved step timings call: it feeds the runner's last token ``tokens[k]`` (updated in place) and, given
    ``seen``, appends the new token to ``seen[k]``."""
    def stepper(k):
        def step():
            tokens[k] = greedy(runners[k].step(tokens[k]))
            if seen is not None:
                seen[k].append(int(tokens[k]))
        return step
    return {k: stepper(k) for k in runners}


def timed_generations(runners: dict, ids: torch.Tensor, gen_len: int, repeats: int, warmup: int = 4,
                      progress: bool = False) -> dict:
    """One short warm-up generation per runner (graph capture / compile apart: ``Runner.capture_s``), then
    ``repeats`` interleaved rounds (rotated order, :mod:`lowrank_lib.timing`) of a ``gen_len`` generation each, timed by the
    shared decode loop: per key every round's :class:`~lowrank_lib.runtime.GenerateOutput`."""
    for r in runners.values():
        run_generation(r, ids, min(warmup, gen_len))
    outs = {k: [] for k in runners}
    bar = tqdm(total=repeats * len(runners), desc="generations", disable=not progress)

    def generation(k):
        def run():
            outs[k].append(run_generation(runners[k], ids, gen_len))
            bar.update(1)
            return outs[k][-1].step_s
        return run

    interleaved_samples({k: generation(k) for k in runners}, repeats)
    bar.close()
    return outs


def token_breakdown(engine, ids: torch.Tensor, gen_len: int, warmup: int = 4) -> dict:
    """Where one decode token's time goes in an engine whose step runs the fused layer op (issue 29): the op's own
    phase timers (:func:`~lowrank_lib.runtime.kernels.layer.phase_times`) over one greedy generation of ``gen_len``
    tokens after the prompt ``ids`` (following an untimed ``warmup``-token generation), as ms per decoded token:

    - ``phases_ms``: each of :data:`~lowrank_lib.runtime.kernels.layer.PHASES` summed over the layers;
    - ``gemv_ms`` (the four projection groups), ``elementwise_ms`` (norms, RoPE + KV write, residuals, SiLU * up),
      ``attention_ms``, ``prolog_ms`` (the op's argument checks, plan lookup and scratch: its fixed cost per call);
    - ``outside_layers_ms``: the rest of the step (embedding, LM head, the step's own dispatch / graph replay; the
      final norm is the last layer's, in its ``rmsnorm`` phase), the measured step time minus the layers' phases;
    - ``gemv_GBps``: the layers' GEMV weight bytes per token over ``gemv_ms`` (against the copy bandwidth it says
      how far the GEMV kernels themselves are from the roofline), ``head_and_other_bytes`` the rest of the step's bytes.

    The timers cost ~11 clock reads per layer call (~0.3 us), inside ``step_ms``. Returns ``{"available": False,
    "reason": ...}`` when the engine runs the per-op step (no fused layer: the phases are not timed there)."""
    from .kernels.layer import GEMV_PHASES, PHASES, phase_times

    if not engine.fused.enabled:
        return {"available": False, "reason": f"the step runs per op: {engine.fused.reason}"}
    run_generation(engine, ids, min(warmup, gen_len))
    with torch.no_grad(), phase_times() as ph:
        out = run_generation(engine, ids, gen_len)
    n = len(out.step_s)
    if n == 0 or ph["calls"] != n * engine.n_layers:
        return {"available": False, "reason": f"{ph['calls']} fused-layer calls over {n} steps of "
                                              f"{engine.n_layers} layers (the decode step did not run the op)"}
    per = {p: ph[p] * 1e3 / n for p in PHASES}
    step_ms = sum(out.step_s) * 1e3 / n
    gemv_ms = sum(per[p] for p in GEMV_PHASES)
    gemv_bytes = sum(getattr(L, g).nbytes for L in engine.layers for g in GEMV_PHASES.values())
    return {"available": True, "steps": n, "layer_calls_per_token": engine.n_layers, "step_ms": step_ms,
            "phases_ms": per, "gemv_ms": gemv_ms, "attention_ms": per["attention"], "prolog_ms": per["prolog"],
            "elementwise_ms": sum(per[p] for p in ("rmsnorm", "rope_kv_write", "residual", "silu_mul")),
            "outside_layers_ms": step_ms - sum(per.values()),
            "gemv_bytes_per_token": gemv_bytes, "gemv_GBps": gemv_bytes / (gemv_ms / 1e3) / 1e9 if gemv_ms else None,
            "head_and_other_bytes": engine.weight_bytes_per_token() - gemv_bytes}


def breakdown_table(rows: list[dict]) -> list[str]:
    """Benchmark rows holding a :func:`token_breakdown` (``breakdown``; labelled by their ``shape``, ``system``,
    ``dtype``, ``keep``, ``factor_bits``, ``threads``) as Markdown lines: where each row's step time goes."""
    have = [r for r in rows if (r.get("breakdown") or {}).get("available")]
    if not have:
        return []
    out = ["", "where a decode token's time goes (the fused layer's phase timers; ms/token):", "",
           "model | system | dtype | keep | factor bits | threads | step | GEMV | GEMV GB/s | attention | elementwise "
           "| op prolog | outside layers (head, embedding, dispatch)", "|".join("---" for _ in range(13))]
    for r in have:
        b = r["breakdown"]
        out.append(" | ".join(str(v) for v in (
            r.get("shape"), r["system"], r["dtype"], r.get("keep") or "-", r.get("factor_bits") or "-", r["threads"],
            f"{b['step_ms']:.2f}", f"{b['gemv_ms']:.2f}", f"{b['gemv_GBps']:.1f}", f"{b['attention_ms']:.2f}",
            f"{b['elementwise_ms']:.2f}", f"{b['prolog_ms']:.2f}", f"{b['outside_layers_ms']:.2f}")))
    return out
