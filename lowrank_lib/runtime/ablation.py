"""Mechanism ablation and sweeps (notebook 03): every switch on/off under ONE setting, and decode
latency vs prompt length, generation length, keep ratio, and cached length.

All timings come from :func:`lowrank_lib.runtime.run_generation` (the loop every system shares), the systems
compared in interleaved rounds in a rotated order (:mod:`lowrank_lib.timing`); medians over all decode steps of all
repeats, with that population's quartiles (``*_q1`` / ``*_q3``) and each repeat's own median (``*_repeats``)
beside them. A repeat is one run (one whole generation, in its own interleaved round): the timings notebooks 02 and
03 print are medians ACROSS runs with the spread across runs (``decode_ms_run_median`` / ``_run_min`` /
``_run_max``, :func:`lowrank_lib.timing.across_runs`), and two rows differ only when those ranges do not overlap
(:func:`compare`).

When the runners of one timing would not fit in memory together (:func:`side_by_side`: a 7B model beside an
engine's packed copy of it), each system is built, timed ALONE and freed in turn, so nothing is paged from disk while
a clock runs; every row says which (``timed``: ``"interleaved"`` / ``"alone"``), and rows timed alone compare
medians of separate timings.

Every row the ablation can show is defined in :data:`DEFINITIONS`; :data:`ROW_SYSTEM` names the rows that are a
:func:`~lowrank_lib.runtime.baselines.make_runner` system, so notebook 02 (which counts those systems) and notebook
03 report the same dispatch count for the same configuration.
"""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from .. import host
from ..host import release_memory
from ..timing import across_runs, interleaved, summary, within_noise
from .baselines import make_runner
from .config import PRESETS, EngineConfig
from .engine import Engine
from .profiling import DISPATCH_TOKENS, greedy_steps, per_token_counts, timed_generations

__all__ = ["COMPARISONS", "compare", "DEFINITIONS", "MECHANISMS", "mechanism_table", "mechanism_verdicts", "ROW_SYSTEM",
           "side_by_side", "step_latency_vs_context", "sweep", "time_runners", "UNCOMPRESSED"]

_OFF = dict(fold_rope=False, fold_norm=False, weight_layout="out_major")
#: the paper's mechanisms are ablated on the portable path (aten GEMMs, sdpa); our compiled CPU kernels
#: (runtime/kernels) are the last rungs of the ladder
_P = dict(kernels="portable")

#: row name -> (EngineConfig keywords); cumulative ladder first, then leave-one-out from the engine.
MECHANISMS: dict[str, dict] = {
    "naive: low-rank history rebuilt": PRESETS["naive"],
    "dense KV": PRESETS["dense_kv"],
    "dense KV + pack qkv": dict(pack_mlp=False, **_OFF, **_P),
    "dense KV + pack qkv + pack mlp": dict(_OFF, **_P),
    "+ fold RoPE": dict(weight_layout="out_major", **_P),
    "+ weight layout (= engine, eager)": dict(_P),
    "+ whole-step graph": dict(graph="whole-step", **_P),
    "whole-step graph - fused lowering (aten mm/SDPA)": dict(graph="whole-step", fused_compile=False, **_P),
    "+ our CPU kernels (packed GEMV + attention), eager": dict(kernels="auto"),
    "+ our CPU kernels, whole-step graph": dict(kernels="auto", graph="whole-step"),
    "engine - pack qkv": dict(pack_qkv=False, **_P),
    "engine - pack mlp": dict(pack_mlp=False, **_P),
    "engine - fold RoPE": dict(fold_rope=False, **_P),
    "engine - weight layout (out_major)": dict(weight_layout="out_major", **_P),
    "engine + fold norm (ulp drift)": dict(fold_norm=True, **_P),
}

#: rows of the UNCOMPRESSED model (``dense_model``) through the same runners: what compression itself buys.
#: row name -> make_runner system (HF) or EngineConfig keywords (our engine on the dense weights)
UNCOMPRESSED: dict[str, str | dict] = {
    "uncompressed: HF static": "dense_hf_static",
    "uncompressed: engine, eager": dict(_P),
    "uncompressed: engine + our CPU kernels, eager": dict(kernels="auto"),
}

