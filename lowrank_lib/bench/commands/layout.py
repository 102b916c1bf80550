"""One-row GEMM bandwidth per stored weight layout (cold cache), for every operand shape of the engine."""
from __future__ import annotations


def add_arguments(p) -> None:
    from ..options import add_keep

    p.add_argument("--model", default="smollm2")
    add_keep(p, 0.5)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--working-set-mb", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5)


def run(a) -> int:
    import time
    from pathlib import Path

    from ...runtime import Engine, EngineConfig, parse_dtype
    from ...runtime.bandwidth import engine_operand_shapes, format_layout_table, layout_bench
    from ...resolve import resolve_models
    from ..options import one
    from ..results import ResultFiles, slug
    from . import report

    keep = one(a.keep, "--keep")
    _, comp, _ = resolve_models(a.model, method="svd", keep=keep)
    dt = parse_dtype(a.dtype)
    eng = Engine(comp, EngineConfig(max_seq_len=8, dtype=dt, weight_layout="out_major", fold_rope=True))
    res = layout_bench(engine_operand_shapes(eng), dt, a.working_set_mb, a.repeats)
    res.update(model=a.model, keep=keep, time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
               command=a.command_line)
    return report(ResultFiles(a.out, "layout", slug(Path(a.model).name, f"k{keep}", res["dtype"])), res,
                  md=format_layout_table(res))
