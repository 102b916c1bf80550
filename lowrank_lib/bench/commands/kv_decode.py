"""KV decode speed: KV methods served by the engine adapter against the engine's dense store, ms/token at long context.

    python -m lowrank_lib.bench kv-decode --prompt-len 8000 --threads 1         # SmolLM2, composed-kvzip-q8 at 0.5/0.25/0.125
    python -m lowrank_lib.bench kv-decode --methods composed-kvzip-q8 kvzip attsvd --budget 0.25
    python -m lowrank_lib.bench kv-decode --quick                              # tiny random model, seconds (the test)

Every system is its own engine that prefills the same WikiText-2 window (seeded random ids for a tokenizer-less
tiny model): the dense store, and a ``MethodStore`` of each registry method at each byte budget (the method fits
inside its engine: KVzip's reconstruction forward is the engine's). Every engine runs the same step mode
(``--graph``, default eager as the engine's own default; ``whole-step`` for the compiled step) and its decode steps are interleaved over ``--repeats`` rounds; the
median ms/token over every step of every round. Attention alone: one decode attention of every layer, timed apart,
back to back and after a flush of the CPU caches (cold: what a step pays; ``lowrank_lib.host.cache_flusher``).

``--dtype bf16`` runs every engine in bf16 (the model's own dtype otherwise: fp32 for SmolLM2).

Writes ``kv_decode.json`` (+ ``.txt``): ``rows`` [{system, budget, context, threads, dtype, graph, attention_kernel,
decode_ms_per_token, decode_iqr_ms, attn_ms_per_token, ratio_vs_dense, speedup_vs_dense, attn_ratio_vs_dense,
attn_cold_ms_per_token, attn_cold_ratio_vs_dense,
kv_bytes_held, bytes_ratio, compiles_s}], the config, the copy bandwidth and the load average before / after.
Library: ``lowrank_lib.eval.kv_decode``.
"""
from __future__ import annotations

QUICK = dict(model="tiny-gqa", prompt_len=[96, 192], gen_len=4, repeats=2)


def add_arguments(p) -> None:
    from ...eval.kv_decode import KVDecodeConfig
    from ..options import add_budget, add_gen_len, add_list, add_prompt_len, add_threads

    d = KVDecodeConfig()
    p.add_argument("--model", default=None, help=f"default {d.model} (tiny-gqa with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny random model, short contexts, 2 rounds")
    add_prompt_len(p, d.prompt_len, "context lengths (prompt tokens)")
    add_list(p, "--methods", str, d.methods, "KV registry methods (lowrank_lib.kv.METHODS)")
    add_budget(p, d.budget)
    add_gen_len(p, d.gen_len, "decode steps timed per round and system")
    p.add_argument("--repeats", type=int, default=None, help=f"interleaved rounds (default {d.repeats})")
    add_threads(p, d.threads, "torch thread counts (each measured side by side)")
    p.add_argument("--graph", default=d.graph, choices=["whole-step", "none"], help="step mode of every engine")
    p.add_argument("--dtype", default=d.dtype, choices=["fp32", "bf16"],
                   help="every engine's dtype (default: the model's own, fp32 for SmolLM2)")
    p.add_argument("--attention", default=d.attention, help="MethodStore attention backend (auto | portable | ...)")
    p.add_argument("--seed", type=int, default=d.seed)


def run(a) -> int:
    from ...eval.kv_decode import KVDecodeConfig, kv_decode, table
    from ..options import one
    from ..results import ResultFiles

    q = QUICK if a.quick else {}
    cfg = KVDecodeConfig(model=a.model or q.get("model", "smollm2"), prompt_len=q.get("prompt_len", a.prompt_len),
                         methods=a.methods, budget=a.budget, gen_len=q.get("gen_len", one(a.gen_len, "--gen-len")),
                         repeats=a.repeats or q.get("repeats", KVDecodeConfig.repeats), threads=a.threads,
                         graph=a.graph, dtype=a.dtype, attention=a.attention, seed=a.seed)
    files = ResultFiles(a.out, "kv_decode")

    def write(res: dict) -> str:            # after every context: an interrupted run keeps what it measured
        txt = table(res["rows"])
        files.write({**res, "command": a.command_line}, txt=txt)
        return txt

    print(write(kv_decode(cfg, on_context=write)))
    print(f"\nwrote {files.path}")
    return 0
