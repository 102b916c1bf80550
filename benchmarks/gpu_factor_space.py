"""GPU check of factor-space decode attention at LLaMA-7B-like head counts, in ONE device call.

    python benchmarks/gpu_factor_space.py            # writes $OUT/ (or benchmarks/results/) json + md

What it runs (about 2-4 minutes on one H100/H200-class GPU):
1. correctness on the GPU: factor space vs rebuild-then-attend, fp32 (rel. err < 1e-5) and bf16;
2. per-step decode attention of one layer, bf16, batch 1, contexts 1k-32k, r/d = 0.5 and 0.25,
   w = 32, routes sdpa / dense / rebuild / factor, side by side (interleaved, medians), eager and
   CUDA-graph replay, for LLaMA-7B (32 q / 32 kv heads, d = 128, 32 layers) and a GQA variant
   (32 q / 8 kv heads, LLaMA-3-8B-like);
3. FactorEngine (the runtime Engine with the AttSVD factor-space KV mode) under CUDA graphs:
   eager vs whole-step vs per-layer capture on a small random Llama (tiny-smol preset), fp32:
   tokens equal, logits within 1e-5, two prompts in one bulk bucket reuse the capture.
Targets (the issue): factor >= 5x faster than rebuild at 8k and no slower than dense attention.
Needs only torch (+ this repository on the path); no model weights.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lowrank_lib.attsvd.bench_factor_space import (AttnBenchConfig, attention_ratios, bench_attention,  # noqa: E402
                                                   rel_err, svd_run)
from lowrank_lib.attsvd.factor_space import factor_space_attention, rebuild_then_attend  # noqa: E402
from lowrank_lib.attsvd.kv import LowRankKV  # noqa: E402

GEOMETRIES = {"llama7b": dict(q_heads=32, kv_heads=32, head_dim=128, layers=32),
              "llama3_8b_gqa": dict(q_heads=32, kv_heads=8, head_dim=128, layers=32)}
CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768]


def correctness(dev: str) -> dict:
    out = {}
    torch.manual_seed(0)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        k = torch.randn(2, 8, 4096, 128, device=dev)
        v = torch.randn(2, 8, 4096, 128, device=dev)
        q = torch.randn(2, 32, 1, 128, device=dev)
        kv = LowRankKV([svd_run(k[:, :, :3000], v[:, :, :3000], 64), svd_run(k[:, :, 3000:4000], v[:, :, 3000:4000], 32)],
                       k[:, :, 4000:], v[:, :, 4000:])
        kvd = kv.to(dt)
        e = rel_err(factor_space_attention(q.to(dt), kvd), rebuild_then_attend(q.to(dt), kvd))
        out[str(dt)] = {"rel_err": e, "tol": tol, "ok": e < tol}
    return out


def engine_graphs(dev: str) -> dict:
    """The Engine with the AttSVD store, eager vs CUDA-graph modes, on a random tiny-smol model (fp32)."""
    from lowrank_lib import models
    from lowrank_lib.attsvd.config import AttSVDConfig
    from lowrank_lib.attsvd.store import AttSVDStore
    from lowrank_lib.runtime import Engine, EngineConfig

    model = models.tiny_model("tiny-smol", seed=0).to(dev)
    acfg = AttSVDConfig(ratio=0.5, window=16)
    out = {}
    ref = {}
    for graph in ("none", "whole-step", "per-layer"):
        try:
            eng = Engine(model, EngineConfig(max_batch=2, max_seq_len=512, graph=graph), kv=AttSVDStore(acfg, bucket=64))
            res = []
            for T in (300, 310, 400):                     # bulks 284, 294 (bucket 320), 384 (384)
                g = torch.Generator().manual_seed(T)
                ids = torch.randint(3, 512, (2, T), generator=g).to(dev)
                mask = torch.ones_like(ids)
                mask[1, :7] = 0
                o = eng.generate(ids, 12, attention_mask=mask, return_logits=True)
                res.append((o.tokens.cpu(), torch.stack(o.logits, 1).cpu(), o.info.get("capture_s", 0.0),
                            o.decode_ms_per_token))
            if graph == "none":
                ref = res
            out[graph] = {"tokens_equal_eager": [bool(torch.equal(a[0], b[0])) for a, b in zip(res, ref)],
                          "logit_rel_err": [rel_err(a[1], b[1]) for a, b in zip(res, ref)],
                          "capture_s": [r[2] for r in res], "decode_ms_per_token": [r[3] for r in res]}
        except Exception as e:  # record, keep the rest of the device call useful
            out[graph] = {"error": f"{type(e).__name__}: {e}"}
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA device: this script is for the GPU machine", file=sys.stderr)
        return 2
    dev = "cuda"
    name = torch.cuda.get_device_name(0)
    result = {"meta": {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": name,
                       "torch": torch.__version__, "command": "python benchmarks/gpu_factor_space.py"},
              "correctness": correctness(dev), "runs": {}}
    print(json.dumps(result["correctness"]))
    result["engine_graphs"] = engine_graphs(dev)
    print(json.dumps(result["engine_graphs"], indent=1))
    lines = [f"# factor-space attention on {name} ({result['meta']['when']})", ""]
    for geom, g in GEOMETRIES.items():
        for graphs in (False, True):
            cfg = AttnBenchConfig(contexts=CONTEXTS, rank_fracs=[0.5, 0.25], window=32, dtype="bfloat16",
                                  device=dev, repeats=30, warmup=5, inner=20, cuda_graphs=graphs, **g)
            rows = bench_attention(cfg, progress=False)
            ratios = attention_ratios(rows)
            key = f"{geom}_{'graphs' if graphs else 'eager'}"
            result["runs"][key] = {"config": cfg.__dict__, "rows": rows, "ratios": ratios}
            lines += [f"## {key}: {g['q_heads']} q / {g['kv_heads']} kv heads, d={g['head_dim']}, bf16, "
                      f"per layer per step (ms), x{g['layers']} layers for the per-token estimate", "",
                      "| context | rank | factor | rebuild | rebuild (prealloc) | best dense | rebuild/factor | "
                      "rebuild (prealloc)/factor | dense/factor |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for r in ratios:
                lines.append(f"| {r['context']} | {r['rank']} | {r['factor_ms']:.4f} | {r['rebuild_ms']:.4f} | "
                             f"{r['rebuild_prealloc_ms']:.4f} | {r['best_dense_ms']:.4f} | "
                             f"{r['rebuild_over_factor']:.1f}x | {r['rebuild_prealloc_over_factor']:.1f}x | "
                             f"{r['dense_over_factor']:.2f}x |")
            lines.append("")
            print("\n".join(lines[-(len(ratios) + 4):]), flush=True)
    out = Path(os.environ.get("OUT") or ROOT / "benchmarks" / "results")
    out.mkdir(parents=True, exist_ok=True)
    (out / "factor_space_gpu.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "factor_space_gpu.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'factor_space_gpu.json'}")
    ok = all(c["ok"] for c in result["correctness"].values())
    ok &= all("error" not in v and all(v["tokens_equal_eager"]) for v in result["engine_graphs"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
