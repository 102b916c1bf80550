"""KV-memory frontier: every eviction, low-rank and composed cache at byte budgets 0.5 / 0.375 / 0.25 / 0.125.

    python -m lowrank_lib.bench kv-frontier                         # SmolLM2, prefill 2048, 8 windows, seed 0
    python -m lowrank_lib.bench kv-frontier --prompt-len 2048 4096
    python -m lowrank_lib.bench kv-frontier --quick                 # tiny random model, seconds (the test)
    python -m lowrank_lib.bench kv-frontier --shard 0/2 & ... --shard 1/2; then --merge A.json B.json
    python -m lowrank_lib.bench kv-frontier --parts 8 --executor ray [--address auto]   # one task per window set

``--parts N`` splits the windows into N sweep tasks (:mod:`lowrank_lib.executor`: serial by default, Ray
with ``--executor ray``); the result is rewritten, merged, as each task finishes, and a task that fails twice
is reported by name after the others ran (the merged file then holds the finished windows).

Writes ``kv_frontier.json`` (+ ``.txt``, the table): ``rows`` [{policy, kind, prefill, budget, bytes_ratio,
kl_mean, kl_std, ppl, ppl_dense, windows}], ``best`` (per budget the best eviction vs ours, the issue's
target), ``per_window`` (every measurement, so shards merge exactly). Library: ``lowrank_lib.eval.kv_sweep``.
"""
from __future__ import annotations


def add_arguments(p) -> None:
    from ...eval.kv_sweep import FRONTIER_BUDGETS, FRONTIER_COMPOSED, FRONTIER_EVICTION, FRONTIER_LOWRANK
    from ...executor import add_arguments as add_executor_arguments
    from ...kv import METHODS, method_kind
    from ..options import add_budget, add_gen_len, add_prompt_len

    p.add_argument("--model", default=None, help="default smollm2 (tiny-gqa with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny random model, short prefill, 2 windows")
    add_prompt_len(p, None, "prefill lengths (default 2048)")
    p.add_argument("--windows", type=int)
    add_gen_len(p, None, "teacher-forced continuation tokens (default 64)")
    add_budget(p, FRONTIER_BUDGETS)
    for kind, default in (("eviction", FRONTIER_EVICTION), ("lowrank", FRONTIER_LOWRANK), ("composed", FRONTIER_COMPOSED)):
        p.add_argument(f"--{kind}", nargs="*", default=list(default),
                       choices=sorted(n for n in METHODS if method_kind(n) == kind))
    p.add_argument("--window", type=int, default=32, help="exact recent window (AttSVD; policies without their own)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shard", default=None, help="K/N: only windows w with w %% N == K (merge the shards after)")
    p.add_argument("--merge", nargs="+", default=None, help="shard JSON files to merge into one result")
    p.add_argument("--parts", type=int, default=1, help="split the windows into this many sweep tasks")
    add_executor_arguments(p)


def run(a) -> int:
    import json

    import torch

    from ...eval.kv_sweep import FRONTIER_QUICK, FRONTIER_REPORT, FrontierConfig, frontier_table, kv_frontier, \
        merge_frontier
    from ..options import one
    from ..results import ResultFiles, slug
    from . import report, sweep_failed

    if a.merge:
        parts = [json.loads(open(f).read()) for f in a.merge]
        res = merge_frontier(parts) | {"args": parts[0].get("args"), "merged": a.merge, "command": a.command_line}
        return report(ResultFiles(a.out, "kv_frontier"), res, txt=frontier_table(res))
    preset = FRONTIER_QUICK if a.quick else FRONTIER_REPORT
    model = a.model or ("tiny-gqa" if a.quick else "smollm2")
    windows = a.windows or preset["windows"]
    ids = None
    if a.shard:
        k, n = (int(x) for x in a.shard.split("/"))
        ids = [w for w in range(windows) if w % n == k]
    cfg = FrontierConfig(model=model, prompt_len=a.prompt_len or preset["prefill"], windows=windows,
                         cont=one(a.gen_len, "--gen-len") or preset["cont"], budgets=a.budget,
                         policies=[*a.eviction, *a.lowrank, *a.composed], window=a.window, seed=a.seed, window_ids=ids)
    files = ResultFiles(a.out, "kv_frontier", slug("shard" + a.shard.replace("/", "of")) if a.shard else "")
    meta = {"args": cfg.to_dict(), "torch_threads": torch.get_num_threads(), "command": a.command_line,
            "executor": a.executor, "parts": a.parts}
    if a.parts <= 1 and a.executor == "serial":
        res = kv_frontier(cfg, checkpoint=lambda partial: files.write(partial | meta)) | meta
    else:
        from ...executor import SweepError, Task, from_args, run_sweep

        mine = ids if ids is not None else list(range(windows))
        groups = [g for g in (mine[i::a.parts] for i in range(max(a.parts, 1))) if g]
        tasks = [Task(f"windows_{'-'.join(map(str, g))}", kv_frontier, (cfg.with_windows(g),)) for g in groups]
        parts = []

        def merged_so_far(name, part):
            parts.append(part)
            files.write(merge_frontier(parts) | meta | {"finished_tasks": len(parts)})

        try:
            run_sweep(tasks, from_args(a), on_result=merged_so_far, desc="kv-frontier")
        except SweepError as e:
            return sweep_failed(e, files)
        res = merge_frontier(parts) | meta
    return report(files, res, txt=frontier_table(res))
