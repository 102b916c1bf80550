"""Compressing a dense model of a real geometry (random weights): time and peak memory of calibration + compressor.

    python -m lowrank_lib.bench compress-memory --shape llama3.2-1b --methods svdllm --keep 0.8
    python -m lowrank_lib.bench compress-memory --shape llama3.2-1b --layers 2 --methods svdllm dobi   # minutes

Each method in its own child (``eval.compressors.compress_at_shape``: what it runs and returns), with the child's
peak RSS / anonymous / file-backed memory. Writes ``compress_memory_<shape>.json``.
"""
from __future__ import annotations


def add_arguments(p) -> None:
    from ..options import add_keep

    p.add_argument("--shape", default="llama3.2-1b", help="a geometry of lowrank_lib.models.SHAPES")
    p.add_argument("--layers", type=int, default=None, help="cut the layer count (default: the geometry's)")
    p.add_argument("--methods", nargs="+", default=["svdllm"], help="families that calibrate (COMPRESSORS)")
    add_keep(p, 0.8, "fraction of parameters kept (one value)")
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--calib-len", type=int, default=256, help="tokens per calibration sample")
    p.add_argument("--note", default="", help="recorded in the JSON (e.g. which library commit ran)")


def run(a) -> int:
    import torch

    from ...host import available_memory, copy_bandwidth, load_average, machine, physical_memory
    from ..child import run_child
    from ..options import one
    from ..results import ResultFiles, slug
    from . import report

    keep = one(a.keep, "--keep")
    files = ResultFiles(a.out, "compress_memory", slug(a.shape, f"L{a.layers}" if a.layers else ""))
    mem = {"memory_gib": round(physical_memory() / 2 ** 30, 1), "available_gib": round(available_memory() / 2 ** 30, 1)}
    res = {"command": a.command_line, "note": a.note, "machine": {**machine(), **mem},
           "threads": torch.get_num_threads(), "copy_bandwidth_GBps": copy_bandwidth("cpu"),
           "load_average": {"start": load_average()}, "rows": []}
    for method in a.methods:
        r = run_child("lowrank_lib.eval.compressors:compress_at_shape", shape=a.shape, method=method, keep=keep,
                      calib_samples=a.calib_samples, calib_len=a.calib_len, layers=a.layers)
        res["rows"].append({**r["result"], "peak_rss": r["peak_rss"], "peak_anon": r["peak_anon"],
                            "peak_file": r["peak_file"], "wall_s": round(r["wall_s"], 1)})
        files.write(res)
    res["load_average"]["end"] = load_average()
    gib = 2 ** 30
    lines = ["| method | layers | calibration s | compress s | X^T X (GiB) | peak RSS (GiB) | peak anon (GiB) |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['layers']} | {r['calib_s']} | {r['compress_s']} | {r['stats_bytes'] / gib:.2f} | "
              f"{r['peak_rss'] / gib:.2f} | {r['peak_anon'] / gib:.2f} |" for r in res["rows"]]
    return report(files, res, md="\n".join(lines))
