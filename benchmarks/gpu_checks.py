"""ALL GPU checks of the decode-runtime issue in ONE device call.

    python benchmarks/gpu_checks.py --out "$OUT"            # on the GPU machine (~6-10 min on an H200)
    python benchmarks/gpu_checks.py --dry-run --out /tmp/x  # CPU: tiny model, same pipeline, no CUDA

1. correctness on CUDA: tiny GQA model, fp32, engine (every attention backend x graph mode) vs
   transformers DynamicCache: greedy tokens equal, max logit error;
2. LLaMA-7B-shaped random weights, plain low-rank at keep 0.5, bf16, prompt 512 / gen 32 and
   prompt 2048 / gen 128: hf_static, hf_dynamic, dense_kv, engine (eager / split / per-layer /
   whole-step graphs), the uncompressed model (first setting): decode ms/token, launches per token;
3. verdicts against the targets: engine >= 3x hf_static; launches/token <= L + 10 (per-layer) and
   <= 5 (whole step).

Writes ``gpu_checks.json`` and ``gpu_checks.md`` (the table) to --out and to benchmarks/results/.
Every check is wrapped: one failure is recorded and the rest still run.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

GRAPH_SYSTEMS = ("engine", "engine_split", "engine_layer", "engine_step")


def correctness(device: str, backends=("sdpa", "triton", "flash_attn"), graphs=("none", "split", "per-layer", "whole-step")):
    """Engine vs HF DynamicCache on a tiny model (fp32; flash_attn in bf16 against HF bf16)."""
    from lowrank_lib import models
    from lowrank_lib.compress import compress_svd
    from lowrank_lib.runtime import Engine, EngineConfig, run_generation
    from lowrank_lib.runtime.baselines import HFRunner

    rows = []
    base = compress_svd(models.tiny_model("tiny-gqa", seed=1), 0.6).to(device)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    for be in backends:
        dt = torch.bfloat16 if be == "flash_attn" else torch.float32
        model = base.to(dt)
        ref = run_generation(HFRunner(model, "dynamic"), ids, 10, mask, return_logits=True)
        for g in graphs:
            row = {"backend": be, "graph": g, "dtype": str(dt)}
            try:
                eng = Engine(model, EngineConfig(max_batch=2, max_seq_len=32, attention=be, graph=g))
                out = eng.generate(ids, 10, attention_mask=mask, return_logits=True)
                row.update(tokens_equal=bool(torch.equal(out.tokens, ref.tokens)),
                           max_logit_err=max(float((a - b).abs().max()) for a, b in zip(out.logits, ref.logits)),
                           backend_ran=eng.backend.name, reason=eng.backend.reason, capture_s=eng.capture_s)
            except Exception as e:  # record and continue
                row["error"] = f"{type(e).__name__}: {e}"[:500]
            rows.append(row)
    return rows


def speed(model: str, settings, systems, dtype: str, device: str, repeats: int, keep: float, progress=True):
    from lowrank_lib.bench.decode import DecodeBenchConfig, run_decode_bench
    from lowrank_lib.bench.models import load_bench_models

    models_ = load_bench_models(model, "svd", keep, None, device)
    out = []
    for i, (p, g) in enumerate(settings):
        sys_ = [s for s in systems if i == 0 or s != "dense_hf_static"]
        cfg = DecodeBenchConfig(model=model, keep=keep, prompt_len=p, gen_len=g, dtype=dtype, systems=tuple(sys_),
                                repeats=repeats, device=device)
        try:
            out.append(run_decode_bench(cfg, models=models_, progress=progress))
        except Exception:
            out.append({"config": {"prompt_len": p, "gen_len": g}, "error": traceback.format_exc()[-2000:]})
    return out, models_[1].config.num_hidden_layers


def verdicts(speed_results: list[dict], n_layers: int) -> list[dict]:
    """Targets of the issue, checked on measured results (pure function, tested on CPU)."""
    out = []
    for res in speed_results:
        if "systems" not in res:
            continue
        c, rows = res["config"], res["systems"]
        tag = f"p{c['prompt_len']}/g{c['gen_len']}"
        hs = rows.get("hf_static")
        best = min((s for s in GRAPH_SYSTEMS if s in rows), key=lambda s: rows[s]["decode_ms_per_token"], default=None)
        if hs and best:
            sp = hs["decode_ms_per_token"] / rows[best]["decode_ms_per_token"]
            out.append({"setting": tag, "target": "engine decode >= 3x hf_static", "system": best,
                        "value": sp, "met": sp >= 3.0})
        for s, lim in (("engine_layer", n_layers + 10), ("engine_step", 5)):
            if s in rows:
                v = rows[s]["per_token_count"]
                out.append({"setting": tag, "target": f"{s} launches/token <= {lim}", "system": s, "value": v,
                            "met": v <= lim})
    return out


def markdown(report: dict) -> str:
    from lowrank_lib.bench.decode import format_table

    lines = [f"# GPU checks ({report['device']}, {report['time']})", "", "## Correctness (tiny GQA, vs HF DynamicCache)",
             "", "backend | graph | ran | tokens equal | max logit err | capture s | error", "---|---|---|---|---|---|---"]
    for r in report["correctness"]:
        lines.append(f"{r['backend']} | {r['graph']} | {r.get('backend_ran', '-')} | {r.get('tokens_equal', '-')} | "
                     f"{r.get('max_logit_err', float('nan')):.2e} | {r.get('capture_s', 0):.2f} | {r.get('error', '')[:80]}")
    for res in report["speed"]:
        c = res["config"]
        lines += ["", f"## {report['model']} keep={report['keep']} {report['dtype']} prompt {c['prompt_len']} / gen {c['gen_len']}", ""]
        lines.append(format_table(res) if "systems" in res else "ERROR\n```\n" + res["error"] + "\n```")
    lines += ["", "## Targets", "", "setting | target | system | value | met", "---|---|---|---|---"]
    for v in report["verdicts"]:
        lines.append(f"{v['setting']} | {v['target']} | {v['system']} | {v['value']:.2f} | {v['met']}")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny model, short lengths (pipeline check)")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args(argv)
    if a.dry_run:
        device, model, dtype, settings = "cpu", "tiny-smol", "fp32", [(32, 4), (64, 6)]
        systems = ("hf_static", "hf_dynamic", "dense_kv", "engine", "dense_hf_static")
        backends, graphs = ("sdpa",), ("none",)
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: use --dry-run on CPU", file=sys.stderr)
            return 2
        device, model, dtype, settings = "cuda", "llama7b-random", "bf16", [(512, 32), (2048, 128)]
        systems = ("hf_static", "hf_dynamic", "dense_kv") + GRAPH_SYSTEMS + ("dense_hf_static",)
        backends, graphs = ("sdpa", "triton", "flash_attn"), ("none", "split", "per-layer", "whole-step")
    t0 = time.time()
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": model, "keep": 0.5,
              "dtype": dtype, "torch": torch.__version__}
    report["correctness"] = correctness(device, backends, graphs)
    print(json.dumps(report["correctness"], indent=1), flush=True)
    report["speed"], L = speed(model, settings, systems, dtype, device, a.repeats, 0.5)
    report["n_layers"] = L
    report["verdicts"] = verdicts(report["speed"], L)
    report["wall_s"] = time.time() - t0
    text = markdown(report)
    print(text)
    outs = {Path(a.out)} | ({ROOT / "benchmarks" / "results"} if not a.dry_run else set())
    for d in outs:
        d.mkdir(parents=True, exist_ok=True)
        (d / "gpu_checks.json").write_text(json.dumps(report, indent=1, default=str))
        (d / "gpu_checks.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
