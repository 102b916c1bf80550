"""Decode latency / dispatches / bandwidth of every system on the same factors, side by side."""
from __future__ import annotations


def add_arguments(p) -> None:
    import torch

    from ...runtime.baselines import SYSTEMS
    from ...runtime.decode_bench import DecodeBenchConfig
    from ..options import add_gen_len, add_keep, add_list, add_prompt_len

    d = DecodeBenchConfig()
    p.add_argument("--model", default=d.model, help="smollm2 | tiny-mha | tiny-gqa | tiny-smol | llama7b-random | DIR")
    p.add_argument("--method", default=d.method, help="svd (default) or a lowrank_lib.compress.COMPRESSORS name")
    add_keep(p, d.keep)
    p.add_argument("--checkpoint", default=None, help="read factors from a checkpoint (lowrank_lib.formats)")
    add_prompt_len(p, d.prompt_len)
    add_gen_len(p, d.gen_len)
    p.add_argument("--batch", type=int, default=d.batch)
    p.add_argument("--dtype", default=d.dtype, help="fp32 | bf16 | fp16")
    add_list(p, "--systems", str, d.systems, f"systems, of {SYSTEMS}")
    p.add_argument("--repeats", type=int, default=d.repeats)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=d.seed)


def run(a) -> int:
    from ...runtime.baselines import SYSTEMS
    from pathlib import Path

    from ...resolve import resolve_models
    from ...runtime.decode_bench import DecodeBenchConfig, format_table, run_decode_bench
    from ..options import one
    from ..results import ResultFiles, slug
    from . import report

    unknown = [s for s in a.systems if s not in SYSTEMS]
    if unknown:
        raise SystemExit(f"decode: unknown systems {unknown}; choose from {SYSTEMS}")
    cfg = DecodeBenchConfig(a.model, a.method, one(a.keep, "--keep"), a.checkpoint, one(a.prompt_len, "--prompt-len"),
                            one(a.gen_len, "--gen-len"), a.batch, a.dtype, tuple(a.systems), a.repeats,
                            device=a.device, seed=a.seed)
    res = run_decode_bench(cfg, resolve_models(cfg.model, cfg.checkpoint, method=cfg.method, keep=cfg.keep,
                                               device=cfg.device))
    tag = slug(Path(str(cfg.model)).name, cfg.method, f"k{cfg.keep}", cfg.dtype, f"p{cfg.prompt_len}",
               f"g{cfg.gen_len}", f"b{cfg.batch}")
    return report(ResultFiles(a.out, "decode", tag), {**res, "command": a.command_line}, md=format_table(res))
