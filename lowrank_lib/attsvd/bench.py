"""AttSVD budget sweep: every method at every KV budget, quality vs the dense cache + long-context tasks.

    python -m lowrank_lib.attsvd.bench                      # quick: tiny sizes (minutes on a 2-core CPU)
    python -m lowrank_lib.attsvd.bench --report             # report parameters: SmolLM2, prefill 2k/4k/8k,
                                                            # 8 windows, long-context 1k-8k (hours on CPU)
    python -m lowrank_lib.attsvd.bench --prefill 2048 --windows 8 --budgets 0.5

Writes ``benchmarks/results/attsvd_<model>_p<prefills>_n<windows>[_k].json`` (never overwritten: a suffix
is added) and prints a table: per method and budget the mean KL(dense || method) +- std over windows,
continuation perplexity vs dense, measured memory ratio; long-context exact / partial match.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from .config import AttSVDConfig
from ..eval.methods import METHODS, MethodSpec

REPORT = dict(prefill=[2048, 4096, 8192], windows=8, cont=128, budgets=[1.0, 0.8, 0.6, 0.5, 0.25],
              lengths=[1024, 2048, 4096, 8192], n_per=2)
QUICK = dict(prefill=[512], windows=2, cont=64, budgets=[1.0, 0.8, 0.6, 0.5, 0.25], lengths=[512], n_per=1)


def _out_path(out_dir: Path, stem: str) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    p, k = out_dir / f"{stem}.json", 1
    while p.exists():
        p, k = out_dir / f"{stem}_{k}.json", k + 1
    return p


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


def run(model_name: str, prefill: list[int], windows: int, cont: int, budgets: list[float], methods: list[str],
        window: int, chunk: int, lengths: list[int], n_per: int, tasks: list[str], step: int, seed: int,
        longctx_budgets: list[float], progress: bool = True, checkpoint=None) -> dict:
    from .. import models
    from ..eval import kvquality, longctx

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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowrank_lib.attsvd.bench", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--report", action="store_true", help="the report parameters (SmolLM2 up to 8k tokens)")
    ap.add_argument("--prefill", type=int, nargs="+")
    ap.add_argument("--windows", type=int)
    ap.add_argument("--cont", type=int)
    ap.add_argument("--budgets", type=float, nargs="+")
    ap.add_argument("--methods", nargs="+", default=[m for m in METHODS if m != "dense"], choices=METHODS)
    ap.add_argument("--window", type=int, default=32, help="AttSVD exact window w (also kept by eviction)")
    ap.add_argument("--chunk", type=int, default=128, help="stream chunk l")
    ap.add_argument("--step", type=int, default=32, help="teacher-forced continuation tokens per forward")
    ap.add_argument("--lengths", type=int, nargs="*", help="long-context prompt lengths (empty: skip)")
    ap.add_argument("--n-per", type=int)
    ap.add_argument("--tasks", nargs="*", default=["passkey", "needle_single", "needle_multikey", "variable_tracking"])
    ap.add_argument("--longctx-budgets", type=float, nargs="+", default=[0.5])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results")
    a = ap.parse_args(argv)
    preset = REPORT if a.report else QUICK
    args = dict(model_name=a.model, prefill=a.prefill or preset["prefill"], windows=a.windows or preset["windows"],
                cont=a.cont or preset["cont"], budgets=a.budgets or preset["budgets"], methods=a.methods,
                window=a.window, chunk=a.chunk, lengths=preset["lengths"] if a.lengths is None else a.lengths,
                n_per=a.n_per or preset["n_per"], tasks=a.tasks, step=a.step, seed=a.seed,
                longctx_budgets=a.longctx_budgets)
    stem = f"attsvd_{a.model}_p{'-'.join(map(str, args['prefill']))}_n{args['windows']}"
    path = _out_path(Path(a.out), stem)
    meta = {"args": args, "torch_threads": torch.get_num_threads(),
            "command": "python -m lowrank_lib.attsvd.bench " + " ".join(argv if argv is not None else sys.argv[1:])}

    def save(partial: dict) -> None:
        path.write_text(json.dumps(partial | meta, indent=1))

    res = run(**args, checkpoint=save) | meta
    save(res)
    txt = table(res)
    path.with_suffix(".txt").write_text(txt + "\n")
    print(txt)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
