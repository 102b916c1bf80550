"""The prepared GPU checks: ``python -m lowrank_lib.bench gpu-session`` (library of that command).

On the GPU machine, everything in ONE device call of at most 10 minutes (stages that no longer fit the
budget are skipped and recorded; results are rewritten after every stage; each stage runs in a child process)::

    PYTHONUNBUFFERED=1 PYTHONPATH=$PWD python3 -m lowrank_lib.bench gpu-session --budget-s 500 --out "$OUT"

On a CPU, ``--dry-run`` runs every stage on tiny sizes (tested in CI). The stages, in order
(:data:`SESSION_STAGES`; ``--stages`` reruns a subset):

1. ``correctness``: tiny GQA model, fp32, every attention backend (sdpa, triton, flash_attn in bf16) x graph mode
   vs transformers' DynamicCache, left-padded batch: greedy tokens equal, max logit error, which backend ran;
2. ``factor_correctness``: factor-space attention vs rebuild-then-attend, fp32 (rel. err < 1e-5) and bf16;
3. ``engine_graphs``: the Engine with the AttSVD store, eager vs whole-step vs per-layer capture (tiny-smol, fp32);
4. ``speed_p512`` / ``speed_p2048``: LLaMA-7B-shaped random weights at keep 0.5, bf16, prompt 512 / gen 32 and
   2048 / 128: hf_static, hf_dynamic, dense_kv, the engine in every graph mode, the dense model through hf_static
   and the gpt-fast-style compiled baseline (``dense_hf_compiled``: StaticCache + torch.compile
   "reduce-overhead"); verdicts (:func:`verdicts`): engine >= 3x hf_static, faster than the compiled dense
   baseline, launches/token <= L + 10 (per-layer) and <= 5 (whole step), within 2x of the weight-bytes roofline;
5. ``factor_llama7b`` / ``factor_gqa``: one layer's decode attention per step, bf16, contexts 1k-32k, r/d 0.5
   and 0.25, routes sdpa / dense / rebuild / factor, eager and CUDA-graph replay, 32/32 and 32/8 heads.
"""
from __future__ import annotations

import operator
import time
import traceback

import torch

from ..eval.factor_space import (AttnBenchConfig, attention_ratios, attention_table, bench_attention,
                                 engine_graphs, factor_correctness)

GRAPH_SYSTEMS = ("engine", "engine_split", "engine_layer", "engine_step", "engine_step_compiled")


# --------------------------------------------------------------------------- decode runtime checks
def correctness(device: str, backends=("sdpa", "triton", "flash_attn"), graphs=("none", "split", "per-layer", "whole-step")):
    """Engine vs HF DynamicCache on a tiny model (fp32; flash_attn in bf16 against HF bf16)."""
    from .. import models
    from ..compress import compress_svd
    from ..runtime import ATTENTION_REGISTRY, Engine, EngineConfig, run_generation
    from ..runtime.baselines import HFRunner

    rows = []
    base = compress_svd(models.tiny_model("tiny-gqa", seed=1), 0.6).to(device)
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(0)).to(device)
    mask = (torch.arange(12)[None] >= torch.tensor([[0], [3]])).long().to(device)       # row 1: 3 left pads
    for be in backends:
        dtypes = ATTENTION_REGISTRY[be].caps.dtypes            # fp32 where the backend serves it (flash_attn: bf16)
        dt = torch.float32 if dtypes is None or torch.float32 in dtypes else torch.bfloat16
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
            except Exception as e:  # record and continue; a backend whose package is absent is skipped, not failed
                row["skipped" if "package is not importable" in str(e) else "error"] = traceback.format_exc()[-1000:]
            rows.append(row)
    return rows

OPS = {">=": operator.ge, ">": operator.gt, "<=": operator.le}


