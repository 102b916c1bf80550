"""Decode attention in factor space vs AttSVD's rebuild vs dense KV (per step; --e2e/--engine/--ppl: SmolLM2)."""
from __future__ import annotations


def add_arguments(p) -> None:
    from ..options import add_gen_len

    p.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    p.add_argument("--rank-fracs", type=float, nargs="+", default=[0.5, 0.25])
    p.add_argument("--repeats", type=int, default=40)
    p.add_argument("--window", type=int, default=32)
    p.add_argument("--e2e", action="store_true", help="also SmolLM2 end-to-end decode ms/token (transformers)")
    p.add_argument("--e2e-contexts", type=int, nargs="+", default=None)
    add_gen_len(p, 8, "greedy tokens timed (--e2e, --engine)", old="--gen")
    p.add_argument("--engine", action="store_true", help="also the runtime Engine: dense store vs AttSVD store")
    p.add_argument("--engine-contexts", type=int, nargs="+", default=None)
    p.add_argument("--ppl", action="store_true", help="also the continuation-perplexity identity")
    p.add_argument("--ppl-prefill", type=int, default=2048)
    p.add_argument("--tag", default="cpu", help="result name: factor_space_<tag>")
    p.set_defaults(threads=1)


def run(a) -> int:
    import platform
    import time
    from dataclasses import asdict

    import torch

    from ..factor_space import (AttnBenchConfig, FactorDecodeConfig, attention_ratios, bench_attention, bench_decode,
                                bench_engine, continuation_by_rank, markdown)
    from ..results import write_result

    acfg = AttnBenchConfig(contexts=a.contexts, rank_fracs=a.rank_fracs, repeats=a.repeats, window=a.window)
    rows = bench_attention(acfg)
    threads = torch.get_num_threads()
    result = {"meta": {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                       "machine": f"{platform.machine()} {platform.processor() or ''}".strip() +
                       f", torch {torch.__version__}, {threads} thread(s)", "command": a.command_line},
              "attention": {"config": asdict(acfg), "rows": rows, "ratios": attention_ratios(rows)}}
    if a.e2e or a.ppl or a.engine:
        from ... import models

        model, tok = models.load("smollm2")
        if a.e2e:
            dcfg = FactorDecodeConfig(contexts=a.e2e_contexts or a.contexts, rank_fracs=a.rank_fracs,
                                      window=a.window, gen_tokens=a.gen_len)
            result["decode"] = {"config": asdict(dcfg), "rows": bench_decode(model, tok, dcfg)}
        if a.engine:
            ectx = a.engine_contexts or a.contexts
            result["engine"] = {"contexts": ectx, "rows": bench_engine(model, tok, ectx, a.rank_fracs, a.window, a.gen_len)}
        if a.ppl:
            result["ppl"] = continuation_by_rank(model, tok, a.rank_fracs, prefill_len=a.ppl_prefill,
                                                 window=a.window, identity_frac=a.rank_fracs[0])
    md = markdown(result)
    print(md)
    print(f"wrote {write_result(a.out, 'factor_space', a.tag, result, md=md)}")
    return 0
