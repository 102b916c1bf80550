"""``python -m lowrank_lib.bench <command> [options]``: every benchmark of the project, one CLI.

Each command is a module in :data:`COMMANDS` exposing ``add_arguments(parser)`` and ``run(args) -> int``
(its docstring's first line is the help); adding a benchmark is one module and one line here. Every
command takes ``--out FOLDER`` (default ``benchmarks/results``; results are written by
:mod:`lowrank_lib.bench.results`, never overwritten) and ``--threads`` (the :mod:`.options` vocabulary): a
command in :data:`THREAD_SWEEPS` measures each thread count it is given and adds the flag itself (with its
default); every other command gets it here and runs at ``torch.set_num_threads(one(--threads))``.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from .options import add_threads, one
from .results import DEFAULT_OUT

#: command name -> module path (add_arguments(parser), run(args) -> int)
COMMANDS: dict[str, str] = {
    "decode": "lowrank_lib.bench.commands.decode",
    "fidelity": "lowrank_lib.bench.commands.fidelity",
    "layout": "lowrank_lib.bench.commands.layout",
    "ablation": "lowrank_lib.bench.commands.ablation",
    "factor-space": "lowrank_lib.bench.commands.factor_space",
    "attsvd": "lowrank_lib.bench.commands.attsvd",
    "kv-frontier": "lowrank_lib.bench.commands.kv_frontier",
    "kv-tasks": "lowrank_lib.bench.commands.kv_tasks",
    "quality": "lowrank_lib.bench.commands.quality",
    "sweep": "lowrank_lib.bench.commands.sweep",
    "gpu-session": "lowrank_lib.bench.commands.gpu_session",
    "peer": "lowrank_lib.bench.commands.peer",
    "kv-decode": "lowrank_lib.bench.commands.kv_decode",
    "load": "lowrank_lib.bench.commands.load",
    "compressors": "lowrank_lib.bench.commands.compressors",
    "quant-quality": "lowrank_lib.bench.commands.quant_quality",
    "frontier": "lowrank_lib.bench.commands.frontier",
    "compress-memory": "lowrank_lib.bench.commands.compress_memory",
    "sittings": "lowrank_lib.bench.commands.sittings",
}

#: commands whose ``--threads`` is a sweep (each count measured in the same run); they add the flag themselves
THREAD_SWEEPS = frozenset({"peer", "kv-decode", "frontier"})


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m lowrank_lib.bench", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, path in COMMANDS.items():
        mod = importlib.import_module(path)
        help_ = (mod.__doc__ or name).strip().split("\n")[0]
        p = sub.add_parser(name, help=help_, description=(mod.__doc__ or "").strip(),
                           formatter_class=argparse.RawDescriptionHelpFormatter)
        p.add_argument("--out", default=DEFAULT_OUT, help="results folder (never a file; nothing is overwritten)")
        if name not in THREAD_SWEEPS:
            add_threads(p, None, "torch.set_num_threads, one value (default: torch's; the CPU may be shared)")
        mod.add_arguments(p)
        p.set_defaults(command_module=mod)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser().parse_args(argv)
    args.command_line = " ".join(["python -m lowrank_lib.bench", *argv])     # recorded in every result
    if args.command not in THREAD_SWEEPS and args.threads:
        import torch

        torch.set_num_threads(one(args.threads, "--threads"))
    return int(args.command_module.run(args) or 0)
