"""Every runtime mechanism on/off under one setting (the notebook-03 table): decode ms/token, dispatches."""
from __future__ import annotations


def add_arguments(p) -> None:
    from ..options import add_list

    p.add_argument("--model", default="smollm2")
    p.add_argument("--keep", type=float, default=0.5)
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--gen-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    add_list(p, "--baselines", str, ["hf_static"], "runtime.baselines systems, first in the table")
    p.add_argument("--no-compiled", action="store_true", help="skip the whole-step graph rows (compile time)")


def run(a) -> int:
    from pathlib import Path

    from ...runtime.config import parse_dtype
    from ..ablation import MECHANISMS, mechanism_table
    from ..models import load_bench_models
    from ..results import slug, write_result

    dense, comp, _ = load_bench_models(a.model, "svd", a.keep)
    rows = [k for k in MECHANISMS if not (a.no_compiled and "graph" in k)]
    base = tuple(a.baselines)
    table = mechanism_table(comp, dense, a.prompt_len, a.gen_len, a.repeats, parse_dtype(a.dtype), rows, base)
    key = "speedup_vs_" + (base[0] if base else rows[0])
    lines = ["system | decode ms/tok | prefill ms | ops/tok | speedup", "---|---|---|---|---"]
    lines += [f"{r['system']} | {r['decode_ms']:.2f} | {r['prefill_ms']:.1f} | {r['ops_per_token']:.0f} | {r[key]:.2f}"
              for r in table]
    print("\n".join(lines))
    res = {"model": a.model, "keep": a.keep, "dtype": a.dtype, "prompt_len": a.prompt_len, "gen_len": a.gen_len,
           "repeats": a.repeats, "rows": table, "command": a.command_line}
    tag = slug(Path(a.model).name, f"k{a.keep}", a.dtype, f"p{a.prompt_len}", f"g{a.gen_len}")
    print(f"wrote {write_result(a.out, 'ablation', tag, res, md=chr(10).join(lines))}")
    return 0
