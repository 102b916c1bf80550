"""How much memory bandwidth the decode step's weight reads reach: per stored layout, and per GEMV class of a geometry.

Both measure cold streams: enough copies of the matrices (each in its own memory) that nothing stays in cache, as in
a real decode step, timed through :mod:`lowrank_lib.timing`.

- :func:`layout_bench` (``bench layout``): ``x @ Wt`` for every distinct GEMM operand shape of an engine
  (:func:`engine_operand_shapes`), W stored ``out_major`` ([out, in], nn.Linear) and ``in_major`` ([in, out]), both
  timed side by side (interleaved rounds, one warm-up sweep each); GB/s per layout, what ``pick_layout("auto")``
  chooses, and the per-token time of both layouts weighted by how many such matrices one step reads.
- :func:`measure` (``bench peer --shape``): the bandwidth each decode GEMV class of a ``LlamaConfig`` geometry
  (:func:`gemv_classes`) reaches with our packed kernel (``runtime.kernels.ops``), beside the copy bandwidth. A class
  is one kernel call of the engine's decode step, with the shapes the engine packs (``packing.ProjectionGroup``:
  q/k/v and gate/up share one stage-1 matrix, their stage-2 factors run as ONE segmented call; RoPE folding doubles
  the q/k stage-2 rows when every q/k is low rank)::

    dense:    qkv [q + 2 kv, H], o [H, q], gate_up [2 I, H], down [H, I], lm_head [V, H]
    low rank: qkv.V [r_q + r_k + r_v, H], qkv.U (2q x r_q, 2kv x r_k, kv x r_v), o.V, o.U,
              gate_up.V [r_g + r_u, H], gate_up.U (I x r_g, I x r_u), down.V [r_d, I], down.U [H, r_d]
"""
from __future__ import annotations

from collections import Counter

import torch
from tqdm.auto import tqdm

from ..geometry import geometry
from ..host import copy_bandwidth
from ..ranks import keep_rank
from ..timing import interleaved, summary, timed
from .packing import pick_layout

__all__ = ["engine_operand_shapes", "format_layout_table", "gemv_classes", "layout_bench", "measure"]


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


def gemv_classes(cfg, keep: float | None) -> list[dict]:
    """The decode GEMV calls of one layer (and the head) of a ``LlamaConfig`` geometry: name, matrices
    ``[(out, in, x_offset)]`` and the width of x, per call."""
    g = geometry(cfg)
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
    head = {"name": "lm_head", "mats": [(V, H, 0)], "x": H}
    if keep is None:
        return [{"name": "qkv", "mats": [(q + 2 * kv, H, 0)], "x": H}, {"name": "o", "mats": [(H, q, 0)], "x": q},
                {"name": "gate_up", "mats": [(2 * I, H, 0)], "x": H}, {"name": "down", "mats": [(H, I, 0)], "x": I},
                head]
    r = {n: keep_rank(o, i, keep) for n, (o, i) in
         {"q": (q, H), "k": (kv, H), "v": (kv, H), "o": (H, q), "g": (I, H), "u": (I, H), "d": (H, I)}.items()}
    return [{"name": "qkv.V", "mats": [(r["q"] + r["k"] + r["v"], H, 0)], "x": H},
            {"name": "qkv.U", "mats": [(2 * q, r["q"], 0), (2 * kv, r["k"], r["q"]), (kv, r["v"], r["q"] + r["k"])],
             "x": r["q"] + r["k"] + r["v"]},
            {"name": "o.V", "mats": [(r["o"], q, 0)], "x": q}, {"name": "o.U", "mats": [(H, r["o"], 0)], "x": r["o"]},
            {"name": "gate_up.V", "mats": [(r["g"] + r["u"], H, 0)], "x": H},
            {"name": "gate_up.U", "mats": [(I, r["g"], 0), (I, r["u"], r["g"])], "x": r["g"] + r["u"]},
            {"name": "down.V", "mats": [(r["d"], I, 0)], "x": I}, {"name": "down.U", "mats": [(H, r["d"], 0)], "x": r["d"]},
            head]


@torch.no_grad()
def measure(cfg, keep: float | None, dtype: torch.dtype | str, stream_bytes: float = 1.0e9, repeats: int = 3,
            seed: int = 0, copy_bytes: int = 1 << 28) -> dict:
    """GB/s of every class of :func:`gemv_classes` at ``dtype`` (``"fp32"``, ``"bf16"`` or a torch dtype), cold (the
    median of ``repeats`` passes over every copy, :func:`lowrank_lib.timing.timed`), and the copy bandwidth (over
    ``copy_bytes`` buffers) before and after."""
    from .kernels import build, ops

    lib = build.load()
    if not lib.available:
        return {"error": lib.reason}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype, dtype)
    g = torch.Generator().manual_seed(seed)
    bw = [copy_bandwidth("cpu", copy_bytes)]
    rows = []
    for c in gemv_classes(cfg, keep):
        nbytes = sum(o * i for o, i, _ in c["mats"]) * dtype.itemsize
        k = min(2000, max(2, int(stream_bytes // nbytes)))
        Ws = [(torch.randn(o, i, generator=g) * 0.02).to(dtype) for o, i, _ in c["mats"]]
        # distinct memory (cold streams), each copy packed as the engine packs (in the kernels' weight arena)
        sets = [[ops.pack(W) for W in Ws] for _ in range(k)]
        x = torch.randn(1, c["x"], generator=g).to(dtype)
        outs, ins, offs = ([m[j] for m in c["mats"]] for j in range(3))

        def stream():
            for P in sets:
                ops.gemv(x, P, outs, ins, offs)

        t = summary(timed(stream, repeats + 1)[1:])["median_ms"] / 1e3 / k      # the first pass warms up
        rows.append({"class": c["name"], "shapes": [[o, i] for o, i, _ in c["mats"]], "bytes": nbytes,
                     "us_per_call": t * 1e6, "GBps": nbytes / t / 1e9})
    bw.append(copy_bandwidth("cpu", copy_bytes))
    cb = sum(bw) / 2
    for r in rows:
        r["x_copy_bandwidth"] = r["GBps"] / cb
    return {"dtype": str(dtype).replace("torch.", ""), "keep": keep, "threads": torch.get_num_threads(),
            "copy_gbs": cb, "copy_gbs_before_after": bw, "classes": rows}
