"""The prepared GPU checks (library of ``bench gpu-checks`` and ``bench gpu-factor-space``).

On the GPU machine, both in ONE device call (about 8-12 minutes on an H100/H200-class GPU)::

    python -m lowrank_lib.bench gpu-checks --out "$OUT" && python -m lowrank_lib.bench gpu-factor-space --out "$OUT"

On a CPU, ``--dry-run`` runs each pipeline on a tiny model with short lengths (tested in CI).

``gpu-checks`` (the decode-runtime issue):

1. correctness on CUDA: tiny GQA model, fp32, engine (every attention backend x graph mode) vs
   transformers DynamicCache: greedy tokens equal, max logit error;
2. LLaMA-7B-shaped random weights, plain low-rank at keep 0.5, bf16, prompt 512 / gen 32 and
   prompt 2048 / gen 128: hf_static, hf_dynamic, dense_kv, engine (eager / split / per-layer /
   whole-step graphs), the uncompressed model (first setting): decode ms/token, launches per token;
3. verdicts against the targets: engine >= 3x hf_static; launches/token <= L + 10 (per-layer) and
   <= 5 (whole step).

``gpu-factor-space`` (factor-space attention at LLaMA-7B-like head counts):

1. correctness on the GPU: factor space vs rebuild-then-attend, fp32 (rel. err < 1e-5) and bf16;
2. per-step decode attention of one layer, bf16, batch 1, contexts 1k-32k, r/d = 0.5 and 0.25,
   w = 32, routes sdpa / dense / rebuild / factor, side by side (interleaved, medians), eager and
   CUDA-graph replay, for LLaMA-7B (32 q / 32 kv heads, d = 128, 32 layers) and a GQA variant
   (32 q / 8 kv heads, LLaMA-3-8B-like);
3. the Engine with the AttSVD store under graphs: eager vs whole-step vs per-layer capture on a small
   random Llama (tiny-smol preset), fp32: tokens equal, logits within 1e-5, two prompts in one bulk
   bucket reuse the capture.

Every check is wrapped: one failure is recorded and the rest still run.
"""
from __future__ import annotations

import time
import traceback

import torch

from ..attsvd.factor_space import factor_space_attention, rebuild_then_attend
from ..attsvd.kv import LowRankKV
from .factor_space import AttnBenchConfig, attention_ratios, bench_attention, rel_err, svd_run

GRAPH_SYSTEMS = ("engine", "engine_split", "engine_layer", "engine_step")


# --------------------------------------------------------------------------- gpu-checks
def correctness(device: str, backends=("sdpa", "triton", "flash_attn"), graphs=("none", "split", "per-layer", "whole-step")):
    """Engine vs HF DynamicCache on a tiny model (fp32; flash_attn in bf16 against HF bf16)."""
    from .. import models
    from ..compress import compress_svd
    from ..generation import run_generation
    from ..runtime import Engine, EngineConfig
    from ..runtime.baselines import HFRunner

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
    from .decode import DecodeBenchConfig, run_decode_bench
    from .models import load_bench_models

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


def checks_markdown(report: dict) -> str:
    from .decode import format_table

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


def gpu_checks(dry_run: bool = False, repeats: int = 2) -> dict:
    """All checks of ``gpu-checks`` in one call; ``dry_run``: CPU, tiny model, short lengths."""
    if dry_run:
        device, model, dtype, settings = "cpu", "tiny-smol", "fp32", [(32, 4), (64, 6)]
        systems = ("hf_static", "hf_dynamic", "dense_kv", "engine", "dense_hf_static")
        backends, graphs = ("sdpa",), ("none",)
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: use --dry-run on CPU")
        device, model, dtype, settings = "cuda", "llama7b-random", "bf16", [(512, 32), (2048, 128)]
        systems = ("hf_static", "hf_dynamic", "dense_kv") + GRAPH_SYSTEMS + ("dense_hf_static",)
        backends, graphs = ("sdpa", "triton", "flash_attn"), ("none", "split", "per-layer", "whole-step")
    t0 = time.time()
    report = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)",
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": model, "keep": 0.5,
              "dtype": dtype, "torch": torch.__version__}
    report["correctness"] = correctness(device, backends, graphs)
    report["speed"], L = speed(model, settings, systems, dtype, device, repeats, 0.5)
    report["n_layers"] = L
    report["verdicts"] = verdicts(report["speed"], L)
    report["wall_s"] = time.time() - t0
    return report