#: row -> the make_runner system it is (same model, same EngineConfig): the configurations notebook 02 also counts
ROW_SYSTEM = {"hf_static": "hf_static", "hf_dynamic": "hf_dynamic", "naive: low-rank history rebuilt": "naive",
              "dense KV": "dense_kv", "+ our CPU kernels (packed GEMV + attention), eager": "engine",
              "uncompressed: HF static": "dense_hf_static",
              "uncompressed: engine + our CPU kernels, eager": "dense_engine"}

#: what every row of the ablation is (notebook 03 prints this table)
DEFINITIONS = {
    "hf_static": "transformers' own forward on the low-rank factors, with its StaticCache (preallocated KV)",
    "hf_dynamic": "transformers' own forward on the low-rank factors, with its DynamicCache (KV grown by cat)",
    "naive: low-rank history rebuilt": "our engine, portable path, every projection two GEMMs, the K/V history "
                                       "kept as low-rank codes and rebuilt every step (the paper's naive path)",
    "dense KV": "as naive, but K/V kept as dense rows (a preallocated cache): nothing rebuilt",
    "dense KV + pack qkv": "dense KV, and the q/k/v first factors packed into one GEMM",
    "dense KV + pack qkv + pack mlp": "and gate/up packed into one GEMM (+ a split)",
    "+ fold RoPE": "and RoPE applied through a precomputed table folded into the step",
    "+ weight layout (= engine, eager)": "and each matrix stored in the layout its one-row GEMM streams fastest: "
                                         "the engine, eager, portable path (aten GEMMs, SDPA)",
    "+ whole-step graph": "the engine with the whole fixed-shape step compiled (torch.compile, fused lowering)",
    "whole-step graph - fused lowering (aten mm/SDPA)": "the whole-step graph keeping aten mm / SDPA calls",
    "+ our CPU kernels (packed GEMV + attention), eager": "the engine with our compiled CPU kernels (runtime/kernels: "
                                                          "packed GEMV, decode attention, fused layer), eager",
    "+ our CPU kernels, whole-step graph": "our CPU kernels inside the compiled whole step",
    "engine - pack qkv": "the eager engine without packing q/k/v",
    "engine - pack mlp": "the eager engine without packing gate/up",
    "engine - fold RoPE": "the eager engine without folding RoPE",
    "engine - weight layout (out_major)": "the eager engine with every matrix stored out-major",
    "engine + fold norm (ulp drift)": "the eager engine with the RMSNorm weights folded into the next matrix "
                                      "(changes logits by float rounding)",
    "uncompressed: HF static": "transformers on the UNCOMPRESSED model, StaticCache",
    "uncompressed: engine, eager": "our eager engine (portable path) on the UNCOMPRESSED model",
    "uncompressed: engine + our CPU kernels, eager": "our eager engine with our CPU kernels on the UNCOMPRESSED model",
}

#: (row, against, what the pair measures): the comparisons notebook 03's conclusion is computed from
COMPARISONS = (
    ("dense KV", "naive: low-rank history rebuilt", "a dense KV cache instead of the rebuilt history"),
    ("dense KV + pack qkv", "dense KV", "packing q/k/v"),
    ("dense KV + pack qkv + pack mlp", "dense KV + pack qkv", "packing gate/up"),
    ("+ fold RoPE", "dense KV + pack qkv + pack mlp", "folding RoPE"),
    ("+ weight layout (= engine, eager)", "+ fold RoPE", "the weight layout"),
    ("+ weight layout (= engine, eager)", "dense KV", "the engine's mechanisms together (eager)"),
    ("+ whole-step graph", "+ weight layout (= engine, eager)", "the whole-step graph"),
    ("+ whole-step graph", "whole-step graph - fused lowering (aten mm/SDPA)", "the fused lowering"),
    ("+ our CPU kernels (packed GEMV + attention), eager", "+ weight layout (= engine, eager)", "our CPU kernels (eager)"),
    ("+ our CPU kernels, whole-step graph", "+ whole-step graph", "our CPU kernels (in the graph)"),
    ("+ weight layout (= engine, eager)", "engine - pack qkv", "packing q/k/v (leave-one-out)"),
    ("+ weight layout (= engine, eager)", "engine - pack mlp", "packing gate/up (leave-one-out)"),
    ("+ weight layout (= engine, eager)", "engine - fold RoPE", "folding RoPE (leave-one-out)"),
    ("+ weight layout (= engine, eager)", "engine - weight layout (out_major)", "the weight layout (leave-one-out)"),
    ("engine + fold norm (ulp drift)", "+ weight layout (= engine, eager)", "folding the norms"),
    ("+ weight layout (= engine, eager)", "hf_static", "the eager engine instead of HF static"),
    ("hf_static", "uncompressed: HF static", "compression, through HF static"),
    ("+ weight layout (= engine, eager)", "uncompressed: engine, eager", "compression, through the eager engine"),
    ("+ our CPU kernels (packed GEMV + attention), eager", "uncompressed: engine + our CPU kernels, eager",
     "compression, through the engine with our CPU kernels"),
)