def verdicts(speed_results: list[dict], n_layers: int) -> list[dict]:
    """Targets of the issue, checked on measured results (pure function, tested on CPU): each one a row of
    (target, system, measured value, direction, bound); a setting that errored gives none."""
    out = []
    for res in (r for r in speed_results if "systems" in r):
        c, rows = res["config"], res["systems"]
        ms = {s: r["decode_ms_per_token"] for s, r in rows.items()}
        best = min((s for s in GRAPH_SYSTEMS if s in rows), key=ms.get, default=None)
        checks = [(f"{s} launches/token <= {lim}", s, rows[s]["per_token_count"], "<=", lim)
                  for s, lim in (("engine_layer", n_layers + 10), ("engine_step", 5)) if s in rows]
        if best:     # dense_hf_compiled: the gpt-fast-style dense baseline (torch.compile reduce-overhead + StaticCache)
            ratio = lambda s: ms[s] / ms[best] if s in ms else None               # noqa: E731
            checks += [("engine decode >= 3x hf_static", best, ratio("hf_static"), ">=", 3.0),
                       ("engine faster than the compiled dense baseline (gpt-fast style)", best,
                        ratio("dense_hf_compiled"), ">", 1.0),
                       ("engine within 2x of the weight-bytes roofline", best, rows[best]["roofline_x"], "<=", 2.0)]
        out += [{"setting": f"p{c['prompt_len']}/g{c['gen_len']}", "target": t, "system": s, "value": v,
                 "met": OPS[op](v, b)} for t, s, v, op, b in checks if v is not None]
    return out


def checks_markdown(report: dict) -> str:
    from ..runtime.decode_bench import format_table

    lines = [f"# GPU checks ({report['device']}, {report['time']})", "", "## Correctness (tiny GQA, vs HF DynamicCache)",
             "", "backend | graph | ran | tokens equal | max logit err | capture s | error", "---|---|---|---|---|---|---"]
    for r in report["correctness"]:
        why = (r.get("error") or r.get("skipped") or "-").strip().splitlines()[-1][:90]
        lines.append(f"{r['backend']} | {r['graph']} | {r.get('backend_ran', '-')} | {r.get('tokens_equal', '-')} | "
                     f"{r.get('max_logit_err', float('nan')):.2e} | {r.get('capture_s', 0):.2f} | {why}")
    for res in report["speed"]:
        c = res["config"]
        lines += ["", f"## {report['model']} keep={report['keep']} {report['dtype']} prompt {c['prompt_len']} / gen {c['gen_len']}", ""]
        lines.append(format_table(res) if "systems" in res else "ERROR\n```\n" + res["error"] + "\n```")
    lines += ["", "## Targets", "", "setting | target | system | value | met", "---|---|---|---|---"]
    for v in report["verdicts"]:
        lines.append(f"{v['setting']} | {v['target']} | {v['system']} | {v['value']:.2f} | {v['met']}")
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- one device call
#: what the session runs: on the GPU, and in the CPU dry run (the same pipeline at tiny sizes)
PROFILES = {
    "cuda": dict(model="llama7b-random", dtype="bf16", settings={"speed_p512": (512, 32), "speed_p2048": (2048, 128)},
                 systems=("hf_static", "hf_dynamic", "dense_kv", *GRAPH_SYSTEMS, "dense_hf_static", "dense_hf_compiled"),
                 backends=("sdpa", "triton", "flash_attn"), graphs=("none", "split", "per-layer", "whole-step"),
                 contexts=[1024, 2048, 4096, 8192, 16384, 32768], factor_dtype="bfloat16", factor_n=4096,
                 geometries={"factor_llama7b": ("llama7b", dict(q_heads=32, kv_heads=32, head_dim=128, layers=32)),
                             "factor_gqa": ("llama3_8b_gqa", dict(q_heads=32, kv_heads=8, head_dim=128, layers=32))},
                 engine_graphs=("none", "whole-step", "per-layer"), compile_backend="inductor", cuda_graphs=(False, True),
                 timing=dict(repeats=30, warmup=5, inner=20)),
    "dry-run": dict(model="tiny-smol", dtype="fp32", settings={"speed_p512": (32, 4), "speed_p2048": (64, 6)},
                    systems=("hf_static", "hf_dynamic", "dense_kv", "engine", "dense_hf_static"),
                    backends=("sdpa",), graphs=("none",), contexts=[256, 512], factor_dtype="float32", factor_n=512,
                    geometries={"factor_llama7b": ("gqa_small", dict(q_heads=8, kv_heads=2, head_dim=128, layers=4))},
                    engine_graphs=("none", "whole-step"), compile_backend="aot_eager", cuda_graphs=(False,),
                    timing=dict(repeats=3, warmup=1, inner=1)),
}
#: (stage, seconds it needs at least on an H200, estimated) in the order the session runs them: the
#: correctness checks first, then the 512/32 speed setting, then what only adds numbers
SESSION_STAGES = (("correctness", 60), ("factor_correctness", 30), ("engine_graphs", 60), ("speed_p512", 150),
                  ("factor_llama7b", 90), ("speed_p2048", 200), ("factor_gqa", 90))