# --------------------------------------------------------------------------- gpu-factor-space
GEOMETRIES = {"llama7b": dict(q_heads=32, kv_heads=32, head_dim=128, layers=32),
              "llama3_8b_gqa": dict(q_heads=32, kv_heads=8, head_dim=128, layers=32)}
CONTEXTS = [1024, 2048, 4096, 8192, 16384, 32768]


def factor_correctness(dev: str, n: int = 4096) -> dict:
    """Factor space vs rebuild-then-attend on two factored runs + exact rows, fp32 and bf16."""
    out = {}
    torch.manual_seed(0)
    a, b = int(n * 0.73), int(n * 0.98)
    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        k = torch.randn(2, 8, n, 128, device=dev)
        v = torch.randn(2, 8, n, 128, device=dev)
        q = torch.randn(2, 32, 1, 128, device=dev)
        kv = LowRankKV([svd_run(k[:, :, :a], v[:, :, :a], 64), svd_run(k[:, :, a:b], v[:, :, a:b], 32)],
                       k[:, :, b:], v[:, :, b:]).to(dt).validate()
        e = rel_err(factor_space_attention(q.to(dt), kv), rebuild_then_attend(q.to(dt), kv))
        out[str(dt)] = {"rel_err": e, "tol": tol, "ok": e < tol}
    return out


def engine_graphs(dev: str, graphs=("none", "whole-step", "per-layer"), compile_backend: str = "inductor") -> dict:
    """The Engine with the AttSVD store, eager vs graph modes, on a random tiny-smol model (fp32)."""
    from .. import models
    from ..attsvd.config import AttSVDConfig
    from ..attsvd.store import AttSVDStore
    from ..runtime import Engine, EngineConfig

    model = models.tiny_model("tiny-smol", seed=0).to(dev)
    acfg = AttSVDConfig(ratio=0.5, window=16)
    out, ref = {}, []
    for graph in graphs:
        try:
            eng = Engine(model, EngineConfig(max_batch=2, max_seq_len=512, graph=graph, compile_backend=compile_backend),
                         kv=AttSVDStore(acfg, bucket=64))
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


def gpu_factor_space(dry_run: bool = False) -> tuple[dict, str]:
    """All checks of ``gpu-factor-space`` in one call -> (result, markdown); ``dry_run``: CPU, small sizes."""
    if dry_run:
        dev, name, contexts, geoms = "cpu", "cpu (dry run)", [256, 512], {"gqa_small": dict(q_heads=8, kv_heads=2,
                                                                                           head_dim=128, layers=4)}
        graph_modes, cuda_graphs, kw = ("none", "whole-step"), (False,), dict(repeats=3, warmup=1, inner=1)
    else:
        if not torch.cuda.is_available():
            raise RuntimeError("no CUDA device: use --dry-run on CPU")
        dev, name, contexts, geoms = "cuda", torch.cuda.get_device_name(0), CONTEXTS, GEOMETRIES
        graph_modes, cuda_graphs, kw = ("none", "whole-step", "per-layer"), (False, True), dict(repeats=30, warmup=5,
                                                                                              inner=20)
    result = {"meta": {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "device": name,
                       "torch": torch.__version__},
              "correctness": factor_correctness(dev, 512 if dry_run else 4096), "runs": {}}
    result["engine_graphs"] = engine_graphs(dev, graph_modes, "aot_eager" if dry_run else "inductor")
    lines = [f"# factor-space attention on {name} ({result['meta']['when']})", ""]
    for geom, g in geoms.items():
        for graphs in cuda_graphs:
            cfg = AttnBenchConfig(contexts=contexts, rank_fracs=[0.5, 0.25], window=32,
                                  dtype="float32" if dry_run else "bfloat16", device=dev, cuda_graphs=graphs, **kw, **g)
            rows = bench_attention(cfg, progress=False)
            ratios = attention_ratios(rows)
            key = f"{geom}_{'graphs' if graphs else 'eager'}"
            result["runs"][key] = {"config": cfg.__dict__, "rows": rows, "ratios": ratios}
            lines += [f"## {key}: {g['q_heads']} q / {g['kv_heads']} kv heads, d={g['head_dim']}, {cfg.dtype}, "
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
    ok = all(c["ok"] for c in result["correctness"].values())
    ok &= all("error" not in v and all(v["tokens_equal_eager"]) for v in result["engine_graphs"].values())
    result["ok"] = ok
    return result, "\n".join(lines) + "\n"