#: systems that read the model's own tensors when it already has their dtype (HF runners; the engine presets that
#: neither pack, fold nor re-lay a weight); every other engine holds a packed copy of the weights
_SHARES = {"hf_dynamic", "hf_static", "hf_compiled", "naive", "dense_kv", "naive: low-rank history rebuilt",
           "dense KV"}
_HF = {"hf_dynamic", "hf_static", "hf_compiled"}
#: the share of this machine's memory the model and the runners' copies may fill side by side
MEMORY_SHARE = 0.75


def side_by_side(model, systems, dtype=None, memory_bytes: int | None = None) -> bool:
    """Whether ``systems`` (make_runner names or :data:`MECHANISMS` rows) fit in memory together on ``model``: its
    weights at ``dtype``, plus one copy for each system that does not share them (a packing engine; an HF runner when
    ``dtype`` is not the model's), within :data:`MEMORY_SHARE` of ``memory_bytes`` (default: physical memory).
    Conservative: a mechanism row that packs nothing is still counted as a copy."""
    params = [*model.parameters(), *model.buffers()]
    cast = dtype is not None and any(p.is_floating_point() and p.dtype != dtype for p in params)
    nbytes = sum(p.numel() * (dtype.itemsize if cast and p.is_floating_point() else p.element_size()) for p in params)
    copies = sum(1 for s in systems if s not in _SHARES or (cast and s in _HF))
    return (1 + copies) * nbytes <= MEMORY_SHARE * (host.physical_memory() if memory_bytes is None else memory_bytes)


def _prompt(vocab: int, n: int, batch: int = 1, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(seed))


def _generations(runners: dict, ids: torch.Tensor, gen_len: int, repeats: int) -> dict:
    """:func:`.profiling.timed_generations` (one warm-up each, then interleaved rounds); per key the raw samples."""
    outs = timed_generations(runners, ids, gen_len, repeats, warmup=3)
    return {k: {"steps": [t for o in outs[k] for t in o.step_s], "prefill": [o.prefill_s for o in outs[k]],
                "per_repeat": [summary(o.step_s)["median_ms"] for o in outs[k]],
                "capture_s": runners[k].capture_s} for k in runners}


def _pool(a: dict, b: dict) -> dict:
    """The samples of two timings of the same runner, together."""
    return {"steps": a["steps"] + b["steps"], "prefill": a["prefill"] + b["prefill"],
            "per_repeat": a["per_repeat"] + b["per_repeat"], "capture_s": a["capture_s"]}


def _row(raw: dict) -> dict:
    st, runs = summary(raw["steps"]), across_runs(raw["per_repeat"])
    return {"decode_ms": st["median_ms"], "decode_ms_q1": st["q1_ms"], "decode_ms_q3": st["q3_ms"],
            "decode_ms_repeats": raw["per_repeat"], "decode_ms_run_median": runs["median_ms"],
            "decode_ms_run_min": runs["min_ms"], "decode_ms_run_max": runs["max_ms"], "runs": runs["runs"],
            "prefill_ms": summary(raw["prefill"])["median_ms"],
            "prefill_ms_repeats": [1e3 * p for p in raw["prefill"]], "capture_s": raw["capture_s"]}


def _runs(row: dict) -> dict:
    return {"median_ms": row["decode_ms_run_median"], "min_ms": row["decode_ms_run_min"],
            "max_ms": row["decode_ms_run_max"]}


def compare(row: dict, against: dict) -> dict:
    """``row`` against ``against`` (two timed rows): ``speedup`` (against's median of run medians over row's: > 1
    when row is faster) and the verdict, ``"faster"`` / ``"slower"`` when their across-run ranges do not overlap,
    ``"within noise"`` when they do."""
    a, b = _runs(row), _runs(against)
    verdict = "within noise" if within_noise(a, b) else ("faster" if a["median_ms"] < b["median_ms"] else "slower")
    return {"speedup": b["median_ms"] / a["median_ms"], "verdict": verdict}


