"""Every runtime mechanism on/off under one setting (the notebook-03 table): decode ms/token, dispatches."""
from __future__ import annotations


def add_arguments(p) -> None:
    from ..options import add_gen_len, add_keep, add_list, add_prompt_len

    p.add_argument("--model", default="smollm2")
    add_keep(p, 0.5)
    p.add_argument("--dtype", default="fp32")
    add_prompt_len(p, 256)
    add_gen_len(p, 32)
    p.add_argument("--repeats", type=int, default=2)
    add_list(p, "--baselines", str, ["hf_static"], "runtime.baselines systems, first in the table")
    p.add_argument("--no-compiled", action="store_true", help="skip the whole-step graph rows (compile time)")


def run(a) -> int:
    from pathlib import Path

    from ...runtime import parse_dtype
    from ...runtime.ablation import MECHANISMS, mechanism_table
    from ...resolve import resolve_models
    from ..options import one
    from ..results import ResultFiles, slug
    from . import report

    keep, P, G = one(a.keep, "--keep"), one(a.prompt_len, "--prompt-len"), one(a.gen_len, "--gen-len")
    dense, comp, _ = resolve_models(a.model, method="svd", keep=keep)
    rows = [k for k in MECHANISMS if not (a.no_compiled and "graph" in k)]
    base = tuple(a.baselines)
    table = mechanism_table(comp, dense, P, G, a.repeats, parse_dtype(a.dtype), rows, base)
    key = "speedup_vs_" + (base[0] if base else rows[0])
    lines = ["system | decode ms/tok | prefill ms | ops/tok | speedup", "---|---|---|---|---"]
    lines += [f"{r['system']} | {r['decode_ms']:.2f} | {r['prefill_ms']:.1f} | {r['ops_per_token']:.0f} | {r[key]:.2f}"
              for r in table]
    res = {"model": a.model, "keep": keep, "dtype": a.dtype, "prompt_len": P, "gen_len": G,
           "repeats": a.repeats, "rows": table, "command": a.command_line}
    tag = slug(Path(a.model).name, f"k{keep}", a.dtype, f"p{P}", f"g{G}")
    return report(ResultFiles(a.out, "ablation", tag), res, md="\n".join(lines))
