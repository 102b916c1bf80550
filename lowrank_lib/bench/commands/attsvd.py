"""AttSVD budget sweep: every KV method at every budget, KL / perplexity vs dense + long-context tasks.

One sweep task per prefill length and one for the long-context tasks (``--executor ray`` runs them in
parallel, each loading the model once); the JSON is rewritten after each finished task.
"""
from __future__ import annotations

import sys


#: the AttSVD variants and the layer-scope eviction scorers (the composed cache has its own frontier, kv-frontier)
DEFAULT_METHODS = ("attsvd", "attsvd-stream", "svd", "attsvd-km", "attsvd-ext", "streamingllm", "h2o", "snapkv",
                   "keydiff", "h2o_norm", "expected_attention")


def add_arguments(p) -> None:
    import argparse

    from ..options import Deprecated
    from ...executor import add_arguments as add_executor_arguments
    from ...kv import METHODS

    p.add_argument("--model", default="smollm2")
    p.add_argument("--report", action="store_true", help="the report parameters (SmolLM2 up to 8k tokens)")
    p.add_argument("--prompt-len", type=int, nargs="+", help="prefill lengths of the quality windows (space-separated)")
    p.add_argument("--prefill", type=int, nargs="+", dest="prompt_len", action=Deprecated, new="--prompt-len",
                   help=argparse.SUPPRESS)
    p.add_argument("--windows", type=int)
    p.add_argument("--cont", type=int)
    p.add_argument("--budgets", type=float, nargs="+")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=sorted(METHODS))
    p.add_argument("--window", type=int, default=32, help="exact recent window w (AttSVD; eviction scorers without their own rule)")
    p.add_argument("--chunk", type=int, default=128, help="stream chunk l")
    p.add_argument("--step", type=int, default=32, help="teacher-forced continuation tokens per forward")
    p.add_argument("--lengths", type=int, nargs="*", help="long-context prompt lengths (empty: skip)")
    p.add_argument("--n-per", type=int)
    p.add_argument("--tasks", nargs="*", default=["passkey", "needle_single", "needle_multikey", "variable_tracking"])
    p.add_argument("--longctx-budgets", type=float, nargs="+", default=[0.5])
    p.add_argument("--seed", type=int, default=0)
    add_executor_arguments(p)


def run(a) -> int:
    import torch

    from ...eval.kv_sweep import QUICK, REPORT, SweepConfig, table
    from ...executor import SweepError, Task, from_args, run_sweep
    from ..results import ResultFiles, slug

    preset = REPORT if a.report else QUICK
    cfg = SweepConfig(model=a.model, prompt_len=a.prompt_len or preset["prefill"], windows=a.windows or preset["windows"],
                      cont=a.cont or preset["cont"], budgets=a.budgets or preset["budgets"], methods=a.methods,
                      window=a.window, chunk=a.chunk, lengths=preset["lengths"] if a.lengths is None else a.lengths,
                      n_per=a.n_per or preset["n_per"], tasks=a.tasks, step=a.step, seed=a.seed,
                      longctx_budgets=a.longctx_budgets)
    files = ResultFiles(a.out, "attsvd", slug(a.model, "p" + "-".join(map(str, cfg.prompt_len)), f"n{cfg.windows}"))
    meta = {"args": cfg.to_dict(), "torch_threads": torch.get_num_threads(), "command": a.command_line,
            "executor": a.executor}
    tasks = [Task(f"quality_{P}", stage, (cfg, [P], [])) for P in cfg.prompt_len]
    if cfg.lengths and cfg.tasks:
        tasks.append(Task("longctx", stage, (cfg, [], cfg.lengths)))
    done: dict = {}

    def finished(name, part):       # the result so far, rewritten after every task
        done[name] = part
        files.write(merge(done, [t.name for t in tasks]) | meta)

    try:
        run_sweep(tasks, from_args(a), on_result=finished, desc="attsvd")
    except SweepError as e:
        print(f"{e}\npartial results: {files.path}", file=sys.stderr)
        return 1
    res = merge(done, [t.name for t in tasks]) | meta
    txt = table(res)
    files.write(res, txt=txt)
    print(txt)
    print(f"\nwrote {files.path}")
    return 0


def stage(cfg, prompt_len: list[int], lengths: list[int]) -> dict:
    """One sweep task: :func:`budget_sweep` on some prompt lengths and/or the long-context lengths."""
    from dataclasses import replace

    from ...eval.kv_sweep import budget_sweep

    return budget_sweep(replace(cfg, prompt_len=prompt_len, lengths=lengths))


def merge(parts: dict, order: list[str]) -> dict:
    """The finished stages as one :func:`budget_sweep` result (targets recomputed with the long-context part)."""
    from ...eval.kv_sweep import targets

    res: dict = {"quality": {}, "targets": {}, "timing_s": {}}
    for name in order:
        if name in parts:
            p = parts[name]
            res["quality"] |= p["quality"]
            res["timing_s"] |= p["timing_s"]
            if "longctx" in p:
                res["longctx"] = p["longctx"]
    for P, q in res["quality"].items():
        res["targets"][P] = targets(q, res.get("longctx"), 0.5)
    return res
