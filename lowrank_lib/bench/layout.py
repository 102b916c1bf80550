"""Weight-layout microbenchmark: one-row GEMM bandwidth per stored layout, cold cache.

``python -m lowrank_lib.bench layout --model smollm2 --keep 0.5`` times ``x @ Wt`` for every
distinct GEMM operand shape of the engine, with W stored ``out_major`` ([out, in], nn.Linear) and
``in_major`` ([in, out]), both timed side by side (interleaved rounds, :mod:`.timing`). Each shape is replicated until the working set exceeds the last-level
cache (default 256 MB), so every call streams from DRAM as in a real decode step. Prints the
table (GB/s per layout, what ``pick_layout("auto")`` chooses, and the per-token time of both
layouts weighted by how many such matrices one step reads) and writes JSON.
"""
from __future__ import annotations

from collections import Counter

import torch
from tqdm.auto import tqdm

from ..runtime.packing import pick_layout
from ..timing import interleaved, summary


def engine_operand_shapes(engine) -> Counter:
    """(out, in) of every GEMM operand one decode step reads -> how many per token."""
    groups = [engine.lm_head] + [g for L in engine.layers for g in (L.qkv, L.o, L.gate_up, L.down)]
    shapes = Counter()
    for g in groups:
        for shape in g.operand_shapes():          # (out, in), whatever backend stores them
            shapes[shape] += 1
    return shapes


def _cold_gemv(out_f: int, in_f: int, layout: str, dtype, working_set: int):
    """(fn, n): ``fn()`` runs ``x @ Wt`` once over each of ``n`` copies of W, enough copies to defeat the caches."""
    n = max(2, working_set // (out_f * in_f * dtype.itemsize))
    g = torch.Generator().manual_seed(0)
    mats = [torch.randn(out_f, in_f, generator=g).to(dtype) for _ in range(n)]
    ops = [W.t().contiguous() if layout == "in_major" else W.t() for W in mats]
    del mats
    x = torch.randn(1, in_f, generator=g).to(dtype)

    def sweep():
        for Wt in ops:
            torch.mm(x, Wt)
    return sweep, n


def layout_bench(shapes: Counter, dtype=torch.float32, working_set_mb: int = 256, repeats: int = 5,
                 progress: bool = True) -> dict:
    """Per shape: GB/s for both layouts (timed side by side: interleaved rounds, rotated order, one warm-up sweep
    each; medians, ``us_q1`` / ``us_q3`` their quartiles) and the auto choice; totals per decode token."""
    rows = []
    layouts = ("out_major", "in_major")
    for (o, i), count in tqdm(sorted(shapes.items()), desc="layout bench", disable=not progress):
        nbytes = o * i * dtype.itemsize
        sweeps = {lay: _cold_gemv(o, i, lay, dtype, working_set_mb << 20) for lay in layouts}
        ts = interleaved({lay: fn for lay, (fn, _) in sweeps.items()}, repeats, warmup=1)
        st = {lay: summary([t / sweeps[lay][1] for t in ts[lay]]) for lay in layouts}
        del sweeps
        us = {lay: 1e3 * st[lay]["median_ms"] for lay in layouts}
        rows.append({"out": o, "in": i, "per_token": count, "bytes": nbytes,
                     "GBps": {k: nbytes / v / 1e3 for k, v in us.items()}, "us": us,
                     "us_q1": {k: 1e3 * st[k]["q1_ms"] for k in layouts},
                     "us_q3": {k: 1e3 * st[k]["q3_ms"] for k in layouts},
                     "auto": pick_layout(o, i, torch.device("cpu"), "auto", dtype),
                     "best": min(us, key=us.get)})
    tot = {lay: sum(r["us"][lay] * r["per_token"] for r in rows) / 1e3 for lay in layouts}
    tot["auto"] = sum(r["us"][r["auto"]] * r["per_token"] for r in rows) / 1e3
    tot["best"] = sum(r["us"][r["best"]] * r["per_token"] for r in rows) / 1e3
    return {"dtype": str(dtype).replace("torch.", ""), "threads": torch.get_num_threads(),
            "working_set_mb": working_set_mb, "rows": rows, "ms_per_token": tot}


def format_layout_table(res: dict) -> str:
    lines = ["out x in | per token | out_major GB/s | in_major GB/s | auto | fastest",
             "---|---|---|---|---|---"]
    for r in res["rows"]:
        lines.append(f"{r['out']} x {r['in']} | {r['per_token']} | {r['GBps']['out_major']:.1f} | "
                     f"{r['GBps']['in_major']:.1f} | {r['auto']} | {r['best']}")
    t = res["ms_per_token"]
    lines.append(f"\nGEMM ms per decode token (cold, {res['dtype']}, {res['threads']} threads): "
                 + ", ".join(f"{k} {v:.2f}" for k, v in t.items()))
    return "\n".join(lines)
