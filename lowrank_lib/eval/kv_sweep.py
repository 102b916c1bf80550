"""KV budget sweep: every method at every KV budget, quality vs the dense cache + long-context tasks, and
the AttSVD issue's acceptance checks (``targets``). The library of ``python -m lowrank_lib.bench attsvd``:

    python -m lowrank_lib.bench attsvd                      # quick: tiny sizes (minutes on a 2-core CPU)
    python -m lowrank_lib.bench attsvd --report             # report parameters: SmolLM2, prefill 2k/4k/8k,
                                                            # 8 windows, long-context 1k-8k (hours on CPU)
    python -m lowrank_lib.bench attsvd --prefill 2048 --windows 8 --budgets 0.5

The command writes ``attsvd_<model>_p<prefills>_n<windows>.json`` + ``.txt`` (the table: per method and
budget the mean KL(dense || method) +- std over windows, continuation perplexity vs dense, measured
memory ratio; long-context exact / partial match) through ``lowrank_lib.bench.results``.
"""
from __future__ import annotations

import time

import torch

from ..attsvd.config import AttSVDConfig
from .methods import MethodSpec

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


def budget_sweep(model_name: str, prefill: list[int], windows: int, cont: int, budgets: list[float],
                 methods: list[str], window: int, chunk: int, lengths: list[int], n_per: int, tasks: list[str],
                 step: int, seed: int, longctx_budgets: list[float], progress: bool = True, checkpoint=None) -> dict:
    """Quality of every ``method`` at every budget for each prefill length, then long-context tasks;
    ``checkpoint(partial)`` is called after each finished prefill length (long runs keep their results)."""
    from .. import models
    from . import kvquality, longctx

    torch.manual_seed(seed)
    model, tok = models.load(model_name)
    model.eval()
    base = AttSVDConfig(rank=1, window=window, chunk=chunk)
    specs = {f"{m}@{b:g}": MethodSpec(m, b, base).make for b in budgets for m in methods if m != "dense"}
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
        lspecs = {"dense": MethodSpec("dense").make}
        lspecs |= {f"{m}@{b:g}": MethodSpec(m, b, base).make for b in longctx_budgets for m in methods if m != "dense"}
        samples = longctx.build_samples(tok, tasks=tasks, lengths=lengths, n_per=n_per, seed=seed)
        lc = longctx.evaluate(model, tok, samples, lspecs, progress=progress)
        res["longctx"] = lc
        res["timing_s"]["longctx"] = time.perf_counter() - t0
    for P, q in res["quality"].items():
        res["targets"][P] = targets(q, lc, 0.5)
    return res
