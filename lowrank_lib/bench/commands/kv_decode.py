"""KV decode speed: the composed cache against the dense cache, ms/token at long context, in the runtime engine.

    python -m lowrank_lib.bench kv-decode                        # SmolLM2, contexts 2048 4096 8000, 1 and 2 threads
    python -m lowrank_lib.bench kv-decode --contexts 8000 --threads 1
    python -m lowrank_lib.bench kv-decode --quick                # tiny random model, seconds (the test)

Per context: ONE engine prefill of a WikiText-2 window (seeded random ids for a tokenizer-less tiny model)
into the dense store, whose recorded post-RoPE q/k/v then build every composed store (the same tiers an
engine prefill into that store builds: ``ComposedStore.store_prefill`` / ``end_prefill``), so all stores
decode the same context. Composed stores: ``ComposedConfig(scorer=--scorer)`` (``h2o_norm`` by default:
KVzip scores with a forward of the transformers model and is not an engine store) at each budget, fp and
``quant8``, with the attention ``auto`` (the packed layout, ``composed.kv.attend_layer``) and ``ragged`` (the
per-head reference loop: what the store ran before the packed layout). Decode: ``--new`` teacher-forced
tokens (the window's continuation) per run, every store rewound to the same context; runs interleaved
over ``--repeats`` rounds (stores and thread counts in turn), median ms/token over every step of every round.
Attention only: every layer's ``store.attend`` on the same query and step context, after the run, timed apart.

Writes ``kv_decode.json`` (+ ``.txt``): ``rows`` [{store, attention, budget, quant8, context, threads,
decode_ms_per_token, attn_ms_per_token, kv_bytes, prompt_kv_bytes, ratio_vs_dense, attn_ratio_vs_dense}],
the command and the load average before / after (what else was running shows there). Library:
``lowrank_lib.bench.kv_decode``.
"""
from __future__ import annotations

OWN_THREADS = True


def add_arguments(p) -> None:
    p.add_argument("--model", default=None, help="default smollm2 (tiny-gqa with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny random model, short context, few steps")
    p.add_argument("--contexts", type=int, nargs="+", help="prefill lengths (default 8000 2048 4096)")
    p.add_argument("--new", type=int, help="decode steps per run (default 32)")
    p.add_argument("--repeats", type=int, help="interleaved rounds (default 3)")
    p.add_argument("--budgets", type=float, nargs="+", default=[0.5, 0.25, 0.125])
    p.add_argument("--scorer", default="h2o_norm", help="layer-scope eviction scorer ranking the tokens")
    p.add_argument("--attention", nargs="+", default=["auto", "ragged"], help="composed attention modes to time")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="torch thread counts, interleaved")
    p.add_argument("--seed", type=int, default=0)


def run(a) -> int:
    from ..kv_decode import kv_decode

    kv_decode(a)
    return 0
