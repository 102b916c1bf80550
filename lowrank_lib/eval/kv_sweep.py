"""KV budget sweep: every method at every KV budget, quality vs the dense cache + long-context tasks, and
the AttSVD issue's acceptance checks (``targets``). The library of ``python -m lowrank_lib.bench attsvd``:

    python -m lowrank_lib.bench attsvd                      # quick: tiny sizes (minutes on a 2-core CPU)
    python -m lowrank_lib.bench attsvd --report             # report parameters: SmolLM2, prefill 2k/4k/8k,
                                                            # 8 windows, long-context 1k-8k (hours on CPU)
    python -m lowrank_lib.bench attsvd --prompt-len 2048 --windows 8 --budget 0.5

The command writes ``attsvd_<model>_p<prefills>_n<windows>.json`` + ``.txt`` (the table: per method and
budget the mean KL(dense || method) +- std over windows, continuation perplexity vs dense, measured
memory ratio; long-context exact / partial match) through ``lowrank_lib.bench.results``.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace

import torch

from ..compat import cache_kw
from ..kv import METHODS, make_method, method_kind

__all__ = ["budget_sweep", "frontier_best", "FRONTIER_BUDGETS", "frontier_caches", "FRONTIER_COMPOSED",
           "FRONTIER_EVICTION", "FRONTIER_LOWRANK", "frontier_method", "FRONTIER_QUICK", "FRONTIER_REPORT",
           "frontier_rows", "frontier_table", "frontier_windows", "FrontierConfig", "kv_frontier", "merge_frontier",
           "merge_sweep", "QUICK", "REPORT", "sweep_method", "sweep_part", "sweep_tasks", "SweepConfig", "table",
           "targets", "teacher_forced"]

REPORT = dict(prefill=[2048, 4096, 8192], windows=8, cont=128, budgets=[1.0, 0.8, 0.6, 0.5, 0.25],
              lengths=[1024, 2048, 4096, 8192], n_per=2)
QUICK = dict(prefill=[512], windows=2, cont=64, budgets=[1.0, 0.8, 0.6, 0.5, 0.25], lengths=[512], n_per=1)


def targets(quality: dict, longctx: dict | None, budget: float = 0.5) -> dict:
    """The issue's acceptance checks at ``budget`` from one prefill length's results."""
    key = lambda m: f"{m}@{budget:g}"
    if key("attsvd") not in quality or key("svd") not in quality:
        return {}
    a, s = quality[key("attsvd")], quality[key("svd")]
    evict = {m: quality[key(m)]["kl"] for m in ("streamingllm", "h2o", "snapkv", "keydiff") if key(m) in quality}
    out = {"budget": budget, "kl_attsvd": a["kl"], "kl_svd": s["kl"], "kl_ratio_svd_over_attsvd": s["kl"] / a["kl"],
           "ppl_attsvd": a["ppl"], "ppl_dense": a["ppl_dense"], "ppl_gap_pct": 100 * (a["ppl"] / a["ppl_dense"] - 1),
           "best_eviction": min(evict, key=evict.get) if evict else None,
           "best_eviction_kl": min(evict.values()) if evict else None}
    out["pass_kl_3x"] = out["kl_ratio_svd_over_attsvd"] >= 3.0
    out["pass_ppl_2pct"] = abs(out["ppl_gap_pct"]) <= 2.0
    out["pass_vs_eviction"] = bool(evict) and a["kl"] <= min(evict.values())
    for ext, tag in (("attsvd-km", "km"), ("attsvd-ext", "ext")):   # our extensions, reported beside the paper's
        if key(ext) in quality:
            x = quality[key(ext)]
            out |= {f"kl_attsvd_{tag}": x["kl"], f"ppl_gap_pct_{tag}": 100 * (x["ppl"] / x["ppl_dense"] - 1),
                    f"kl_ratio_svd_over_attsvd_{tag}": s["kl"] / x["kl"],
                    f"pass_vs_eviction_{tag}": bool(evict) and x["kl"] <= min(evict.values())}
    if longctx:
        summ = longctx["summary"]
        if key("attsvd") in summ and "dense" in summ and "passkey" in summ["dense"]:
            out["passkey_dense"] = summ["dense"]["passkey"]["exact"]
            out["passkey_attsvd"] = summ[key("attsvd")]["passkey"]["exact"]
            out["pass_passkey"] = out["passkey_attsvd"] >= out["passkey_dense"]
    return out


def table(res: dict) -> str:
    lines = []
    for P, q in res["quality"].items():
        lines.append(f"\nprefill {P} tokens, {res['args']['windows']} windows x {res['args']['cont']} continuation tokens"
                     f" (dense ppl {next(iter(q.values()))['ppl_dense']:.3f})")
        lines.append(f"{'method':<15}{'budget':>7}{'mem':>7}{'KL mean':>10}{'KL std':>9}{'ppl':>9}{'dppl%':>7}")
        for name, r in q.items():
            m, b = name.split("@")
            lines.append(f"{m:<15}{float(b):>7.2f}{r['memory_ratio']:>7.3f}{r['kl']:>10.4f}{r['kl_std']:>9.4f}"
                         f"{r['ppl']:>9.3f}{100 * (r['ppl'] / r['ppl_dense'] - 1):>7.2f}")
    if res.get("longctx"):
        lines.append("\nlong-context (exact / partial match)")
        for name, s in res["longctx"]["summary"].items():
            lines.append(f"{name:<20}" + "  ".join(f"{t}={v['exact']:.2f}/{v['partial']:.2f}" for t, v in s.items()))
    for P, t in res.get("targets", {}).items():
        lines.append(f"\ntargets @ prefill {P}: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                          for k, v in t.items()))
    return "\n".join(lines)


def sweep_method(name: str, budget: float, window: int, chunk: int):
    """The registry method ``name`` at ``budget`` with the sweep's exact ``window`` (and AttSVD's stream ``chunk``)."""
    kind = method_kind(name)
    opts = {"window": window} if kind in ("lowrank", "eviction") else {}
    if kind == "lowrank":
        opts["chunk"] = chunk
    return make_method(name, budget, **opts)


@dataclass
class SweepConfig:
    """What ``bench attsvd`` measures: every method (registry names) at every byte budget on ``windows`` WikiText-2
    windows of each prompt length (+ ``cont`` teacher-forced tokens fed ``step`` at a time), then long-context tasks
    of ``lengths`` tokens (``n_per`` per task) at ``longctx_budgets``."""

    model: str = "smollm2"
    prompt_len: list[int] = field(default_factory=lambda: list(QUICK["prefill"]))
    windows: int = QUICK["windows"]
    cont: int = QUICK["cont"]
    budgets: list[float] = field(default_factory=lambda: list(QUICK["budgets"]))
    methods: list[str] = field(default_factory=list)
    window: int = 32
    chunk: int = 128
    lengths: list[int] = field(default_factory=list)
    n_per: int = 1
    tasks: list[str] = field(default_factory=list)
    step: int = 32
    seed: int = 0
    longctx_budgets: list[float] = field(default_factory=lambda: [0.5])

    def to_dict(self) -> dict:
        return asdict(self)


def budget_sweep(cfg: SweepConfig, progress: bool = True, checkpoint=None) -> dict:
    """Quality of every method of ``cfg`` at every byte budget for each prompt length, then long-context tasks;
    ``checkpoint(partial)`` is called after each finished prompt length (long runs keep their results)."""
    from .. import models
    from . import kvquality, longctx

    c = cfg
    prefill, windows, cont, budgets, methods = c.prompt_len, c.windows, c.cont, c.budgets, c.methods
    window, chunk, lengths, n_per, tasks, step, seed = c.window, c.chunk, c.lengths, c.n_per, c.tasks, c.step, c.seed
    longctx_budgets = c.longctx_budgets
    torch.manual_seed(seed)
    model, tok = models.load(c.model)
    model.eval()
    specs = {f"{m}@{b:g}": sweep_method(m, b, window, chunk) for b in budgets for m in methods if m != "dense"}
    res: dict = {"quality": {}, "targets": {}, "timing_s": {}}
    for P in prefill:
        t0 = time.perf_counter()
        W = kvquality.wikitext_windows(tok, windows, P + cont, seed=seed)
        q = kvquality.continuation_quality(model, W, P, specs, step=step, progress=progress)
        res["quality"][str(P)] = {k: v.to_dict() for k, v in q.items()}
        res["timing_s"][f"quality_{P}"] = time.perf_counter() - t0
        res["targets"][str(P)] = targets(res["quality"][str(P)], None, 0.5)
        if checkpoint is not None:      # keep finished stages on disk while the long-context stage runs
            checkpoint(res)
    lc = None
    if lengths and tasks:
        t0 = time.perf_counter()
        lspecs = {"dense": make_method("dense")}
        lspecs |= {f"{m}@{b:g}": sweep_method(m, b, window, chunk) for b in longctx_budgets for m in methods
                   if m != "dense"}
        samples = longctx.build_samples(tok, tasks=tasks, lengths=lengths, n_per=n_per, seed=seed)
        lc = longctx.evaluate(model, tok, samples, lspecs, progress=progress)
        res["longctx"] = lc
        res["timing_s"]["longctx"] = time.perf_counter() - t0
    for P, q in res["quality"].items():
        res["targets"][P] = targets(q, lc, 0.5)
    return res


def sweep_tasks(cfg: SweepConfig) -> list:
    """:func:`budget_sweep` as sweep tasks (:mod:`lowrank_lib.executor`): one per prompt length, one for the
    long-context tasks; :func:`merge_sweep` joins their results."""
    from ..executor import Task

    tasks = [Task(f"quality_{P}", sweep_part, (cfg, [P], [])) for P in cfg.prompt_len]
    if cfg.lengths and cfg.tasks:
        tasks.append(Task("longctx", sweep_part, (cfg, [], cfg.lengths)))
    return tasks


def sweep_part(cfg: SweepConfig, prompt_len: list[int], lengths: list[int]) -> dict:
    """One sweep task: :func:`budget_sweep` on some prompt lengths and/or the long-context lengths."""
    from dataclasses import replace

    return budget_sweep(replace(cfg, prompt_len=prompt_len, lengths=lengths))


def merge_sweep(parts: list[dict]) -> dict:
    """Finished :func:`sweep_part` results (in task order) as one :func:`budget_sweep` result, the targets
    recomputed with the long-context part."""
    res: dict = {"quality": {}, "targets": {}, "timing_s": {}}
    for p in parts:
        res["quality"] |= p["quality"]
        res["timing_s"] |= p["timing_s"]
        if "longctx" in p:
            res["longctx"] = p["longctx"]
    for P, q in res["quality"].items():
        res["targets"][P] = targets(q, res.get("longctx"), 0.5)
    return res


# ----------------------------------------------------------------------------- the KV-memory frontier
#: ``python -m lowrank_lib.bench kv-frontier``: every policy at every byte budget (fraction of the dense prefill KV
#: bytes really held); eviction runs as real ragged per-head storage (kept rows + positions), KVzip with its global
#: (layer- and head-wise) allocation, the other scorers per head (``kv.EVICTION_MODES``)
FRONTIER_BUDGETS = (0.5, 0.375, 0.25, 0.125)
FRONTIER_EVICTION = tuple(n for n in METHODS if method_kind(n) == "eviction")
FRONTIER_LOWRANK = ("attsvd", "attsvd-ext")      # raw-K/V "svd" on request (--lowrank): far behind at 0.5
FRONTIER_COMPOSED = ("composed-kvzip", "composed-kvzip-q8", "composed-kvzip-q8-m50")
FRONTIER_REPORT = dict(prefill=[2048], windows=8, cont=64)
FRONTIER_QUICK = dict(prefill=[128], windows=2, cont=16)


def frontier_windows(tok, model, n_windows: int, length: int, seed: int) -> torch.Tensor:
    """WikiText-2 test windows (``kvquality.wikitext_windows``); seeded random ids for tokenizer-less tiny models."""
    from ..data import random_token_batches
    from .kvquality import wikitext_windows

    if tok is None:
        return random_token_batches(model.config.vocab_size, n_windows, length, seed)
    return wikitext_windows(tok, n_windows, length, seed=seed)


def frontier_method(name: str, budget: float, window: int = 32):
    """The frontier's method ``name`` at ``budget``: low-rank methods take the frontier's exact ``window``; the
    scorers keep their own rule (a recent window of 32 where they have none)."""
    return make_method(name, budget, **({"window": window} if method_kind(name) == "lowrank" else {}))


@torch.no_grad()
def teacher_forced(model, cache, cont: torch.Tensor) -> torch.Tensor:
    """log-probs [T, V] (fp32) of ``cont`` [1, T] fed in one forward over ``cache``: a fitted ``KVCache`` (its tiers
    read through ``tiered_attention``) or a dense transformers cache (the attention in effect: no probing)."""
    import torch.nn.functional as F

    from ..kv.hf_adapter import tiered_attention

    with tiered_attention(model):
        return F.log_softmax(model(cont, **cache_kw(cache)).logits[0].float(), -1)


def frontier_rows(per_window: list[dict], dense_nll: dict) -> list[dict]:
    """Aggregate per-window records ``{policy, kind, prefill, budget, window, kl, nll, bytes_ratio}`` into the
    frontier rows (mean / std over the windows each row has; PPL = exp(mean NLL))."""
    import math
    import statistics

    groups: dict = {}
    for r in per_window:
        groups.setdefault((r["policy"], r["kind"], r["prefill"], r["budget"]), []).append(r)
    rows = []
    for (pol, kind, P, b), rs in groups.items():
        rs = sorted(rs, key=lambda r: r["window"])
        kl = [r["kl"] for r in rs]
        dn = [dense_nll[str(P)][r["window"]] for r in rs]
        rows.append(dict(policy=pol, kind=kind, prefill=P, budget=b,
                         bytes_ratio=statistics.fmean(r["bytes_ratio"] for r in rs),
                         kl_mean=statistics.fmean(kl), kl_std=statistics.pstdev(kl),
                         ppl=math.exp(statistics.fmean(r["nll"] for r in rs)), ppl_dense=math.exp(statistics.fmean(dn)),
                         windows=len(rs), window_ids=[r["window"] for r in rs], window_kl=kl))
    order = {"eviction": 0, "lowrank": 1, "composed": 2}
    return sorted(rows, key=lambda r: (r["prefill"], -r["budget"], order[r["kind"]], r["policy"]))


def frontier_best(rows: list[dict], tol: float = 0.01) -> list[dict]:
    """Per (prefill, budget): the best eviction row vs the best of ours (low-rank or composed) among the rows
    holding at most ``(1 + tol) * budget`` of the dense bytes. The issue's target: ours has a lower mean KL
    than the best eviction policy at the same budget while holding no more bytes than it."""
    out = []
    for P in sorted({r["prefill"] for r in rows}):
        for b in sorted({r["budget"] for r in rows if r["prefill"] == P}, reverse=True):
            at = [r for r in rows if r["prefill"] == P and r["budget"] == b and r["bytes_ratio"] <= (1 + tol) * b]
            ev = [r for r in at if r["kind"] == "eviction"]
            ours = [r for r in at if r["kind"] != "eviction"]
            if not ev or not ours:
                continue
            e, o = min(ev, key=lambda r: r["kl_mean"]), min(ours, key=lambda r: r["kl_mean"])
            out.append(dict(prefill=P, budget=b, best_eviction=e["policy"], best_eviction_kl=e["kl_mean"],
                            best_eviction_bytes=e["bytes_ratio"], best_ours=o["policy"], best_ours_kl=o["kl_mean"],
                            best_ours_bytes=o["bytes_ratio"], kl_ratio_eviction_over_ours=e["kl_mean"] / o["kl_mean"],
                            pass_target=o["kl_mean"] < e["kl_mean"] and o["bytes_ratio"] <= e["bytes_ratio"] + tol * b))
    return out


def frontier_table(res: dict) -> str:
    lines = [f"{'prefill':>7} {'budget':>6} {'kind':<9}{'policy':<20}{'bytes':>7}{'KL mean':>10}{'KL std':>9}"
             f"{'ppl':>9}{'dppl%':>7}{'win':>4}"]
    for r in res["rows"]:
        lines.append(f"{r['prefill']:>7} {r['budget']:>6.3f} {r['kind']:<9}{r['policy']:<20}{r['bytes_ratio']:>7.3f}"
                     f"{r['kl_mean']:>10.4f}{r['kl_std']:>9.4f}{r['ppl']:>9.3f}"
                     f"{100 * (r['ppl'] / r['ppl_dense'] - 1):>7.2f}{r['windows']:>4}")
    for t in res.get("best", []):
        lines.append(f"prefill {t['prefill']} budget {t['budget']:g}: best eviction {t['best_eviction']} "
                     f"{t['best_eviction_kl']:.4f} (bytes {t['best_eviction_bytes']:.3f}); ours {t['best_ours']} "
                     f"{t['best_ours_kl']:.4f} (bytes {t['best_ours_bytes']:.3f}); target "
                     f"{'PASS' if t['pass_target'] else 'FAIL'}")
    return "\n".join(lines)


def frontier_caches(model, prefill, policies, budgets, window: int = 32):
    """Yield ``(policy, kind, budget, cache)`` for every registry method of ``policies`` at every budget, each a
    :class:`~lowrank_lib.kv.hf_adapter.KVCache` fitted from the recorded ``prefill`` (scores and statistics are
    memoised on it: one scoring per scorer, whatever the budgets). The construction the frontier and ``kv_tasks``
    share."""
    from ..kv.hf_adapter import KVCache

    for name in policies:
        for b in budgets:
            yield name, method_kind(name), b, KVCache.from_prefill(frontier_method(name, b, window), prefill, model)


@dataclass
class FrontierConfig:
    """What ``bench kv-frontier`` measures: for each prompt length and each of ``windows`` WikiText-2 windows (seed
    ``seed``; only ``window_ids`` of them if given, for sharded runs), every policy (registry names) at every byte
    budget, on ``cont`` teacher-forced continuation tokens; ``window``: the low-rank methods' exact window."""

    model: str = "smollm2"
    prompt_len: list[int] = field(default_factory=lambda: list(FRONTIER_REPORT["prefill"]))
    windows: int = FRONTIER_REPORT["windows"]
    cont: int = FRONTIER_REPORT["cont"]
    budgets: list[float] = field(default_factory=lambda: list(FRONTIER_BUDGETS))
    policies: list[str] = field(default_factory=lambda: [*FRONTIER_EVICTION, *FRONTIER_LOWRANK, *FRONTIER_COMPOSED])
    window: int = 32
    seed: int = 0
    window_ids: list[int] | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def with_windows(self, ids: list[int]) -> "FrontierConfig":
        return replace(self, window_ids=list(ids))


