"""Every GPU check (decode runtime + factor-space attention) in ONE device call, inside a time budget.

On the GPU machine (one prepared command, a 10-minute device call, ~9 min of stages; results are
rewritten after each stage, so a killed call keeps what finished)::

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 -m lowrank_lib.bench gpu-session --budget-s 500 --out "$OUT"

On a CPU, ``--dry-run`` runs the same stages on tiny sizes (tested in CI).
"""
from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny sizes (pipeline check)")
    p.add_argument("--budget-s", type=float, default=500.0,
                   help="seconds of device time: stages that no longer fit are not started (default 500)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--stages", nargs="+", default=None, help="run only these stages (see lowrank_lib.bench.gpu)")


def run(a) -> int:
    import sys

    import torch

    from ..gpu import checks_markdown, gpu_session

    if not a.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on CPU", file=sys.stderr)
        return 2
    res = gpu_session(a.out, a.budget_s, a.dry_run, a.repeats, stages=a.stages, command=a.command_line)
    checks, fs = res["gpu_checks"], res["factor_space"]
    print(checks_markdown(checks))
    print({**checks["stages"], **fs["stages"]})
    print("wrote", *res["files"])
    ok = fs["ok"] and bool(checks["correctness"]) and all(r.get("tokens_equal") or "skipped" in r for r in checks["correctness"])
    return 0 if ok else 1
