"""Decode attention in factor space vs AttSVD's rebuild vs dense KV, timed (``bench factor-space``, notebook 06).

    python -m lowrank_lib.bench factor-space                     # attention per step, 1k-8k
    python -m lowrank_lib.bench factor-space --e2e --ppl --prompt-len 2048   # + SmolLM2 ms/token, ppl identity

Part 1 (``attention``, :class:`AttnBenchConfig`): one decode step of ONE layer's attention at SmolLM2 head geometry
(9 query heads, 3 KV heads, d = 64), batch 1: ``dense`` (our grouped attention on exact K/V), ``sdpa`` (torch
SDPA, enable_gqa), ``rebuild`` (AttSVD's decode as the cache does it: A B rebuilt into fresh tensors, then dense
attention), ``rebuildpre`` (the same rebuild into K/V buffers allocated once: only the GEMMs) and ``factor``
(factor space), at each r/d with an exact window of w tokens; every route timed side by side (:mod:`lowrank_lib.timing`)
in ``runs`` repeated runs: the median of the run medians with their min-max across runs
(:func:`~lowrank_lib.timing.repeated_runs`; the same for parts 2 and 3), the per-token estimate x the layer count, the cost model (:mod:`lowrank_lib.attsvd.cost`) beside them.

Part 2 (``--e2e``, :class:`FactorDecodeConfig`): SmolLM2 greedy decode ms/token after a WikiText-2 prompt of each
length: the dense cache, AttSVD read by rebuild-then-attend and in factor space (ONE fit per rank, two readers),
steps interleaved. ``--engine``: the runtime Engine, dense store vs the AttSVD store. ``--ppl``: the continuation
perplexity of the AttSVD issue (``eval.kvquality.continuation_quality``) through both readers.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from ..attsvd import LowRankKV, attention_svd, dense_attention, factor_space_attention, rebuild_then_attend
from ..attsvd.cost import step_cost
from ..compat import cache_kw
from ..geometry import geometry
from ..runtime.profiling import greedy_steps
from ..timing import interleaved, repeated_runs, within_noise

__all__ = ["AttnBenchConfig", "FactorDecodeConfig", "attention_ratios", "attention_table", "bench_attention",
           "bench_decode", "bench_engine", "cuda_graphed", "engine_graphs", "factor_correctness", "markdown", "rel_err",
           "speed_verdict", "svd_run"]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| in float64 (the plain norm of the difference when b is zero)."""
    a, b = a.detach().double(), b.detach().double()
    den = b.norm()
    return float((a - b).norm() / den) if den > 0 else float((a - b).norm())


def svd_run(k: torch.Tensor, v: torch.Tensor, rank: int) -> tuple:
    """Raw truncated-SVD factors (a_k, b_k, a_v, b_v) of exact K/V [B, H, n, d] (fp32 SVD, k's dtype)."""
    return tuple(t.to(k.dtype) for t in attention_svd(k, v, rank, rank).runs[0])


# --------------------------------------------------------------------------- part 1: attention per step
@dataclass
class AttnBenchConfig:
    """Per-step decode attention of one layer. Defaults: SmolLM2 head geometry, fp32, CPU."""

    contexts: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    rank_fracs: list[float] = field(default_factory=lambda: [0.5, 0.25])   # r / d
    q_heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    layers: int = 30                 # for the per-token estimate
    window: int = 32
    batch: int = 1
    repeats: int = 40
    warmup: int = 5
    runs: int = 3                    # repeated interleaved runs (medians across runs, their min-max)
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    inner: int = 1                   # calls per timed sample (GPU: amortise the host sync)
    cuda_graphs: bool = False        # CUDA: capture each route once and time graph replays

    def ranks(self) -> list[int]:
        return [max(1, round(f * self.head_dim)) for f in self.rank_fracs]


