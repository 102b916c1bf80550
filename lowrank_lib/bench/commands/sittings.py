"""Every target of the committed result files, across sittings: met in how many, the range, the latest.

    python -m lowrank_lib.bench sittings --issues 29 30 --targets certified_speedup --out benchmarks/results

Reads the ``peer_cpu*``, ``peer_scale_*`` and ``kv_decode*`` JSONs of ``--results`` (each run's own verdicts) and
writes ``sittings.json`` (+ ``.md``: the table). Library: :mod:`lowrank_lib.eval.sittings`.
"""
from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("--results", default="benchmarks/results", help="the folder of result files to read")
    p.add_argument("--issues", type=int, nargs="+", default=None, help="only these issues' targets (default: all)")
    p.add_argument("--targets", nargs="+", default=[], help="with --issues: these targets of other issues too")


def run(a) -> int:
    from ...eval.sittings import across, sittings, table
    from ..results import ResultFiles

    sits = sittings(a.results)
    groups = across(sits, tuple(a.issues) if a.issues else None, tuple(a.targets))
    files, txt = ResultFiles(a.out, "sittings"), table(groups)
    files.write({"files": [s["file"] for s in sits], "groups": groups, "command": a.command_line}, md=txt)
    print(f"{txt}\n\nwrote {files.path}")
    return 0