def mechanism_verdicts(rows: list[dict], comparisons=COMPARISONS) -> list[dict]:
    """Every comparison of ``comparisons`` whose two rows are in ``rows`` (mechanism_table's): the row, what it is
    compared against, what the pair measures, and :func:`compare`'s speedup and verdict."""
    by = {r["system"]: r for r in rows}
    return [{"row": a, "against": b, "what": what, **compare(by[a], by[b])}
            for a, b, what in comparisons if a in by and b in by]


def time_runners(runners: dict, ids: torch.Tensor, gen_len: int, repeats: int) -> dict:
    """Several runners side by side: one warm-up each, then ``repeats`` interleaved rounds (rotated order), so their
    ratios are measured on the same load. Per key: median decode ms/token over every step of every repeat with its
    quartiles (``decode_ms_q1`` / ``decode_ms_q3``), each repeat's median step (``decode_ms_repeats``), the median
    prefill ms (every repeat's in ``prefill_ms_repeats``) and ``capture_s``."""
    return {k: _row(raw) for k, raw in _generations(runners, ids, gen_len, repeats).items()}


def _counts(runner, ids, n: int) -> dict:
    """A row's dispatches per token (:func:`.profiling.per_token_counts`, THE definition notebook 02 shares): the
    total and by operator class."""
    c = per_token_counts(runner, ids, n)
    return {"ops_per_token": c["total"], "ops_by_class": c["by_class"]}


def mechanism_table(model, dense_model=None, prompt_len: int = 256, gen_len: int = 32, repeats: int = 2,
                    dtype=None, rows: list[str] | None = None, baselines=("hf_static",),
                    count_tokens: int = DISPATCH_TOKENS, uncompressed: bool = False, progress: bool = True) -> list[dict]:
    """Every mechanism on/off under one setting. Rows: baselines then :data:`MECHANISMS` entries, then (with
    ``uncompressed``) the :data:`UNCOMPRESSED` rows on ``dense_model``.

    The first row is the reference: every other row is timed interleaved with it (two runners alive at a
    time), and ``speedup_vs_<reference>`` is the ratio of the two medians of that pair (``reference_ms``: the
    reference's median in it). The reference's own row pools its samples of every pair."""
    ids = _prompt(model.config.vocab_size, prompt_len)
    # the count: a warm step, then count_tokens steps, with a slot to spare (a full cache skips some ops)
    S = prompt_len + max(gen_len, count_tokens + 2)
    names = list(baselines) + list(rows or MECHANISMS) + (list(UNCOMPRESSED) if uncompressed else [])
    if uncompressed and dense_model is None:
        raise ValueError("the uncompressed rows need the uncompressed model (dense_model=...)")

    def build(name):
        if name in MECHANISMS:
            return Engine(model, EngineConfig(max_seq_len=S, dtype=dtype, **MECHANISMS[name]))
        if name in UNCOMPRESSED:
            u = UNCOMPRESSED[name]
            if isinstance(u, str):
                return make_runner(u, model, dense_model, dtype=dtype, max_seq_len=S)
            return Engine(dense_model, EngineConfig(max_seq_len=S, dtype=dtype, **u))
        return make_runner(name, model, dense_model, dtype=dtype, max_seq_len=S)

    ref_name, ref = names[0], build(names[0])
    key = "speedup_vs_" + ref_name
    # a pair that does not fit together (its model beside a packed copy): the reference timed alone once, then each
    # row alone, so no clock runs while weights page in from disk
    together = all(side_by_side(model, [ref_name, n], dtype) for n in names[1:])
    ref_raw = None if together else _generations({"reference": ref}, ids, gen_len, repeats)["reference"]
    out = []
    for name in tqdm(names[1:] or names, desc="mechanisms", disable=not progress):
        if not together:
            if name != ref_name:
                runner = {"row": build(name)}
                row = {"system": name, **_row(_generations(runner, ids, gen_len, repeats)["row"]),
                       **_counts(runner["row"], ids, count_tokens), "timed": "alone"}
                row["reference_ms"] = summary(ref_raw["steps"])["median_ms"]
                row[key] = row["reference_ms"] / row["decode_ms"]
                out.append(row)
                del runner
                release_memory()
            continue
        pair = {"reference": ref} if name == ref_name else {"reference": ref, "row": build(name)}
        raw = _generations(pair, ids, gen_len, repeats)
        ref_raw = raw["reference"] if ref_raw is None else _pool(ref_raw, raw["reference"])
        if "row" in pair:
            row = {"system": name, **_row(raw["row"]), **_counts(pair["row"], ids, count_tokens),
                   "timed": "interleaved"}
            row["reference_ms"] = summary(raw["reference"]["steps"])["median_ms"]
            row[key] = row["reference_ms"] / row["decode_ms"]
            out.append(row)
        del pair
        release_memory()                  # this row's runner is gone before the next one is built
    first = {"system": ref_name, **_row(ref_raw), **_counts(ref, ids, count_tokens),
             "timed": "interleaved" if together else "alone"}
    first["reference_ms"] = first["decode_ms"]
    first[key] = 1.0
    return [first] + out


