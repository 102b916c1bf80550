"""Mechanism ablation and sweeps (notebook 03): every switch on/off under ONE setting, and decode
latency vs prompt length, generation length, keep ratio, and cached length.

All timings come from :func:`lowrank_lib.runtime.run_generation` (the loop every system shares), the systems
compared in interleaved rounds in a rotated order (:mod:`lowrank_lib.timing`); medians over all decode steps of all
repeats, with that population's quartiles (``*_q1`` / ``*_q3``, the IQR bars of notebook 03) and each repeat's
own median (``*_repeats``) beside them.
"""
from __future__ import annotations

import torch
from tqdm.auto import tqdm

from ..timing import interleaved, summary
from .baselines import make_runner
from .config import PRESETS, EngineConfig
from .engine import Engine
from .profiling import greedy_steps, per_token_counts, timed_generations

__all__ = ["MECHANISMS", "mechanism_table", "step_latency_vs_context", "sweep", "time_runners"]

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
    st = summary(raw["steps"])
    return {"decode_ms": st["median_ms"], "decode_ms_q1": st["q1_ms"], "decode_ms_q3": st["q3_ms"],
            "decode_ms_repeats": raw["per_repeat"], "prefill_ms": summary(raw["prefill"])["median_ms"],
            "prefill_ms_repeats": [1e3 * p for p in raw["prefill"]], "capture_s": raw["capture_s"]}


def time_runners(runners: dict, ids: torch.Tensor, gen_len: int, repeats: int) -> dict:
    """Several runners side by side: one warm-up each, then ``repeats`` interleaved rounds (rotated order), so their
    ratios are measured on the same load. Per key: median decode ms/token over every step of every repeat with its
    quartiles (``decode_ms_q1`` / ``decode_ms_q3``), each repeat's median step (``decode_ms_repeats``), the median
    prefill ms (every repeat's in ``prefill_ms_repeats``) and ``capture_s``."""
    return {k: _row(raw) for k, raw in _generations(runners, ids, gen_len, repeats).items()}


def mechanism_table(model, dense_model=None, prompt_len: int = 256, gen_len: int = 32, repeats: int = 2,
                    dtype=None, rows: list[str] | None = None, baselines=("hf_static",), count_tokens: int = 2,
                    progress: bool = True) -> list[dict]:
    """Every mechanism on/off under one setting. Rows: baselines then :data:`MECHANISMS` entries.

    The first row is the reference: every other row is timed interleaved with it (two runners alive at a
    time), and ``speedup_vs_<reference>`` is the ratio of the two medians of that pair (``reference_ms``: the
    reference's median in it). The reference's own row pools its samples of every pair."""
    ids = _prompt(model.config.vocab_size, prompt_len)
    S = prompt_len + gen_len
    names = list(baselines) + list(rows or MECHANISMS)

    def build(name):
        if name in MECHANISMS:
            return Engine(model, EngineConfig(max_seq_len=S, dtype=dtype, **MECHANISMS[name]))
        return make_runner(name, model, dense_model, dtype=dtype, max_seq_len=S)

    ref_name, ref = names[0], build(names[0])
    key = "speedup_vs_" + ref_name
    ref_raw, out = None, []
    for name in tqdm(names[1:] or names, desc="mechanisms", disable=not progress):
        pair = {"reference": ref} if name == ref_name else {"reference": ref, "row": build(name)}
        raw = _generations(pair, ids, gen_len, repeats)
        ref_raw = raw["reference"] if ref_raw is None else _pool(ref_raw, raw["reference"])
        if "row" in pair:
            row = {"system": name, **_row(raw["row"]),
                   "ops_per_token": per_token_counts(pair["row"], ids, count_tokens)["total"]}
            row["reference_ms"] = summary(raw["reference"]["steps"])["median_ms"]
            row[key] = row["reference_ms"] / row["decode_ms"]
            out.append(row)
        del pair
    first = {"system": ref_name, **_row(ref_raw), "ops_per_token": per_token_counts(ref, ids, count_tokens)["total"]}
    first["reference_ms"] = first["decode_ms"]
    first[key] = 1.0
    return [first] + out


def sweep(model, dense_model=None, systems=("hf_static", "dense_kv", "engine", "naive"), prompt_lens=(256,),
          gen_lens=(32,), repeats: int = 2, dtype=None, progress: bool = True) -> list[dict]:
    """Decode ms/token for every (system, prompt_len, gen_len); at each (prompt_len, gen_len) every system is
    timed in the same interleaved rounds. Rows in (system, prompt_len, gen_len) order."""
    S = max(prompt_lens) + max(gen_lens)
    runners = {s: make_runner(s, model, dense_model, dtype=dtype, max_seq_len=S) for s in systems}
    by = {}
    for p, g in tqdm([(p, g) for p in prompt_lens for g in gen_lens], desc="sweep", disable=not progress):
        for s, row in time_runners(runners, _prompt(model.config.vocab_size, p), g, repeats).items():
            by[(s, p, g)] = {"system": s, "prompt_len": p, "gen_len": g, **row}
    return [by[(s, p, g)] for s in systems for p in prompt_lens for g in gen_lens]


@torch.no_grad()
def step_latency_vs_context(model, dense_model=None, systems=("naive", "dense_kv", "engine", "hf_static"),
                            context_lens=(64, 256, 1024), steps: int = 8, dtype=None, progress: bool = True) -> list[dict]:
    """Latency of single decode steps after a prefill of each cached length (dense KV: flat;
    rebuilt history: grows with the length). At each length every system prefills, then their steps are
    interleaved (rotated order, :mod:`lowrank_lib.timing`); the first step of each is a warm-up, ``steps - 1`` are timed."""
    S = max(context_lens) + steps + 1
    runners = {s: make_runner(s, model, dense_model, dtype=dtype, max_seq_len=S) for s in systems}
    by = {}
    for n in tqdm(context_lens, desc="step latency", disable=not progress):
        ids = _prompt(model.config.vocab_size, n)
        tok = {s: r.prefill(ids, None).argmax(-1) for s, r in runners.items()}
        ts = interleaved(greedy_steps(runners, tok), rounds=steps - 1, warmup=1)
        for s in systems:
            st = summary(ts[s])
            by[(s, n)] = {"system": s, "cached_len": n, "step_ms": st["median_ms"], "step_ms_q1": st["q1_ms"],
                          "step_ms_q3": st["q3_ms"], "step_ms_samples": [1e3 * t for t in ts[s]]}
    return [by[(s, n)] for s in systems for n in context_lens]
