"""Attention time per token of the tiered (composed) KV against the dense store's, side by side in one run.

The dense store is the engine's ``DenseKV`` after a real prefill (its attention backend, ``cpu_lrk`` on an AVX-512
CPU, is recorded); the tiered layers are the composed cache as it allocates them at each byte budget (a layer-scope
scorer ranks the tokens, ``composed.plan.allocate`` splits the budget into an exact tier and an int8 low-rank tier,
``composed.build`` fits it), converted to the ``kv.tiers`` layout and attended by the backend
``kv.tiers.select_backend`` picks (the fused kernel ``cpu_lrk`` where it can run). Per (store, thread count): the
median time of one token's attention over every layer (interleaved rounds, the order rotated per round), its ratio
to dense, the issue-19 target, the bytes attention reads per token and the bandwidth that is (beside the copy
bandwidth measured in the same run, start and end), and how far the kernel is from the portable path on layer 0.
Each layer's call is timed too: the sum of the layers' fastest times (``attn_ms_floor``) is the comparison that a
shared machine's preemptions do not reach.

    >>> from lowrank_lib.bench.tier_attention import TierAttentionConfig, tier_attention
    >>> res = tier_attention(TierAttentionConfig(context=8000, threads=(1,)))     # writes benchmarks/results/...

No CLI of its own: ``bench kv-decode`` calls it.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
from tqdm.auto import tqdm

from .results import DEFAULT_OUT

#: issue 19: tiered attention time per token at most this fraction of dense attention, per budget (8k context)
TARGETS = {0.5: 0.6, 0.25: 0.35, 0.125: 0.2}


@dataclass
class TierAttentionConfig:
    """One run: the model, the context, the budgets (fractions of the dense KV bytes), the composed allocation."""

    model: str = "smollm2"
    context: int = 8000
    budgets: tuple[float, ...] = (0.5, 0.25, 0.125)
    threads: tuple[int, ...] = (1,)
    repeats: int = 15                 # interleaved rounds
    inner: int = 5                    # timings of one token's attention per store and round
    scorer: str = "h2o_norm"          # a layer-scope eviction policy (the engine's scorers)
    mode: str = "global"
    mid_share: float = 0.25
    rank: int = 8
    quant8: bool = True
    attention: str = "auto"           # kv.tiers backend ("auto": the fused kernel where it can run)
    seed: int = 0
    out: str = DEFAULT_OUT
    progress: bool = True
    command: str = ""                 # the command line that ran this (recorded)

    def slug(self) -> str:
        from .results import slug

        return slug(self.model, f"c{self.context}", self.scorer, "q8" if self.quant8 else "", f"r{self.rank}",
                    "t" + "-".join(map(str, self.threads)))


def tiered_layers(cache, quant8: bool, dtype: torch.dtype | None = None) -> list:
    """A built composed cache (``ComposedCache``) as one :class:`~lowrank_lib.kv.tiers.TieredLayer` per layer: per
    (row, KV head) its exact rows and positions, its low-rank tier as one run (int8 factors re-quantised from their
    dequantised values: the same int8 rows and scales, as the scales are representable)."""
    from ..kv.tiers import Run, Segment, TieredLayer

    out = []
    for layer in cache.layers:
        segs = []
        for row in layer.heads:
            r = []
            for ht in row:
                f = ht.mid_factors()
                runs = [] if f is None else [Run(*f, ht.pos_mid)]
                r.append(Segment(ht.k_exact, ht.v_exact, ht.pos_exact, runs))
            segs.append(r)
        out.append(TieredLayer.build(segs, quant8=quant8, dtype=dtype))
    return out


def read_bytes(layer) -> int:
    """Bytes the attention of one decode token reads from a tiered layer: every tensor it holds except the kept
    positions (attention never reads them), appended rows as written."""
    pos = sum(t.numel() * t.element_size() for t in (layer.pos_exact, layer.pos_mid) if t is not None)
    return layer.nbytes - pos


def tier_attention(cfg: TierAttentionConfig | None = None) -> dict:
    """Run the benchmark ``cfg``; writes ``tier_attention_<slug>.json`` (+ ``.txt``) and returns the result."""
    from .. import models
    from ..composed import ComposedConfig, build
    from ..composed.build import importance, make_policy
    from ..eval.kv_sweep import frontier_windows
    from ..hf.record import record_prefill
    from ..kv.tiers import attend, attend_portable, select_backend
    from ..runtime import Engine, EngineConfig
    from ..runtime.kernels.build import status
    from ..runtime.kv import DenseKV
    from .decode import copy_bandwidth
    from .results import ResultFiles, load_average

    cfg = cfg or TierAttentionConfig()
    say = (lambda m: tqdm.write(m)) if cfg.progress else (lambda m: None)
    cpu = torch.device("cpu")
    meta = {"config": asdict(cfg), "command": cfg.command or f"tier_attention({cfg!r})",
            "load_average": {"start": load_average()}, "copy_GBps": {"start": round(copy_bandwidth(cpu), 2)},
            "note": "one token's attention over every layer; stores interleaved, order rotated per round; "
                    "attn_ms_per_token: median over every pass of every round; attn_ms_floor: sum over layers of each "
                    "layer's fastest time (robust to preemption on a shared machine). Copy bandwidth counts bytes read "
                    "+ written; read_GBps counts the bytes attention reads (median pass)."}
    model, tok = models.load(cfg.model)
    model.eval()
    C = cfg.context
    ids = frontier_windows(tok, model, 1, C + 1, cfg.seed)[:1, :C]
    # ---- dense: the engine's store after a real prefill
    t0 = time.perf_counter()
    eng = Engine(model, EngineConfig(max_batch=1, max_seq_len=C + 2), kv=DenseKV())
    eng.prefill(ids)
    say(f"[tier-attention] dense prefill {C}: {time.perf_counter() - t0:.1f} s, attention {eng.backend.name}")
    L, Hkv, G, d = eng.n_layers, eng.n_kv, eng.n_heads // eng.n_kv, eng.head_dim
    ctx = eng.step_context(1, eng.cursor.host + 1)         # as the next decode step reads: the prompt + its slot
    row_bytes = 2 * Hkv * d * eng.dtype.itemsize            # one token's K and V rows of one layer
    dense_read, dense_prompt = L * (C + 1) * row_bytes, L * C * row_bytes
    # ---- tiered: the composed cache's allocation at each budget, in the kv.tiers layout
    t0 = time.perf_counter()
    rec = record_prefill(model, ids)
    ccfg = ComposedConfig(scorer=cfg.scorer, mode=cfg.mode, mid_share=cfg.mid_share, rank=cfg.rank, quant8=cfg.quant8)
    imp = importance(make_policy(cfg.scorer, model), model, tok, ids, rec, ccfg.window, ccfg.obs_window)
    choice = select_backend(cfg.attention, cpu, d, eng.dtype)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    qa = torch.randn(1, Hkv, G, d, generator=g, dtype=eng.dtype)
    qt = qa.reshape(1, Hkv * G, 1, d)
    n_new = torch.ones(1, dtype=torch.long)
    tiered, info = {}, {}
    for b in cfg.budgets:
        layers = tiered_layers(build(rec, imp, b, ccfg), cfg.quant8, eng.dtype)
        held = sum(lay.nbytes for lay in layers)
        for lay in layers:                                   # the current token: one appended row
            lay.reserve(16)
            lay.append(torch.randn(1, Hkv, 1, d, generator=g, dtype=eng.dtype),
                       torch.randn(1, Hkv, 1, d, generator=g, dtype=eng.dtype))
        ref = attend_portable(layers[0], qt)
        err = float((attend(layers[0], qt, None, n_new, choice.name) - ref).abs().max() / ref.abs().max())
        counts = [lay.counts() for lay in layers]
        info[b] = {"kv_bytes": held, "budget_held": round(held / dense_prompt, 4),
                   "bytes_read": sum(read_bytes(lay) for lay in layers),
                   "tokens": {k: sum(c[k] for c in counts) for k in ("exact", "mid", "appended")},
                   "kernel_vs_portable_max_rel": err}
        tiered[b] = layers
        say(f"[tier-attention] budget {b}: {info[b]['tokens']}, held {info[b]['budget_held']:.3f} of dense, "
            f"{choice.name} vs portable {err:.1e}")
    del rec, imp
    say(f"[tier-attention] layouts built: {time.perf_counter() - t0:.1f} s")

    def run(key, out: list[list[float]]):
        """One token's attention over every layer; out[i] gets layer i's time."""
        for i in range(L):
            t0 = time.perf_counter()
            if key == "dense":
                eng.kv.attend(i, qa, ctx)
            else:
                attend(tiered[key][i], qt, None, n_new, choice.name)
            out[i].append(time.perf_counter() - t0)

    keys = ["dense", *cfg.budgets]
    per_layer = {(k, th): [[] for _ in range(L)] for k in keys for th in cfg.threads}
    before = torch.get_num_threads()
    try:
        with torch.no_grad():
            for k in keys:                                   # warm-up (page faults, first calls)
                run(k, [[] for _ in range(L)])
            for r in tqdm(range(cfg.repeats), desc="tier-attention rounds", disable=not cfg.progress):
                for th in cfg.threads:
                    torch.set_num_threads(th)
                    for k in keys[r % len(keys):] + keys[:r % len(keys)]:
                        for _ in range(cfg.inner):
                            run(k, per_layer[(k, th)])
    finally:
        torch.set_num_threads(before)
    meta["copy_GBps"]["end"] = round(copy_bandwidth(cpu), 2)
    meta["load_average"]["end"] = load_average()
    copy = min(meta["copy_GBps"].values())
    rows = []
    # per pass: the sum of its layers' times; floor: the sum of each layer's fastest time (what a shared machine's
    # preemptions do not reach: the comparison to use there)
    passes = {key: [sum(ts) for ts in zip(*lists)] for key, lists in per_layer.items()}
    floor = {key: sum(min(ts) for ts in lists) for key, lists in per_layer.items()}
    for th in cfg.threads:
        d_s, d_f = statistics.median(passes[("dense", th)]), floor[("dense", th)]
        for k in keys:
            s, f = statistics.median(passes[(k, th)]), floor[(k, th)]
            nbytes = dense_read if k == "dense" else info[k]["bytes_read"]
            row = {"store": "dense" if k == "dense" else f"composed-{cfg.scorer}{'-q8' if cfg.quant8 else ''}",
                   "attention": eng.backend.name if k == "dense" else choice.name,
                   "budget": None if k == "dense" else k, "threads": th, "context": C,
                   "attn_ms_per_token": round(s * 1e3, 3), "attn_ratio_vs_dense": round(s / d_s, 3),
                   "attn_ms_floor": round(f * 1e3, 3), "attn_floor_ratio_vs_dense": round(f / d_f, 3),
                   "bytes_read": nbytes, "read_GBps": round(nbytes / s / 1e9, 2),
                   "read_vs_copy": round(nbytes / s / 1e9 / copy, 3)}
            if k != "dense":
                row.update(info[k])
                row["target_ratio"] = TARGETS.get(k)
                row["meets_target"] = None if k not in TARGETS else row["attn_ratio_vs_dense"] <= TARGETS[k]
            rows.append(row)
    res = {"rows": rows, **meta, "model": cfg.model, "shapes": {"layers": L, "kv_heads": Hkv, "group": G,
                                                                "head_dim": d, "dtype": str(eng.dtype)},
           "dense_backend": {"name": eng.backend.name, "reason": eng.backend.reason},
           "tier_backend": {"name": choice.name, "reason": choice.reason}, "kernels": status()}
    files = ResultFiles(cfg.out, "tier_attention", cfg.slug())
    txt = table(rows, meta["copy_GBps"])
    files.write(res, txt=txt)
    say(txt + f"\nwrote {files.path}")
    return res


def table(rows: list[dict], copy: dict) -> str:
    head = (f"{'thr':>3} {'store':<24}{'attn':<9}{'budget':>7} {'held':>6} {'attn ms':>8} {'x dense':>8} "
            f"{'target':>7} {'floor ms':>9} {'x dense':>8} {'GB/s read':>10}")
    lines = [head]
    for r in rows:
        b = "" if r["budget"] is None else f"{r['budget']:.3f}"
        held = "" if r["budget"] is None else f"{r['budget_held']:.3f}"
        tgt = "" if r.get("target_ratio") is None else f"{r['target_ratio']:.2f}"
        lines.append(f"{r['threads']:>3} {r['store']:<24}{r['attention']:<9}{b:>7} {held:>6} "
                     f"{r['attn_ms_per_token']:>8.3f} {r['attn_ratio_vs_dense']:>8.3f} {tgt:>7} "
                     f"{r['attn_ms_floor']:>9.3f} {r['attn_floor_ratio_vs_dense']:>8.3f} {r['read_GBps']:>10.2f}")
    lines.append(f"copy bandwidth (read + write) GB/s: start {copy.get('start')}, end {copy.get('end')}")
    return "\n".join(lines)