def sweep(model, dense_model=None, systems=("hf_static", "dense_kv", "engine", "naive"), prompt_lens=(256,),
          gen_lens=(32,), repeats: int = 2, dtype=None, progress: bool = True) -> list[dict]:
    """Decode ms/token for every (system, prompt_len, gen_len); at each (prompt_len, gen_len) every system is
    timed in the same interleaved rounds. Rows in (system, prompt_len, gen_len) order."""
    S = max(prompt_lens) + max(gen_lens)
    together = side_by_side(model, systems, dtype)
    by = {}
    for group in ([systems] if together else [[s] for s in systems]):      # too large together: one at a time
        runners = {s: make_runner(s, model, dense_model, dtype=dtype, max_seq_len=S) for s in group}
        for p, g in tqdm([(p, g) for p in prompt_lens for g in gen_lens], desc="sweep", disable=not progress):
            for s, row in time_runners(runners, _prompt(model.config.vocab_size, p), g, repeats).items():
                by[(s, p, g)] = {"system": s, "prompt_len": p, "gen_len": g, **row,
                                 "timed": "interleaved" if together else "alone"}
        del runners
        release_memory()
    return [by[(s, p, g)] for s in systems for p in prompt_lens for g in gen_lens]


@torch.no_grad()
def step_latency_vs_context(model, dense_model=None, systems=("naive", "dense_kv", "engine", "hf_static"),
                            context_lens=(64, 256, 1024), steps: int = 8, dtype=None, progress: bool = True,
                            repeats: int = 1) -> list[dict]:
    """Latency of single decode steps after a prefill of each cached length (dense KV: flat;
    rebuilt history: grows with the length). At each length, ``repeats`` runs: in each, every system prefills, then
    their steps are interleaved (rotated order, :mod:`lowrank_lib.timing`); the first step of each is a warm-up,
    ``steps - 1`` are timed. A row: the median and quartiles of every timed step (``step_ms``, ``_q1``, ``_q3``), each
    run's median (``step_ms_repeats``) and the median of run medians with their min-max (``step_ms_run_*``)."""
    S = max(context_lens) + steps + 1
    together = side_by_side(model, systems, dtype)
    by = {}
    for group in ([systems] if together else [[s] for s in systems]):      # too large together: one at a time
        runners = {s: make_runner(s, model, dense_model, dtype=dtype, max_seq_len=S) for s in group}
        for n in tqdm(context_lens, desc="step latency", disable=not progress):
            ids = _prompt(model.config.vocab_size, n)
            samples, medians = {s: [] for s in group}, {s: [] for s in group}
            for _ in range(repeats):
                tok = {s: r.prefill(ids, None).argmax(-1) for s, r in runners.items()}
                ts = interleaved(greedy_steps(runners, tok), rounds=steps - 1, warmup=1)
                for s in group:
                    samples[s] += ts[s]
                    medians[s].append(summary(ts[s])["median_ms"])
            for s in group:
                st, runs = summary(samples[s]), across_runs(medians[s])
                by[(s, n)] = {"system": s, "cached_len": n, "step_ms": st["median_ms"], "step_ms_q1": st["q1_ms"],
                              "step_ms_q3": st["q3_ms"], "step_ms_samples": [1e3 * t for t in samples[s]],
                              "step_ms_repeats": medians[s], "step_ms_run_median": runs["median_ms"],
                              "step_ms_run_min": runs["min_ms"], "step_ms_run_max": runs["max_ms"],
                              "runs": runs["runs"], "timed": "interleaved" if together else "alone"}
        del runners
        release_memory()
    return [by[(s, n)] for s in systems for n in context_lens]