def run_stage(stage: str, dry_run: bool, repeats: int, progress: bool = True) -> dict:
    """ONE stage of the session -> its results (JSON), keyed by where :func:`gpu_session` files them. On the GPU
    each stage runs in a child process of its own (``bench.child``): a CUDA fault (an illegal address, seen on
    the H200) poisons the whole process's context, and would otherwise fail every later stage too."""
    P, device = PROFILES["dry-run" if dry_run else "cuda"], "cpu" if dry_run else "cuda"
    if stage == "correctness":
        return {"correctness": correctness(device, P["backends"], P["graphs"])}
    if stage == "factor_correctness":
        return {"factor_correctness": factor_correctness(device, P["factor_n"])}
    if stage == "engine_graphs":
        return {"engine_graphs": engine_graphs(device, P["engine_graphs"], P["compile_backend"])}
    if stage.startswith("speed"):
        from ..resolve import resolve_models
        from ..runtime.decode_bench import DecodeBenchConfig, run_decode_bench

        models_ = resolve_models(P["model"], method="svd", keep=0.5, device=device)
        (p, g), sys_ = P["settings"][stage], (s for s in P["systems"] if stage == "speed_p512" or s != "dense_hf_static")
        cfg = DecodeBenchConfig(model=P["model"], keep=0.5, prompt_len=p, gen_len=g, dtype=P["dtype"], systems=tuple(sys_),
                                repeats=repeats, device=device)
        try:
            res = run_decode_bench(cfg, models=models_, progress=progress)
        except Exception:    # the newest system failing must not cost the others' numbers: rerun without it, say why
            cfg.systems = tuple(s for s in cfg.systems if s != "engine_step_compiled")
            res = {**run_decode_bench(cfg, models=models_, progress=progress), "dropped": traceback.format_exc()[-1500:]}
        return {"speed": [res], "n_layers": models_[1].config.num_hidden_layers}
    (name, geo), runs, md = P["geometries"][stage], {}, []
    for cg in P["cuda_graphs"]:
        cfg = AttnBenchConfig(contexts=P["contexts"], rank_fracs=[0.5, 0.25], window=32, dtype=P["factor_dtype"],
                              device=device, cuda_graphs=cg, **P["timing"], **geo)
        rows = bench_attention(cfg, progress=False)
        key = f"{name}_{'graphs' if cg else 'eager'}"
        runs[key] = {"config": cfg.__dict__, "rows": rows, "ratios": attention_ratios(rows)}
        md += [f"## {key}: {geo['q_heads']} q / {geo['kv_heads']} kv heads, d={geo['head_dim']}, {cfg.dtype}, per layer "
               f"per step (ms), x{geo['layers']} layers for the per-token estimate", "",
               *attention_table(runs[key]["ratios"], geo["layers"], 4), ""]
    return {"runs": runs, "md": md}


