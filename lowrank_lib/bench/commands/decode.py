"""Decode latency / dispatches / bandwidth of every system on the same factors, side by side."""
from __future__ import annotations

import torch


def add_arguments(p) -> None:
    from ..options import add_list

    from ...runtime.baselines import SYSTEMS
    from ..decode import DecodeBenchConfig

    d = DecodeBenchConfig()
    p.add_argument("--model", default=d.model, help="smollm2 | tiny-mha | tiny-gqa | tiny-smol | llama7b-random | DIR")
    p.add_argument("--method", default=d.method, help="svd (default) or a lowrank_lib.compress.COMPRESSORS name")
    p.add_argument("--keep", type=float, default=d.keep)
    p.add_argument("--checkpoint", default=None, help="read factors from a checkpoint (lowrank_lib.formats)")
    p.add_argument("--prompt-len", type=int, default=d.prompt_len)
    p.add_argument("--gen-len", type=int, default=d.gen_len)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--dtype", default=d.dtype, help="fp32 | bf16 | fp16")
    add_list(p, "--systems", str, d.systems, f"systems, of {SYSTEMS}")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--count-tokens", type=int, default=d.count_tokens)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=d.seed)


def run(a) -> int:
    from ...runtime.baselines import SYSTEMS
    from ..decode import DecodeBenchConfig, format_table, run_decode_bench
    from ..results import write_result

    systems = tuple(a.systems)
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"{a._prog}: unknown systems {unknown}; choose from {SYSTEMS}")
    cfg = DecodeBenchConfig(a.model, a.method, a.keep, a.checkpoint, a.prompt_len, a.gen_len, a.batch, a.dtype,
                            systems, a.repeats, a.count_tokens, a.device, a.seed)
    res = run_decode_bench(cfg)
    table = format_table(res)
    print(table)
    print(f"\nwrote {write_result(a.out, 'decode', cfg.slug(), {**res, 'command': a.command_line}, md=table)}")
    return 0
