"""AttSVD budget sweep: every KV method at every budget, KL / perplexity vs dense + long-context tasks.

One sweep task per prefill length and one for the long-context tasks (``--executor ray`` runs them in
parallel, each loading the model once); the JSON is rewritten after each finished task.
"""
from __future__ import annotations

#: the AttSVD variants and the layer-scope eviction scorers (the composed cache has its own frontier, kv-frontier)
DEFAULT_METHODS = ("attsvd", "attsvd-stream", "svd", "attsvd-km", "attsvd-ext", "streamingllm", "h2o", "snapkv",
                   "keydiff", "h2o_norm", "expected_attention")


def add_arguments(p) -> None:
    from ...executor import add_arguments as add_executor_arguments
    from ...kv import METHODS
    from ..options import add_budget, add_gen_len, add_list, add_prompt_len

    p.add_argument("--model", default="smollm2")
    p.add_argument("--report", action="store_true", help="the report parameters (SmolLM2 up to 8k tokens)")
    add_prompt_len(p, None, "prefill lengths of the quality windows (default: the preset's)")
    p.add_argument("--windows", type=int)
    add_gen_len(p, None, "teacher-forced continuation tokens per window (default: the preset's)")
    add_budget(p, None, "byte budgets (default: the preset's)")
    p.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=sorted(METHODS))
    p.add_argument("--window", type=int, default=32, help="exact recent window w (AttSVD; eviction scorers without their own rule)")
    p.add_argument("--chunk", type=int, default=128, help="stream chunk l")
    p.add_argument("--feed", type=int, default=32, help="teacher-forced continuation tokens fed per forward")
    add_list(p, "--longctx-len", int, None, "long-context prompt lengths (default: the preset's)")
    p.add_argument("--n-per", type=int)
    p.add_argument("--tasks", nargs="*", default=["passkey", "needle_single", "needle_multikey", "variable_tracking"],
                   help="long-context task names (none: skip the long-context part)")
    add_list(p, "--longctx-budget", float, [0.5], "--budget of the long-context tasks")
    p.add_argument("--seed", type=int, default=0)
    add_executor_arguments(p)


def run(a) -> int:
    import torch

    from ...eval.kv_sweep import QUICK, REPORT, SweepConfig, merge_sweep, sweep_tasks, table
    from ...executor import SweepError, from_args, run_sweep
    from ..options import one
    from ..results import ResultFiles, slug
    from . import report, sweep_failed

    preset = REPORT if a.report else QUICK
    cfg = SweepConfig(model=a.model, prompt_len=a.prompt_len or preset["prefill"], windows=a.windows or preset["windows"],
                      cont=one(a.gen_len, "--gen-len") or preset["cont"], budgets=a.budget or preset["budgets"],
                      methods=a.methods, window=a.window, chunk=a.chunk, lengths=a.longctx_len or preset["lengths"],
                      n_per=a.n_per or preset["n_per"], tasks=a.tasks, step=a.feed, seed=a.seed,
                      longctx_budgets=a.longctx_budget)
    files = ResultFiles(a.out, "attsvd", slug(a.model, "p" + "-".join(map(str, cfg.prompt_len)), f"n{cfg.windows}"))
    meta = {"args": cfg.to_dict(), "torch_threads": torch.get_num_threads(), "command": a.command_line,
            "executor": a.executor}
    tasks, done = sweep_tasks(cfg), {}

    def merged() -> dict:           # the finished tasks' results, in task order
        return merge_sweep([done[t.name] for t in tasks if t.name in done]) | meta

    def finished(name, part):       # the result so far, rewritten after every task
        done[name] = part
        files.write(merged())

    try:
        run_sweep(tasks, from_args(a), on_result=finished, desc="attsvd")
    except SweepError as e:
        return sweep_failed(e, files)
    res = merged()
    return report(files, res, txt=table(res))