def gpu_session(out_dir, budget_s: float = 500.0, dry_run: bool = False, repeats: int = 2, progress=True,
                stages: tuple[str, ...] | None = None, command: str | None = None, isolate: bool | None = None) -> dict:
    """Every GPU check of the project in ONE call, inside ``budget_s`` seconds (a device call's limit).

    Stages run in :data:`SESSION_STAGES` order; one whose estimated need no longer fits the remaining
    budget is recorded as skipped, so the call returns in time with everything that ran. Results are
    rewritten after every stage (``gpu_checks_<tag>.json/.md``, ``factor_space_gpu_<tag>.json/.md``), so a
    killed call still leaves what finished. ``stages``: run only these (a rerun of what failed).
    ``dry_run``: the same pipeline on the CPU with tiny sizes (:data:`PROFILES`). ``isolate``: each stage in a
    child process (:func:`run_stage`; default: on the GPU only)."""
    from .child import run_child
    from .results import ResultFiles

    t0, isolate = time.time(), not dry_run if isolate is None else isolate
    if not dry_run and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: use --dry-run on CPU")
    P = PROFILES["dry-run" if dry_run else "cuda"]
    model, dtype, dev_name = P["model"], P["dtype"], "cpu (dry run)" if dry_run else torch.cuda.get_device_name()
    tag = "dry-run" if dry_run else f"{model}_{dtype}"
    checks_f, fs_f = ResultFiles(out_dir, "gpu_checks", tag), ResultFiles(out_dir, "factor_space_gpu", tag)
    checks = {"device": dev_name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "model": model,
              "keep": 0.5, "dtype": dtype, "torch": torch.__version__, "budget_s": budget_s, "correctness": [],
              "speed": [], "verdicts": [], "stages": {}, "command": command}
    fs = {"meta": {"when": checks["time"], "device": dev_name, "torch": torch.__version__}, "runs": {}, "stages": {},
          "command": command}
    n_layers, md_fs = None, [f"# factor-space attention on {dev_name} ({checks['time']})", ""]

    def save():
        checks["n_layers"] = n_layers
        checks["verdicts"] = verdicts(checks["speed"], n_layers) if n_layers else []
        checks["wall_s"] = fs["wall_s"] = time.time() - t0
        fc, eg = fs.get("correctness", {}), fs.get("engine_graphs", {})     # ok = ran AND passed
        fs["ok"] = bool(fc) and bool(eg) and all(c.get("ok", False) for c in fc.values()) and \
            all("error" not in v and all(v["tokens_equal_eager"]) for v in eg.values())
        checks_f.write(checks, md=checks_markdown(checks))
        fs_f.write(fs, md="\n".join(md_fs) + "\n")

    for stage, need in SESSION_STAGES:
        left = budget_s - (time.time() - t0)
        rec = checks["stages"] if stage == "correctness" or stage.startswith("speed") else fs["stages"]
        if (stage.startswith("factor_") and stage != "factor_correctness" and stage not in P["geometries"]) or \
                (stages and stage not in stages):
            continue
        if left < need:
            rec[stage] = f"skipped: {left:.0f} s of the {budget_s:.0f} s budget left, needs ~{need} s"
            continue
        ts = time.time()
        if progress:
            print(f"[gpu-session] {stage} ({left:.0f} s left)", flush=True)
        try:
            r = run_child("lowrank_lib.bench.gpu:run_stage", timeout=left, stage=stage, dry_run=dry_run,
                          repeats=repeats, progress=progress)["result"] if isolate else \
                run_stage(stage, dry_run, repeats, progress)
            checks["correctness"] = r.get("correctness", checks["correctness"])
            checks["speed"] += r.get("speed", [])
            n_layers = r.get("n_layers", n_layers)
            fs.update({dst: r[src] for src, dst in (("factor_correctness", "correctness"), ("engine_graphs",) * 2)
                       if src in r})
            fs["runs"].update(r.get("runs", {}))
            md_fs += r.get("md", [])
            rec[stage] = f"done in {time.time() - ts:.1f} s"
        except Exception:
            rec[stage] = "error: " + traceback.format_exc()[-1500:]
            if stage.startswith("speed"):
                checks["speed"].append({"config": dict(zip(("prompt_len", "gen_len"), P["settings"][stage])), "error": rec[stage]})
        save()
    return {"gpu_checks": checks, "factor_space": fs, "files": [str(checks_f.path), str(fs_f.path)]}

