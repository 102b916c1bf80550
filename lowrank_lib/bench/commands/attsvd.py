"""AttSVD budget sweep: every KV method at every budget, KL / perplexity vs dense + long-context tasks."""
from __future__ import annotations


def add_arguments(p) -> None:
    from ...eval.methods import METHODS

    p.add_argument("--model", default="smollm2")
    p.add_argument("--report", action="store_true", help="the report parameters (SmolLM2 up to 8k tokens)")
    p.add_argument("--prefill", type=int, nargs="+")
    p.add_argument("--windows", type=int)
    p.add_argument("--cont", type=int)
    p.add_argument("--budgets", type=float, nargs="+")
    p.add_argument("--methods", nargs="+", default=[m for m in METHODS if m != "dense"], choices=METHODS)
    p.add_argument("--window", type=int, default=32, help="AttSVD exact window w (also kept by eviction)")
    p.add_argument("--chunk", type=int, default=128, help="stream chunk l")
    p.add_argument("--step", type=int, default=32, help="teacher-forced continuation tokens per forward")
    p.add_argument("--lengths", type=int, nargs="*", help="long-context prompt lengths (empty: skip)")
    p.add_argument("--n-per", type=int)
    p.add_argument("--tasks", nargs="*", default=["passkey", "needle_single", "needle_multikey", "variable_tracking"])
    p.add_argument("--longctx-budgets", type=float, nargs="+", default=[0.5])
    p.add_argument("--seed", type=int, default=0)


def run(a) -> int:
    import torch

    from ...eval.kv_sweep import QUICK, REPORT, budget_sweep, table
    from ..results import ResultFiles, slug

    preset = REPORT if a.report else QUICK
    args = dict(model_name=a.model, prefill=a.prefill or preset["prefill"], windows=a.windows or preset["windows"],
                cont=a.cont or preset["cont"], budgets=a.budgets or preset["budgets"], methods=a.methods,
                window=a.window, chunk=a.chunk, lengths=preset["lengths"] if a.lengths is None else a.lengths,
                n_per=a.n_per or preset["n_per"], tasks=a.tasks, step=a.step, seed=a.seed,
                longctx_budgets=a.longctx_budgets)
    files = ResultFiles(a.out, "attsvd", slug(a.model, "p" + "-".join(map(str, args["prefill"])), f"n{args['windows']}"))
    meta = {"args": args, "torch_threads": torch.get_num_threads(), "command": a.command_line}
    res = budget_sweep(**args, checkpoint=lambda partial: files.write(partial | meta)) | meta
    txt = table(res)
    files.write(res, txt=txt)
    print(txt)
    print(f"\nwrote {files.path}")
    return 0
