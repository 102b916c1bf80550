"""Greedy agreement with an fp32 no-cache reference + perplexity through each runtime path (the audit)."""
from __future__ import annotations


def add_arguments(p) -> None:
    from ..options import add_gen_len, add_keep, add_list, add_prompt_len

    p.add_argument("--model", default="smollm2")
    p.add_argument("--method", default="svd")
    add_keep(p, 0.5)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--prompts", type=int, default=20)
    add_gen_len(p, 64, "greedy tokens per prompt")
    add_list(p, "--dtypes", str, ["fp32", "bf16"], "dtypes audited")
    add_list(p, "--systems", str, ["hf_dynamic", "hf_static", "dense_kv", "engine"], "systems audited")
    add_prompt_len(p, 256, "perplexity window tokens")
    p.add_argument("--windows", type=int, default=2, help="perplexity windows (0 = skip perplexity)")


def run(a) -> int:
    from pathlib import Path

    from ...eval.fidelity import audit, perplexity_table
    from ...runtime import parse_dtype
    from ...resolve import resolve_models
    from ..options import one
    from ..results import ResultFiles, slug
    from . import report

    keep, G, P = one(a.keep, "--keep"), one(a.gen_len, "--gen-len"), one(a.prompt_len, "--prompt-len")
    dense, comp, tok = resolve_models(a.model, a.checkpoint, method=a.method, keep=keep)
    if tok is None:
        raise SystemExit(f"model {a.model!r} has no tokenizer: the fidelity audit needs real prompts")
    systems = tuple(a.systems)
    res = {"model": a.model, "method": a.method, "keep": keep, "prompts": a.prompts, "tokens": G,
           "reference": "fp32, no cache (full recompute each step), same factors", "audit": {}, "ppl": {}}
    for d in a.dtypes:
        r = audit(comp, tok, systems, parse_dtype(d), a.prompts, G, dense)
        res["audit"][d] = r["systems"]
        print(d, {s: {k: v for k, v in x.items() if k != "per_prompt_match"} for s, x in r["systems"].items()}, flush=True)
        if a.windows:
            res["ppl"][d] = perplexity_table(comp, tok, systems, parse_dtype(d), P, a.windows, dense)
            print(d, "ppl", res["ppl"][d], flush=True)
    lines = ["system | dtype | exact | first | mean match | ppl prefill | ppl decode", "---|---|---|---|---|---|---"]
    for d, rows in res["audit"].items():
        for s, x in rows.items():
            pp = res["ppl"].get(d, {}).get(s, {})
            lines.append(f"{s} | {d} | {x['exact']}/{a.prompts} | {x['first']}/{a.prompts} | {x['mean_match']:.3f} | "
                         f"{pp.get('prefill', float('nan')):.3f} | {pp.get('decode', float('nan')):.3f}")
    tag = slug(Path(a.model).name, a.method, f"k{keep}", f"n{a.prompts}x{G}")
    return report(ResultFiles(a.out, "fidelity", tag), {**res, "table": lines, "command": a.command_line},
                  md="\n".join(lines))
