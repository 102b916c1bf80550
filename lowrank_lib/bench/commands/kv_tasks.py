"""RULER-style tasks (needle single / multi-key, variable tracking) with the question left uncompressed, every KV policy at byte budgets.

    python -m lowrank_lib.bench kv-tasks                                    # SmolLM2, 4096 and 8192 tokens
    python -m lowrank_lib.bench kv-tasks --prompt-len 4096 --n-per 4 --budget 0.5 0.25 \\
        --policies dense kvzip snapkv attsvd-ext composed-kvzip-q8
    python -m lowrank_lib.bench kv-tasks --quick                            # tiny random model, seconds (the test)
    python -m lowrank_lib.bench kv-tasks --merge A.json B.json              # runs of other seeds/lengths as one table

kvpress's protocol (:mod:`lowrank_lib.eval.kv_tasks`): the context (head + haystack with the needles) is
prefilled and compressed, the question is fed exactly through the compressed cache, the answer is decoded
greedily. A length whose prompt + answer would pass the model's context (SmolLM2: 8192) is built a little
shorter (``kv_tasks.target_tokens``; the rows give the real token counts).

Writes ``kv_tasks_<model>_L<lengths>_n<n-per>.json`` (+ ``.txt``, the table): ``rows`` [{policy, kind, length, budget, bytes_ratio, task,
exact, partial, same_as_dense, n_tokens, n}] (dense rows at budget 1), ``per_sample`` (every answer), the
command. ``--tasks`` names the tasks.
"""
from __future__ import annotations

QUICK = dict(model="tiny-gqa", prompt_len=[192, 320], n_per=1, gen_len=8)


def add_arguments(p) -> None:
    from ...eval.kv_tasks import ADAPTERS, BUDGETS, DEFAULT_POLICIES, TASKS
    from ...kv import METHODS
    from ..options import add_budget, add_gen_len, add_prompt_len

    p.add_argument("--model", default=None, help="default smollm2 (tiny-gqa with --quick, byte tokenizer)")
    p.add_argument("--quick", action="store_true", help="tiny random model, short prompts, one sample per task")
    add_prompt_len(p, None, "prompt lengths (default 4096 8192)")
    p.add_argument("--n-per", type=int, default=None, help="samples per task and length (default 2)")
    p.add_argument("--tasks", nargs="+", default=list(TASKS), choices=["passkey", *TASKS])
    add_budget(p, BUDGETS)
    p.add_argument("--policies", nargs="+", default=list(DEFAULT_POLICIES), choices=sorted(METHODS))
    p.add_argument("--adapter", default="hf", choices=ADAPTERS,
                   help="serve the caches through transformers (hf) or the runtime engine (engine)")
    add_gen_len(p, None, "answer tokens at most (default 24)")
    p.add_argument("--window", type=int, default=32, help="exact recent window of the low-rank caches")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--merge", nargs="+", default=None, help="result JSON files of earlier runs to merge into one")


def run(a) -> int:
    import torch

    from ... import models
    from ...eval.kv_tasks import build_task_samples, evaluate_tasks, tasks_table
    from ...eval.longctx import ByteTokenizer
    from ..options import one
    from ..results import ResultFiles, slug
    from . import report

    if a.merge:
        import json

        from ...eval.kv_tasks import merge_tasks

        parts = [json.loads(open(f).read()) for f in a.merge]
        res = merge_tasks(parts) | {"merged": a.merge, "commands": [p.get("command") for p in parts],
                                    "args": [p.get("args") for p in parts], "command": a.command_line}
        files = ResultFiles(a.out, "kv_tasks", slug(parts[0].get("args", {}).get("model", "model"), "merged"))
        return report(files, res, txt=tasks_table(res))
    model_name = a.model or (QUICK["model"] if a.quick else "smollm2")
    lengths = a.prompt_len or (QUICK["prompt_len"] if a.quick else [4096, 8192])
    n_per = a.n_per or (QUICK["n_per"] if a.quick else 2)
    max_new = one(a.gen_len, "--gen-len") or (QUICK["gen_len"] if a.quick else 24)
    model, tok = models.load(model_name)
    model.eval()
    tok = tok if tok is not None else ByteTokenizer()
    samples = build_task_samples(tok, a.tasks, lengths, n_per, a.seed,
                                 model.config.max_position_embeddings, max_new)
    args = dict(model=model_name, lengths=lengths, n_per=n_per, tasks=a.tasks, budgets=a.budget,
                policies=a.policies, max_new=max_new, window=a.window, seed=a.seed, adapter=a.adapter)
    meta = {"args": args, "command": a.command_line, "torch_threads": torch.get_num_threads(),
            "protocol": "context compressed, question fed exactly through the compressed cache, greedy answer"}
    files = ResultFiles(a.out, "kv_tasks", slug(model_name, "L" + "-".join(map(str, lengths)), f"n{n_per}",
                                                None if a.adapter == "hf" else a.adapter))
    res = evaluate_tasks(model, tok, samples, a.budget, a.policies, a.window, max_new,
                         checkpoint=lambda partial: files.write(partial | meta, txt=tasks_table(partial)),
                         adapter=a.adapter) | meta
    return report(files, res, txt=tasks_table(res))