def kv_frontier(cfg: FrontierConfig, progress: bool = True, checkpoint=None, model=None, tok=None) -> dict:
    """The frontier of ``cfg``: per window, record the prefill once, then every method at every budget:
    KL(dense || method) per continuation token, NLL, bytes really held after the prefill.
    ``checkpoint(result)`` after every window (rows aggregate the windows done so far)."""
    from tqdm.auto import tqdm

    from .. import models
    from ..kv.hf_adapter import dense_cache, record

    prefill, windows, cont, budgets, policies = cfg.prompt_len, cfg.windows, cfg.cont, cfg.budgets, cfg.policies
    window, seed, window_ids = cfg.window, cfg.seed, cfg.window_ids

    bad = [p for p in policies if p not in METHODS or method_kind(p) == "dense"]
    if bad:
        raise ValueError(f"kv_frontier: unknown or dense policies {bad}; choose from the KV registry {sorted(METHODS)}")
    if model is None:
        model, tok = models.load(cfg.model)
    model.eval()
    per_window: list[dict] = []
    dense_nll: dict = {}
    res: dict = {"timing_s": {}}
    for P in prefill:
        W = frontier_windows(tok, model, windows, P + cont, seed)
        ids_ = list(range(windows)) if window_ids is None else [w for w in window_ids if w < windows]
        dense_nll[str(P)] = {}
        bar = tqdm(total=len(ids_) * len(policies) * len(budgets), desc=f"kv-frontier prefill {P}",
                   disable=not progress)
        for w in ids_:
            t0 = time.perf_counter()
            x = W[w:w + 1].to(next(model.parameters()).device)
            pre, cont_ids, tgt = x[:, :P], x[:, P:-1], x[0, P + 1:]
            rec = record(model, pre, tokenizer=tok)
            ref = teacher_forced(model, dense_cache(rec, model), cont_ids)
            dense_nll[str(P)][w] = float(torch.nn.functional.nll_loss(ref, tgt))
            for policy, kind, b, cache in frontier_caches(model, rec, policies, budgets, window):
                ratio = cache.describe()["bytes_ratio"]              # bytes held right after the prefill
                lp = teacher_forced(model, cache, cont_ids)
                kl = float(torch.nn.functional.kl_div(lp, ref, log_target=True, reduction="batchmean"))
                per_window.append(dict(policy=policy, kind=kind, prefill=P, budget=b, window=w, kl=kl,
                                       nll=float(torch.nn.functional.nll_loss(lp, tgt)), bytes_ratio=ratio))
                bar.set_postfix_str(f"w{w} {policy}@{b:g} kl={kl:.4f}")
                bar.update()
                del cache
            del rec
            res["timing_s"][f"p{P}_w{w}"] = time.perf_counter() - t0
            res |= {"rows": frontier_rows(per_window, dense_nll), "per_window": per_window, "dense_nll": dense_nll}
            res["best"] = frontier_best(res["rows"])
            if checkpoint is not None:
                checkpoint(res)
        bar.close()
    res |= {"rows": frontier_rows(per_window, dense_nll), "per_window": per_window, "dense_nll": dense_nll}
    res["best"] = frontier_best(res["rows"])
    return res


def merge_frontier(parts: list[dict]) -> dict:
    """One result from the shards of a sharded run (their per-window records; a window twice is an error)."""
    per_window, dense_nll, timing = [], {}, {}
    seen = set()
    for p in parts:
        for r in p["per_window"]:
            key = (r["policy"], r["prefill"], r["budget"], r["window"])
            if key in seen:
                raise ValueError(f"merge_frontier: {key} appears in two shards")
            seen.add(key)
            per_window.append(r)
        for P, d in p["dense_nll"].items():
            dense_nll.setdefault(P, {}).update({int(k): v for k, v in d.items()})
        timing |= p.get("timing_s", {})
    rows = frontier_rows(per_window, dense_nll)
    return {"rows": rows, "best": frontier_best(rows), "per_window": per_window, "dense_nll": dense_nll,
            "timing_s": timing}
