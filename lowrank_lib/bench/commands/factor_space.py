"""Decode attention in factor space vs AttSVD's rebuild vs dense KV (per step; --e2e/--engine/--ppl: SmolLM2)."""
from __future__ import annotations


def add_arguments(p) -> None:
    from ..options import add_gen_len, add_prompt_len

    add_prompt_len(p, [1024, 2048, 4096, 8192], "context lengths (--ppl: its one prefill length)")
    p.add_argument("--rank-fracs", type=float, nargs="+", default=[0.5, 0.25])
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--e2e", action="store_true", help="also SmolLM2 end-to-end decode ms/token (transformers)")
    add_gen_len(p, 8, "greedy tokens timed (--e2e, --engine)")
    p.add_argument("--engine", action="store_true", help="also the runtime Engine: dense store vs AttSVD store")
    p.add_argument("--ppl", action="store_true", help="also the continuation-perplexity identity")
    p.add_argument("--tag", default="cpu", help="result name: factor_space_<tag>")
    p.set_defaults(threads=[1])


def run(a) -> int:
    import time
    from dataclasses import asdict

    import torch

    from ...eval.factor_space import (AttnBenchConfig, FactorDecodeConfig, attention_ratios, bench_attention,
                                      bench_decode, bench_engine, markdown)
    from ...eval.kvquality import continuation_by_rank
    from ...host import cpu_name
    from ..options import one
    from ..results import ResultFiles
    from . import report

    acfg = AttnBenchConfig(contexts=a.prompt_len, rank_fracs=a.rank_fracs, repeats=a.repeats, window=a.window)
    rows = bench_attention(acfg)
    result = {"meta": {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": a.command_line,
                       "machine": f"{cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)"},
              "attention": {"config": asdict(acfg), "rows": rows, "ratios": attention_ratios(rows)}}
    if a.e2e or a.ppl or a.engine:
        from ... import models

        model, tok = models.load("smollm2")
        G = one(a.gen_len, "--gen-len")
        if a.e2e:
            dcfg = FactorDecodeConfig(contexts=a.prompt_len, rank_fracs=a.rank_fracs, window=a.window, gen_tokens=G)
            result["decode"] = {"config": asdict(dcfg), "rows": bench_decode(model, tok, dcfg)}
        if a.engine:
            result["engine"] = {"contexts": a.prompt_len,
                                "rows": bench_engine(model, tok, a.prompt_len, a.rank_fracs, a.window, G)}
        if a.ppl:
            result["ppl"] = continuation_by_rank(model, tok, a.rank_fracs, prefill_len=one(a.prompt_len, "--prompt-len"),
                                                 window=a.window, identity_frac=a.rank_fracs[0])
    return report(ResultFiles(a.out, "factor_space", a.tag), result, md=markdown(result))
