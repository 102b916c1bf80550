"""Mechanism ablation and sweeps (notebook 03): every switch on/off under ONE setting, and decode
latency vs prompt length, generation length, keep ratio, and cached length.

All timings come from :func:`lowrank_lib.runtime.run_generation` (the loop every system shares);
medians over all decode steps of all repeats, with that population's quartiles (``*_q1`` / ``*_q3``, the
IQR bars of notebook 03) and each repeat's own median (``*_repeats``) beside them.
"""
from __future__ import annotations

import statistics

import torch
from tqdm.auto import tqdm

from ..runtime import Engine, EngineConfig, run_generation
from ..runtime.baselines import make_runner
from ..runtime.config import PRESETS
from ..runtime.profiling import per_token_counts

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


def quartiles_ms(samples_s: list[float]) -> tuple[float, float]:
    """(first, third) quartile of ``samples_s`` (seconds) in ms; both the value itself for one sample."""
    if len(samples_s) < 2:
        return 1e3 * samples_s[0], 1e3 * samples_s[0]
    q = statistics.quantiles(samples_s, n=4, method="inclusive")
    return 1e3 * q[0], 1e3 * q[2]


def time_runner(runner, ids: torch.Tensor, gen_len: int, repeats: int) -> dict:
    """One warm-up, then ``repeats`` generations: median decode ms/token over every step of every repeat,
    its quartiles (``decode_ms_q1`` / ``decode_ms_q3``), each repeat's median step (``decode_ms_repeats``),
    and the median prefill ms (every repeat's in ``prefill_ms_repeats``)."""
    run_generation(runner, ids, min(3, gen_len))
    steps, pre, per_rep = [], [], []
    for _ in range(repeats):
        o = run_generation(runner, ids, gen_len)
        steps += o.step_s
        pre.append(o.prefill_s)
        per_rep.append(1e3 * statistics.median(o.step_s))
    q1, q3 = quartiles_ms(steps)
    return {"decode_ms": 1e3 * statistics.median(steps), "decode_ms_q1": q1, "decode_ms_q3": q3,
            "decode_ms_repeats": per_rep, "prefill_ms": 1e3 * statistics.median(pre),
            "prefill_ms_repeats": [1e3 * p for p in pre], "capture_s": getattr(runner, "capture_s", 0.0)}


def mechanism_table(model, dense_model=None, prompt_len: int = 256, gen_len: int = 32, repeats: int = 2,
                    dtype=None, rows: list[str] | None = None, baselines=("hf_static",), count_tokens: int = 2,
                    progress: bool = True) -> list[dict]:
    """Every mechanism on/off under one setting. Rows: baselines then :data:`MECHANISMS` entries."""
    ids = _prompt(model.config.vocab_size, prompt_len)
    S = prompt_len + gen_len
    out = []
    names = list(baselines) + list(rows or MECHANISMS)
    for name in tqdm(names, desc="mechanisms", disable=not progress):
        if name in MECHANISMS:
            r = Engine(model, EngineConfig(max_seq_len=S, dtype=dtype, **MECHANISMS[name]))
        else:
            r = make_runner(name, model, dense_model, dtype=dtype, max_seq_len=S)
        row = {"system": name, **time_runner(r, ids, gen_len, repeats)}
        row["ops_per_token"] = per_token_counts(r, ids, count_tokens)["total"]
        out.append(row)
        del r
    base = out[0]["decode_ms"]
    for row in out:
        row["speedup_vs_" + names[0]] = base / row["decode_ms"]
    return out


def sweep(model, dense_model=None, systems=("hf_static", "dense_kv", "engine", "naive"), prompt_lens=(256,),
          gen_lens=(32,), repeats: int = 2, dtype=None, progress: bool = True) -> list[dict]:
    """Decode ms/token for every (system, prompt_len, gen_len)."""
    out = []
    grid = [(s, p, g) for s in systems for p in prompt_lens for g in gen_lens]
    runners = {}
    S = max(prompt_lens) + max(gen_lens)
    for s, p, g in tqdm(grid, desc="sweep", disable=not progress):
        if s not in runners:
            runners[s] = make_runner(s, model, dense_model, dtype=dtype, max_seq_len=S)
        ids = _prompt(model.config.vocab_size, p)
        out.append({"system": s, "prompt_len": p, "gen_len": g, **time_runner(runners[s], ids, g, repeats)})
    return out


@torch.no_grad()
def step_latency_vs_context(model, dense_model=None, systems=("naive", "dense_kv", "engine", "hf_static"),
                            context_lens=(64, 256, 1024), steps: int = 8, dtype=None, progress: bool = True) -> list[dict]:
    """Latency of single decode steps after a prefill of each cached length (dense KV: flat;
    rebuilt history: grows with the length)."""
    import time

    S = max(context_lens) + steps + 1
    out = []
    for s in tqdm(systems, desc="step latency", disable=not progress):
        r = make_runner(s, model, dense_model, dtype=dtype, max_seq_len=S)
        for n in context_lens:
            ids = _prompt(model.config.vocab_size, n)
            tok = r.prefill(ids, None).argmax(-1)
            ts = []
            for _ in range(steps):
                t0 = time.perf_counter()
                tok = r.step(tok).argmax(-1)
                ts.append(time.perf_counter() - t0)
            q1, q3 = quartiles_ms(ts[1:])
            out.append({"system": s, "cached_len": n, "step_ms": 1e3 * statistics.median(ts[1:]),
                        "step_ms_q1": q1, "step_ms_q3": q3, "step_ms_samples": [1e3 * t for t in ts[1:]]})
    return out
