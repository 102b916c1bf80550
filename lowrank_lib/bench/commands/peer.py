"""llama.cpp (dense) side by side with lowrank_lib's dense and low-rank engines on the CPU (SmolLM2, or --shape).

    python -m lowrank_lib.bench peer --threads 1 2 --dtypes fp32 bf16 --repeats 3     # SmolLM2, one process
    python -m lowrank_lib.bench peer --shape llama2-7b --threads 1                     # one system per process
    python -m lowrank_lib.bench peer --replot benchmarks/results/peer_cpu_4.json       # figures of a result

``--threads`` is a sweep: every count is measured in the same run. The SmolLM2 run is
:func:`lowrank_lib.bench.peer.run_peer`, ``--shape`` :func:`lowrank_lib.bench.peer_scale.run_scale`.
"""
from __future__ import annotations

import json
from pathlib import Path

from ..options import add_gen_len, add_keep, add_list, add_prompt_len, add_threads, one
from ..peer import PeerConfig, run_peer, save, save_figures, table
from ..peer_base import LM_HEADS, SYSTEMS
from ..peer_scale import QUANTS, ScaleConfig, committed_results, run_scale
from ..peer_scale import save_figures as save_scale_figure
from ..peer_scale import table as scale_table
from ..results import ResultFiles


def add_arguments(p) -> None:
    from ...models import SHAPES

    d = PeerConfig()
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="random weights at this geometry, one system per process (bench/peer_scale.py)")
    p.add_argument("--model", default=d.model, help="smollm2 (default) or a tiny preset / local HF dir")
    add_keep(p, None, "keep ratio(s) of the low-rank system (SmolLM2: one, plain SVD, default 0.5; --shape: random "
                      "factors, default 0.5 0.8)")
    add_list(p, "--dtypes", str, None, "fp32 bf16 (SmolLM2 default fp32 bf16; --shape: default by shape)")
    add_threads(p, d.threads, "thread counts, each measured in the same run")
    add_prompt_len(p, d.prompt_len, "prompt tokens (one value)")
    add_gen_len(p, d.gen_len, "new greedy tokens per generation and per audit prompt (one value)")
    p.add_argument("--repeats", type=int, default=d.repeats)
    add_list(p, "--systems", str, d.systems, f"of {SYSTEMS}")
    add_list(p, "--lm-heads", str, None, f"LM heads of our systems (SmolLM2: of {LM_HEADS}, default both; --shape: "
                                         "any EngineConfig.lm_head, e.g. q8, default exact)")
    p.add_argument("--rounds", type=int, default=1, help="--shape: children run in turn (A B C A B C), median round")
    add_list(p, "--quants", str, None, f"llama.cpp quantizations of the BF16 file (default {' '.join(QUANTS)}; "
                                       "'none': no quantized row)")
    add_list(p, "--factor-bits", int, None, "our keep factors also quantized to these bits (bf16 rows; 0: none; "
                                            f"SmolLM2 default {' '.join(map(str, d.factor_bits))}, --shape default none)")
    p.add_argument("--layers", type=int, default=None, help="--shape: a reduced layer count (dry runs)")
    p.add_argument("--cleanup", action="store_true", help="--shape: delete the generated weights and GGUFs after")
    p.add_argument("--graph", default=d.graph, choices=("whole-step", "none"), help="our engine's decode step")
    p.add_argument("--llama-flash-attn", default=None, choices=("auto", "on", "off"),
                   help="SmolLM2 default auto (the faster in a probe); --shape default on")
    p.add_argument("--prompt", default=d.prompt, choices=("wikitext", "random"))
    p.add_argument("--audit-prompts", type=int, default=d.audit_prompts,
                   help="SmolLM2: certified head vs exact head on this many fidelity prompts (0 = no audit)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. what else was running)")
    p.add_argument("--figures", default="figures", help="folder for the figures ('' = none)")
    p.add_argument("--replot", default=None, nargs="+", metavar="JSON",
                   help="only redraw the figures of committed results (peer_cpu*.json, or peer_scale*.json)")


def _quants(a, default) -> tuple:
    return () if a.quants == ["none"] else tuple(a.quants or default)


def config_from_args(a) -> PeerConfig:
    """The SmolLM2 run's config (one keep, one prompt and generation length)."""
    if a.keep and len(a.keep) != 1:
        raise SystemExit(f"--keep {' '.join(map(str, a.keep))}: the SmolLM2 peer runs one keep (several need --shape)")
    return PeerConfig(model=a.model, keep=(a.keep or [PeerConfig.keep])[0],
                      dtypes=tuple(a.dtypes or PeerConfig.dtypes),
                      threads=tuple(a.threads), prompt_len=one(a.prompt_len, "--prompt-len"),
                      gen_len=one(a.gen_len, "--gen-len"), repeats=a.repeats,
                      systems=tuple(a.systems), lm_heads=tuple(a.lm_heads or PeerConfig.lm_heads),
                      graph=a.graph, llama_flash_attn=a.llama_flash_attn or "auto", prompt=a.prompt,
                      audit_prompts=a.audit_prompts, seed=a.seed, out=a.out, note=a.note,
                      quants=_quants(a, PeerConfig.quants), factor_bits=tuple(b for b in a.factor_bits or PeerConfig.factor_bits if b))


def scale_config_from_args(a) -> ScaleConfig:
    """The ``--shape`` run's config (its own checks: :class:`~lowrank_lib.bench.peer_scale.ScaleConfig`)."""
    return ScaleConfig(shape=a.shape, keeps=tuple(a.keep or (0.5, 0.8)), dtypes=a.dtypes, threads=tuple(a.threads),
                       quants=_quants(a, QUANTS), systems=tuple(a.systems), factor_bits=tuple(b for b in a.factor_bits or () if b),
                       lm_heads=tuple(a.lm_heads or ('exact',)), rounds=a.rounds,
                       prompt_len=one(a.prompt_len, "--prompt-len"), gen_len=one(a.gen_len, "--gen-len"),
                       repeats=a.repeats, layers=a.layers, graph=a.graph, llama_flash_attn=a.llama_flash_attn or "on",
                       seed=a.seed, out=a.out, cleanup=a.cleanup, note=a.note)


def run(a) -> int:
    if a.figures or a.replot:
        import matplotlib

        matplotlib.use("Agg")
    if a.replot:
        results = [json.loads(Path(p).read_text()) for p in a.replot]
        scale = [r for r in results if r.get("rows") and "layers" in r["rows"][0]]      # one child per system
        if scale:
            print(f"wrote {save_scale_figure(scale, a.figures or 'figures')}")
        for res in (r for r in results if r not in scale):
            print("wrote " + ", ".join(save_figures(res, a.figures or "figures")))
        return 0
    if a.shape:
        cfg = scale_config_from_args(a)
        files = ResultFiles(cfg.out, "peer_scale", cfg.slug())
        res = run_scale(cfg)
        res["command"], text = a.command_line, scale_table(res)
        print(f"{text}\n\nwrote {files.write(res, txt=text)}")
        if a.figures and cfg.layers is None:
            others = [r for r in committed_results(cfg.out) if r["config"]["shape"] != cfg.shape]
            print(f"wrote {save_scale_figure(others + [res], a.figures)}")
        return 1 if res["failed"] else 0       # written with what did run; the table names what failed
    cfg = config_from_args(a)
    res = run_peer(cfg)
    res["command"], text = a.command_line, table(res)
    print(f"{text}\n\nwrote {save(res, cfg.out, text)}")
    if a.figures:
        print("wrote " + ", ".join(save_figures(res, a.figures)))
    return 1 if res["failed"] else 0
