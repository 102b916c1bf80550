"""``python -m lowrank_lib.bench decode|fidelity|layout [options]``: prints a table, writes JSON to
benchmarks/results/."""
from __future__ import annotations

import argparse

import torch


def main(argv: list[str] | None = None) -> int:
    from ..runtime.baselines import SYSTEMS
    from .decode import DecodeBenchConfig, format_table, run_decode_bench, save

    d = DecodeBenchConfig()
    ap = argparse.ArgumentParser(prog="python -m lowrank_lib.bench")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("decode", help="decode latency / dispatches / bandwidth, all systems side by side")
    p.add_argument("--model", default=d.model, help="smollm2 | tiny-mha | tiny-gqa | tiny-smol | llama7b-random | DIR")
    p.add_argument("--method", default=d.method, help="svd (default) or a lowrank_lib.compress.COMPRESSORS name")
    p.add_argument("--keep", type=float, default=d.keep)
    p.add_argument("--checkpoint", default=None, help="read factors from a checkpoint (lowrank_lib.formats)")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--gen-len", type=int, default=d.gen_len)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--dtype", default=d.dtype, help="fp32 | bf16 | fp16")
    p.add_argument("--systems", default=",".join(d.systems), help=f"comma list of {SYSTEMS}")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--count-tokens", type=int, default=d.count_tokens)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    p.add_argument("--out-dir", default=d.out_dir)
    p.add_argument("--seed", type=int, default=d.seed)
    f = sub.add_parser("fidelity", help="greedy agreement with an fp32 no-cache reference + PPL per runtime path")
    f.add_argument("--model", default="smollm2")
    f.add_argument("--method", default="svd")
    f.add_argument("--keep", type=float, default=0.5)
    f.add_argument("--checkpoint", default=None)
    f.add_argument("--prompts", type=int, default=20)
    f.add_argument("--tokens", type=int, default=64)
    f.add_argument("--dtypes", default="fp32,bf16")
    f.add_argument("--systems", default="hf_dynamic,hf_static,dense_kv,engine")
    f.add_argument("--ppl-seq-len", type=int, default=256)
    f.add_argument("--ppl-windows", type=int, default=2, help="0 = skip perplexity")
    f.add_argument("--threads", type=int, default=None)
    f.add_argument("--out-dir", default=d.out_dir)
    lay = sub.add_parser("layout", help="one-row GEMM bandwidth per stored weight layout (cold cache)")
    lay.add_argument("--model", default="smollm2")
    lay.add_argument("--keep", type=float, default=0.5)
    lay.add_argument("--dtype", default="fp32")
    lay.add_argument("--working-set-mb", type=int, default=256)
    lay.add_argument("--repeats", type=int, default=5)
    lay.add_argument("--threads", type=int, default=None)
    lay.add_argument("--out-dir", default=d.out_dir)
    a = ap.parse_args(argv)
    if a.cmd == "layout":
        from .layout import main as layout_main

        if a.threads:
            torch.set_num_threads(a.threads)
        return layout_main(a)
    if a.cmd == "fidelity":
        if a.threads:
            torch.set_num_threads(a.threads)
        return fidelity_main(a)
    if a.threads:
        torch.set_num_threads(a.threads)
    systems = tuple(s.strip() for s in a.systems.split(",") if s.strip())
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        ap.error(f"unknown systems {unknown}; choose from {SYSTEMS}")
    cfg = DecodeBenchConfig(a.model, a.method, a.keep, a.checkpoint, a.prompt_len, a.gen_len, a.batch, a.dtype,
                            systems, a.repeats, a.count_tokens, a.device, a.seed, a.out_dir)
    res = run_decode_bench(cfg)
    print(format_table(res))
    print(f"\nwrote {save(res, a.out_dir)}")
    return 0


def fidelity_main(a) -> int:
    import json
    from pathlib import Path

    from ..runtime.config import parse_dtype
    from ..runtime.fidelity import audit, perplexity_table
    from .models import load_bench_models

    dense, comp, tok = load_bench_models(a.model, a.method, a.keep, a.checkpoint)
    if tok is None:
        raise SystemExit(f"model {a.model!r} has no tokenizer: the fidelity audit needs real prompts")
    systems = tuple(s for s in a.systems.split(",") if s)
    res = {"model": a.model, "method": a.method, "keep": a.keep, "prompts": a.prompts, "tokens": a.tokens,
           "reference": "fp32, no cache (full recompute each step), same factors", "audit": {}, "ppl": {}}
    for d in a.dtypes.split(","):
        r = audit(comp, tok, systems, parse_dtype(d), a.prompts, a.tokens, dense)
        res["audit"][d] = r["systems"]
        print(d, {s: {k: v for k, v in x.items() if k != "per_prompt_match"} for s, x in r["systems"].items()}, flush=True)
        if a.ppl_windows:
            res["ppl"][d] = perplexity_table(comp, tok, systems, parse_dtype(d), a.ppl_seq_len, a.ppl_windows, dense)
            print(d, "ppl", res["ppl"][d], flush=True)
    lines = ["system | dtype | exact | first | mean match | ppl prefill | ppl decode", "---|---|---|---|---|---|---"]
    for d, rows in res["audit"].items():
        for s, x in rows.items():
            pp = res["ppl"].get(d, {}).get(s, {})
            lines.append(f"{s} | {d} | {x['exact']}/{a.prompts} | {x['first']}/{a.prompts} | {x['mean_match']:.3f} | "
                         f"{pp.get('prefill', float('nan')):.3f} | {pp.get('decode', float('nan')):.3f}")
    print("\n".join(lines))
    out = Path(a.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"fidelity_{Path(a.model).name}_{a.method}_k{a.keep}_n{a.prompts}x{a.tokens}"
    p, i = out / f"{stem}.json", 2
    while p.exists():
        p, i = out / f"{stem}_{i}.json", i + 1
    p.write_text(json.dumps({**res, "table": lines}, indent=1))
    print(f"wrote {p}")
    return 0
