"""Factor-space attention at LLaMA-7B head counts, 1k-32k, and the AttSVD store under CUDA graphs (one call)."""
from __future__ import annotations


def add_arguments(p) -> None:
    p.add_argument("--dry-run", action="store_true", help="CPU, small sizes (pipeline check)")


def run(a) -> int:
    import json
    import sys

    import torch

    from ..gpu import gpu_factor_space
    from ..results import write_result

    if not a.dry_run and not torch.cuda.is_available():
        print("no CUDA device: use --dry-run on CPU", file=sys.stderr)
        return 2
    result, md = gpu_factor_space(a.dry_run)
    print(json.dumps({"correctness": result["correctness"], "engine_graphs": result["engine_graphs"]}, indent=1))
    print(md)
    tag = "dry-run" if a.dry_run else "cuda"
    print(f"wrote {write_result(a.out, 'factor_space_gpu', tag, {**result, 'command': a.command_line}, md=md)}")
    return 0 if result["ok"] else 1
