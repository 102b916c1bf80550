"""All GPU checks of the decode runtime in ONE device call (CUDA; --dry-run: the same pipeline on CPU)."""
from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny model, short lengths (pipeline check)")
    p.add_argument("--repeats", type=int, default=2)


def run(a) -> int:
    import json
    import sys

    import torch

    from ..gpu import checks_markdown, gpu_checks
    from ..results import write_result

    if not a.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on CPU", file=sys.stderr)
        return 2
    report = gpu_checks(a.dry_run, a.repeats)
    print(json.dumps(report["correctness"], indent=1), flush=True)
    text = checks_markdown(report)
    print(text)
    tag = "dry-run" if a.dry_run else f"{report['model']}_{report['dtype']}"
    print(f"wrote {write_result(a.out, 'gpu_checks', tag, {**report, 'command': a.command_line}, md=text)}")
    return 0
