"""``python -m lowrank_lib.bench decode [options]``: prints a table, writes JSON to benchmarks/results/."""
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
    a = ap.parse_args(argv)
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