def cuda_graphed(fn):
    """Capture ``fn()`` (fixed shapes, static inputs) in a CUDA graph; returns its replay."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return g.replay


def _rebuild_preallocated(q, kv: LowRankKV, seg, n_b: int):
    """Rebuild into K/V buffers allocated once (window already in place), then dense attention: the fairest
    rebuild, no allocation or concatenation per step, only the n r d GEMMs."""
    k_buf, v_buf = (t.clone() for t in kv.dense())

    def run():
        if seg is not None:
            torch.matmul(seg[0], seg[1], out=k_buf[:, :, :n_b])
            torch.matmul(seg[2], seg[3], out=v_buf[:, :, :n_b])
        return dense_attention(q, k_buf, v_buf)
    return run


@torch.inference_mode()
def bench_attention(cfg: AttnBenchConfig, progress: bool = True) -> list[dict]:
    """Rows {context, route, rank, ms_step (median across runs, + min / max across runs), runs, ms_token_est, flops / bytes_read / bytes_stored per KV head,
    rel_err_vs_rebuild}."""
    gen = torch.Generator().manual_seed(cfg.seed)
    dt = getattr(torch, cfg.dtype)
    sync = torch.cuda.synchronize if cfg.device.startswith("cuda") else None
    rows = []
    for n in tqdm(cfg.contexts, desc="attention contexts", disable=not progress):
        k, v = (torch.randn(cfg.batch, cfg.kv_heads, n, cfg.head_dim, generator=gen).to(cfg.device, dt) for _ in "kv")
        q = torch.randn(cfg.batch, cfg.q_heads, 1, cfg.head_dim, generator=gen).to(cfg.device, dt)
        w = min(cfg.window, n)
        fns = {"dense": lambda: dense_attention(q, k, v),
               "sdpa": lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)}
        kvs = {}
        for r in cfg.ranks():
            seg = svd_run(k[:, :, :n - w], v[:, :, :n - w], r) if n > w else None
            kvs[r] = kv = LowRankKV([seg] if seg is not None else [], k[:, :, n - w:].clone(), v[:, :, n - w:].clone())
            fns[f"rebuild_r{r}"] = lambda kv=kv: rebuild_then_attend(q, kv)
            fns[f"rebuildpre_r{r}"] = _rebuild_preallocated(q, kv, seg, n - w)
            fns[f"factor_r{r}"] = lambda kv=kv: factor_space_attention(q, kv)
        if cfg.cuda_graphs and cfg.device.startswith("cuda"):
            fns = {name: cuda_graphed(fn) for name, fn in fns.items()}
        stats = repeated_runs(lambda: interleaved(fns, cfg.repeats, warmup=cfg.warmup, sync=sync, inner=cfg.inner),
                              cfg.runs)
        for name, st in stats.items():
            route, r = name.split("_r")[0], int(name.split("_r")[1]) if "_r" in name else cfg.head_dim
            cost_route = {"sdpa": "dense", "rebuildpre": "rebuild"}.get(route, route)
            c = step_cost(cost_route, n, cfg.head_dim, r, window=0 if cost_route == "dense" else w,
                          group=cfg.q_heads // cfg.kv_heads, dtype_bytes=dt.itemsize)
            rows.append({"context": n, "route": route, "rank": r, "ms_step": st["median_ms"], "ms_step_min": st["min_ms"],
                         "ms_step_max": st["max_ms"], "runs": st["runs"], "ms_token_est": st["median_ms"] * cfg.layers,
                         "flops_per_kv_head": c.flops, "bytes_read_per_kv_head": c.bytes_read,
                         "bytes_stored_per_kv_head": c.bytes_stored,
                         "rel_err_vs_rebuild": rel_err(factor_space_attention(q, kvs[r]), rebuild_then_attend(q, kvs[r]))
                         if route == "factor" else None})
    return rows


def attention_ratios(rows: list[dict]) -> list[dict]:
    """Per (context, rank): rebuild / factor and best-dense / factor time ratios (> 1 = factor faster)."""
    out = []
    by = {(r["context"], r["route"], r["rank"]): r["ms_step"] for r in rows}
    for n in sorted({r["context"] for r in rows}):
        best_dense = min(by[k] for k in by if k[0] == n and k[1] in ("dense", "sdpa"))
        for r in sorted({r["rank"] for r in rows if r["route"] == "factor" and r["context"] == n}, reverse=True):
            f, reb, pre = by[(n, "factor", r)], by[(n, "rebuild", r)], by.get((n, "rebuildpre", r))
            out.append({"context": n, "rank": r, "factor_ms": f, "rebuild_ms": reb, "rebuild_prealloc_ms": pre,
                        "best_dense_ms": best_dense, "rebuild_over_factor": reb / f,
                        "rebuild_prealloc_over_factor": None if pre is None else pre / f,
                        "dense_over_factor": best_dense / f})
    return out


def speed_verdict(a: dict, b: dict, col: str) -> str:
    """How row ``a`` compares with row ``b`` in ``col`` (ms, lower is faster; ``col_min`` / ``col_max`` the range
    across runs): "1.23× faster than" / "1.23× slower than", or "within noise of" (1.23×) when the two ranges
    across runs overlap (:func:`lowrank_lib.timing.within_noise`)."""
    x = b[col] / a[col]
    if within_noise({"min_ms": a[f"{col}_min"], "max_ms": a[f"{col}_max"]},
                    {"min_ms": b[f"{col}_min"], "max_ms": b[f"{col}_max"]}):
        return f"within noise of ({x:.2f}× by the medians)"
    return f"{x:.2f}× faster than" if x > 1 else f"{1 / x:.2f}× slower than"


# --------------------------------------------------------------------------- part 2: end to end
@dataclass
class FactorDecodeConfig:
    """SmolLM2 greedy decode through transformers after a WikiText-2 prompt: dense, AttSVD rebuild and
    AttSVD factor space side by side (the runtime systems' decode benchmark is ``runtime.decode_bench``)."""

    contexts: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    rank_fracs: list[float] = field(default_factory=lambda: [0.5, 0.25])
    window: int = 32
    gen_tokens: int = 8
    warmup_tokens: int = 2
    runs: int = 3                    # repeated runs of gen_tokens interleaved steps each (decode goes on)
    obs_window: int | None = None    # AttSVDConfig.obs_window (None = all prompt queries, the default)
    model: str = "smollm2"


def _attsvd(r: int, window: int, obs_window: int | None = None):
    """The AttSVD method at an explicit rank r (the r/d studies of this benchmark)."""
    from ..kv import make_method

    return make_method("attsvd", rank=r, window=window, obs_window=obs_window)


@torch.inference_mode()
def bench_decode(model, tok, cfg: FactorDecodeConfig, progress: bool = True) -> list[dict]:
    """Rows {context, route, rank, ms_token, tokens_equal_rebuild, max_logit_rel_err, memory_ratio}: the AttSVD cache
    (``KVCache``) read by the paper's rebuild-then-attend backend and in factor space, and the dense cache."""
    from ..data import token_stream
    from ..kv import KVCache, record
    from ..kv.hf_adapter import dense_cache, tiered_attention

    ids_all = token_stream(tok, max(cfg.contexts), model.config.vocab_size)      # no tokenizer: random ids
    d = geometry(model).head_dim
    rows = []
    for n in tqdm(cfg.contexts, desc="e2e contexts", disable=not progress):
        ids = ids_all[:n][None]
        rec = record(model, ids)
        first = rec.last_logits.argmax(-1, keepdim=True)        # [1, 1]
        caches = {("dense", d): dense_cache(rec, model)}
        for f in cfg.rank_fracs:
            r = max(1, round(f * d))
            for route, backend in (("rebuild", "rebuild"), ("factor", "portable")):   # the same fit, two readers
                caches[(route, r)] = KVCache.from_prefill(_attsvd(r, cfg.window, cfg.obs_window), rec, model, backend)
        del rec
        state = {k: first for k in caches}
        logits = {k: [] for k in caches}
        toks = {k: [] for k in caches}

        def stepper(k, caches=caches):
            def step():
                lg = model(state[k], **cache_kw(caches[k]), use_cache=True).logits[:, -1].float()
                state[k] = lg.argmax(-1, keepdim=True)
                logits[k].append(lg)
                toks[k].append(int(state[k]))
            return step

        with tiered_attention(model):       # interleaved steps, rotated order (timing); the warm-up untimed
            steps = {k: stepper(k) for k in caches}
            stats = repeated_runs(lambda: interleaved(steps, cfg.gen_tokens, warmup=cfg.warmup_tokens), cfg.runs)
        for (route, r), st in stats.items():
            ref = ("rebuild", r) if route == "factor" else None
            c = caches[(route, r)]
            mem = c.describe()["bytes_ratio"] if isinstance(c, KVCache) else 1.0
            rows.append({"context": n, "route": route, "rank": r, "ms_token": st["median_ms"],
                         "ms_token_min": st["min_ms"], "ms_token_max": st["max_ms"], "runs": st["runs"],
                         "tokens": toks[(route, r)],
                         "tokens_equal_rebuild": None if ref is None else toks[(route, r)] == toks[ref],
                         "max_logit_rel_err": None if ref is None else max(
                             rel_err(a, b) for a, b in zip(logits[(route, r)], logits[ref])),
                         "memory_ratio": mem})
        del caches
    return rows


@torch.inference_mode()
def bench_engine(model, tok, contexts: list[int], rank_fracs: list[float], window: int = 32, gen_tokens: int = 8,
                 progress: bool = True, runs: int = 3) -> list[dict]:
    """The runtime ``Engine`` with its dense store vs the AttSVD method served by the engine adapter, eager.

    Rows {context, route, rank, ms_token (median step, across ``runs`` runs of ``gen_tokens`` steps; + min / max across
    runs), prefill_s, kv_bytes, attsvd_ratio, tokens}.
    All engines are prefilled, then their greedy decode steps are interleaved (rotated order per step, :mod:`lowrank_lib.timing`), so
    the ratios are measured side by side; the first step is a warm-up.
    """
    from ..data import token_stream
    from ..kv import MethodStore
    from ..runtime import Engine, EngineConfig

    ids_all = token_stream(tok, max(contexts), model.config.vocab_size)          # no tokenizer: random ids
    d = geometry(model).head_dim
    rows = []
    for n in tqdm(contexts, desc="engine contexts", disable=not progress):
        ids = ids_all[:n][None]
        ecfg = EngineConfig(max_seq_len=n + runs * (gen_tokens + 1) + 2)
        engines = {("engine_dense", d): Engine(model, ecfg)}
        for f in rank_fracs:                  # one copy of the packed weights for every engine (a 1B model: 3x less)
            r = max(1, round(f * d))
            engines[("engine_factor", r)] = Engine(model, ecfg, kv=MethodStore(_attsvd(r, window)),
                                                   weights_of=engines[("engine_dense", d)])
        state, prefill_s = {}, {}
        for k, eng in engines.items():
            t0 = time.perf_counter()                                   # one prefill each: a wall-time pair
            state[k] = eng.prefill(ids).argmax(-1)                    # [1]
            prefill_s[k] = time.perf_counter() - t0
        toks = {k: [int(state[k])] for k in engines}
        steps = greedy_steps(engines, state, toks)
        stats = repeated_runs(lambda: interleaved(steps, gen_tokens, warmup=1), runs)   # rotated order (timing)
        for (route, r), eng in engines.items():
            fit = eng.report()["kv_store"].get("fit", {})
            st = stats[(route, r)]
            rows.append({"context": n, "route": route, "rank": r, "ms_token": st["median_ms"],
                         "ms_token_min": st["min_ms"], "ms_token_max": st["max_ms"], "runs": st["runs"],
                         "prefill_s": prefill_s[(route, r)],
                         "kv_bytes": eng.report()["kv_cache_bytes"], "attsvd_ratio": fit.get("bytes_ratio", 1.0),
                         "tokens": toks[(route, r)]})
        del engines
    return rows


# --------------------------------------------------------------------------- report
def attention_table(ratios: list[dict], layers: int, digits: int = 3) -> list[str]:
    """The Markdown table of :func:`attention_ratios` (ms per layer and step; the per-token estimate x ``layers``)."""
    f = f"{{:.{digits}f}}"
    lines = ["| context | rank | factor ms | rebuild ms | rebuild (prealloc) ms | best dense ms | rebuild/factor | "
             "rebuild (prealloc)/factor | dense/factor | per-token attn (x layers) factor / rebuild / dense ms |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in ratios:
        ms = " | ".join(f.format(r[k]) for k in ("factor_ms", "rebuild_ms", "rebuild_prealloc_ms", "best_dense_ms"))
        lines.append(f"| {r['context']} | {r['rank']} | {ms} | {r['rebuild_over_factor']:.1f}x | "
                     f"{r['rebuild_prealloc_over_factor']:.1f}x | {r['dense_over_factor']:.2f}x | "
                     f"{r['factor_ms'] * layers:.1f} / {r['rebuild_ms'] * layers:.1f} / {r['best_dense_ms'] * layers:.1f} |")
    return lines


def markdown(result: dict) -> str:
    """Tables of a result dict as Markdown."""
    a = result["attention"]
    c = a["config"]
    lines = [f"# factor-space attention benchmark ({result['meta']['when']}, {result['meta']['machine']})", "",
             f"## attention per decode step, one layer ({c['q_heads']} q / {c['kv_heads']} kv heads, d={c['head_dim']}, "
             f"w={c['window']}, {c['dtype']}, median of {c['repeats']})", "", *attention_table(a["ratios"], c["layers"])]
    if result.get("decode"):
        lines += ["", "## SmolLM2 end-to-end greedy decode (median ms/token)", "",
                  "| context | route | rank | ms/token | memory ratio | tokens = rebuild | max logit rel err |",
                  "|---|---|---|---|---|---|---|"]
        for r in result["decode"]["rows"]:
            err = "" if r["max_logit_rel_err"] is None else f"{r['max_logit_rel_err']:.1e}"
            lines.append(f"| {r['context']} | {r['route']} | {r['rank']} | {r['ms_token']:.1f} | "
                         f"{r['memory_ratio']:.3f} | {r['tokens_equal_rebuild']} | {err} |")
    if result.get("engine"):
        lines += ["", "## runtime Engine: dense store vs the AttSVD method (engine adapter), eager", "",
                  "| context | route | rank | ms/token | KV bytes held in decode | AttSVD memory ratio |",
                  "|---|---|---|---|---|---|"]
        for r in result["engine"]["rows"]:
            lines.append(f"| {r['context']} | {r['route']} | {r['rank']} | {r['ms_token']:.1f} | {r['kv_bytes']} | "
                         f"{r['attsvd_ratio']:.3f} |")
    if result.get("ppl"):
        p = result["ppl"]
        i = p["identity"]
        lines += ["", f"## continuation perplexity (WikiText-2 test, prefill {p['prefill_len']} + {p['cont_len']} "
                  f"tokens x {p['n_windows']} windows, w={p['window']}; dense ppl {p['ppl_dense']:.4f})", "",
                  f"identity at r={i['rank']}: rebuild ppl {i['ppl_rebuild']:.6f}, factor ppl {i['ppl_factor']:.6f} "
                  f"(rel diff {i['ppl_rel_diff']:.1e}); KL rebuild {i['kl_rebuild']:.6f} / factor "
                  f"{i['kl_factor']:.6f}; memory ratio {i['memory_ratio_factor']:.3f}", "",
                  "| r/d | rank | ppl | KL to dense | memory ratio |", "|---|---|---|---|---|"]
        lines += [f"| {r['rank_frac']} | {r['rank']} | {r['ppl']:.4f} | {r['kl']:.4f} | {r['memory_ratio']:.3f} |"
                  for r in p["rows"]]
    return "\n".join(lines) + "\n"


def factor_correctness(dev: str, n: int = 4096) -> dict:
    """Factor space vs rebuild-then-attend on two factored runs + exact rows, fp32 and bf16, on ``dev`` (a stage of
    ``bench gpu-session``)."""
    out = {}
    torch.manual_seed(0)
    a, b = int(n * 0.73), int(n * 0.98)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        k, v, q = (torch.randn(2, h, t, 128, device=dev) for h, t in ((8, n), (8, n), (32, 1)))
        kv = LowRankKV([svd_run(k[:, :, :a], v[:, :, :a], 64), svd_run(k[:, :, a:b], v[:, :, a:b], 32)],
                       k[:, :, b:], v[:, :, b:]).to(dt).validate()
        e = rel_err(factor_space_attention(q.to(dt), kv), rebuild_then_attend(q.to(dt), kv))
        out[str(dt)] = {"rel_err": e, "tol": tol, "ok": e < tol}
    return out


def engine_graphs(dev: str, graphs=("none", "whole-step", "per-layer"), compile_backend: str = "inductor") -> dict:
    """The Engine with the AttSVD method (engine adapter, r/d 0.5), eager vs graph modes, on a random tiny-smol
    model (fp32): one capture per request shape, replayed for every step (a stage of ``bench gpu-session``)."""
    from .. import models
    from ..kv import MethodStore, make_method
    from ..runtime import Engine, EngineConfig

    model = models.tiny_model("tiny-smol", seed=0).to(dev)
    out, ref = {}, []
    for graph in graphs:
        try:
            store = MethodStore(make_method("attsvd", rank=32, window=16))
            eng = Engine(model, EngineConfig(max_batch=2, max_seq_len=512, graph=graph,
                                             compile_backend=compile_backend), kv=store)
            res = []
            # three requests: the first two round to the same buffers under a reader of device-side layouts (one
            # capture), the third re-captures; a host-slicing reader (the portable path) re-captures for each
            for T in (290, 300, 400):
                ids = torch.randint(3, 512, (2, T), generator=torch.Generator().manual_seed(T)).to(dev)
                mask = (torch.arange(T)[None] >= torch.tensor([[0], [7]])).long().to(dev)       # row 1: 7 left pads
                o = eng.generate(ids, 12, attention_mask=mask, return_logits=True)
                res.append((o.tokens.cpu(), torch.stack(o.logits, 1).cpu(), o.info.get("capture_s", 0.0),
                            o.decode_ms_per_token))
            ref = res if graph == "none" else ref
            out[graph] = {"tokens_equal_eager": [bool(torch.equal(a[0], b[0])) for a, b in zip(res, ref)],
                          "logit_rel_err": [rel_err(a[1], b[1]) for a, b in zip(res, ref)],
                          "capture_s": [r[2] for r in res], "decode_ms_per_token": [r[3] for r in res],
                          "tier_backend": store.backend.name if store.backend is not None else None,
                          "device_layout": store.device_layout}
        except Exception as e:  # record, keep the rest of the device call useful
            out[graph] = {"error": f"{type(e).__name__}: {e}"}
    return out
