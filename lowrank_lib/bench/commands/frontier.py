"""Low rank or quantization: llama.cpp's quantized GGUFs and our low-rank models on one quality / bytes / speed frontier.

    python -m lowrank_lib.bench frontier --threads 2                      # quality + bytes of every point (long)
    python -m lowrank_lib.bench frontier --families svdllm --keep 0.8 --resume benchmarks/results/frontier_smollm2.json
    python -m lowrank_lib.bench frontier --families svdllm --factor-bits 8 4 mixed [--gptq] --resume FILE
    python -m lowrank_lib.bench frontier --speed --resume benchmarks/results/frontier_smollm2.json   # idle machine
    python -m lowrank_lib.bench frontier --speed --points Q4_K_M "SVD-LLM v1 keep 0.8 int8" --resume FILE
    python -m lowrank_lib.bench frontier --longctx --prompt-len 8000 --windows 2 --resume FILE   # weights + KV bytes
    python -m lowrank_lib.bench frontier --model tiny-smol --windows 1 --prompt-len 128 --calib-samples 2 \\
        --calib-len 64 --keep 0.8 --families svdllm                      # a smoke run

Quality phase (default; :mod:`lowrank_lib.eval.frontier` measures, its docstring says how): perplexity of every
point on the SAME WikiText-2 test windows (``--windows`` x ``--prompt-len``) and the weight bytes one decode step
reads, for llama.cpp's types (``--quants``; GGUFs under ``<model cache>/frontier/<model>``, reused while present;
``--ik TYPE...``: the same files run by ik_llama.cpp, :mod:`lowrank_lib.eval.ik_llamacpp`) and ours (``--families`` at every ``--keep``, and dense; one calibration of ``--calib-samples`` x ``--calib-len``,
ASVD's on ``--asvd-calib``; bf16 weights and, with ``--factor-bits 8 4 mixed``, int8 / int4 / MIXED_4_8 factors
in ``--factor-group`` columns per scale, with ``--gptq`` GPTQ codes); each of our models is saved under the cache for the speed phase.

``--resume FILE`` continues a run: the points FILE holds are kept and not measured again, new points are added,
and FILE is rewritten (one JSON for every point, however many sittings measured them); ``--merge OTHER...`` first
adds the points of other runs' files (runs of separate subsets, e.g. in parallel). Without it a new result
file is written (``frontier_<model>.json``, never overwriting). ``--cross-check`` adds ``llama-perplexity``'s
protocol on the F32 / Q8_0 / Q4_K_M files (:func:`lowrank_lib.eval.frontier.cross_check`); ``--caveat`` the
requantization measurement on a tiny random model (:func:`lowrank_lib.eval.frontier.requantize_caveat`).

Speed phase (``--speed``): every point of ``--resume`` that has a file (or those ``--points`` names, by label or
id), one child process per point (:mod:`lowrank_lib.bench.child`: its peak RSS), decode ms/token after a ``--prompt-len`` prompt (default 512)
over ``--gen-len`` tokens at every ``--threads`` (default 1 2), ``--repeats`` timed generations after a warm-up
(llama.cpp through :class:`~lowrank_lib.bench.llamacpp.LlamaCppRunner`, ours through the engine; both by the one
decode loop and :class:`~lowrank_lib.bench.peer_base.Timed`, medians by :mod:`lowrank_lib.timing`), idle machine.
Each ``--speed`` run is one sitting in FILE's ``sittings``: it times llama.cpp Q4_K_M first, and every point it
times is compared with that (``eval.frontier.speed_ratio``), never with another sitting's milliseconds.
Long-context phase (``--longctx``, context ``--prompt-len`` default 8000, ``--budget`` of the composed cache): :func:`lowrank_lib.eval.long_context.measure` (``long_context`` in FILE).
"""
from __future__ import annotations

import json
from pathlib import Path

DEFAULT_FAMILIES = ("svdllm", "svdllm_v2", "basis_sharing", "dobi", "dobi-remap", "asvd")


def add_arguments(p) -> None:
    from ...eval.frontier import LLAMACPP_TYPES
    from ..options import add_budget, add_gen_len, add_keep, add_list, add_prompt_len, add_threads

    p.add_argument("--model", default="smollm2")
    add_keep(p, [0.9, 0.8, 0.6])
    p.add_argument("--families", nargs="+", default=list(DEFAULT_FAMILIES), help="the registry's names; none: none")
    p.add_argument("--quants", nargs="+", default=list(LLAMACPP_TYPES), help="llama.cpp file types; none: none")
    p.add_argument("--ik", nargs="+", default=[], help="the same llama.cpp file types also run by ik_llama.cpp")
    p.add_argument("--no-dense", action="store_true", help="skip our dense bf16 point")
    add_list(p, "--factor-bits", lambda v: v if v == "mixed" else int(v), [0], "our low-rank points also with "
             "their factors quantized to these bits (8 4 mixed; mixed: MIXED_4_8; 0: none, bf16 only)")
    p.add_argument("--gptq", action="store_true", help="the quantized factors with GPTQ codes (calibrated)")
    p.add_argument("--factor-group", type=int, default=None, help="columns per scale of quantized factors "
                   "(default lowrank_lib.quant.DEFAULT_GROUP)")
    p.add_argument("--windows", type=int, default=4, help="first N windows of WikiText-2 test")
    add_prompt_len(p, None, "quality: window tokens (default 2048); --speed: prompt before decode (default 512)")
    add_gen_len(p, 64, "--speed: decoded tokens per timed generation")
    add_threads(p, None, "quality: torch and llama.cpp threads, one value (default: torch's); --speed: the thread "
                "counts timed (default 1 2)")
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-len", type=int, default=512, help="tokens per calibration sample")
    p.add_argument("--asvd-calib", type=int, nargs=2, default=[1, 256], metavar=("SAMPLES", "TOKENS"),
                   help="calibration samples x tokens of ASVD's sensitivity (default 1 256, the compressors run's)")
    p.add_argument("--resume", default=None, help="a frontier JSON to continue (its points are kept, it is rewritten)")
    p.add_argument("--merge", nargs="+", default=[], metavar="FILE", help="with --resume: add the points (and "
                   "cross-check / caveat) of other frontier JSONs that FILE lacks, then measure nothing already there")
    p.add_argument("--workdir", default=None, help="GGUFs and saved models (default <model cache>/frontier/<model>)")
    p.add_argument("--cross-check", nargs="*", default=None, metavar="TYPE", help="llama-perplexity's protocol on "
                   "these llama.cpp files (no TYPE: f32 q8_0 q4_k_m)")
    p.add_argument("--caveat", action="store_true", help="measure how much a 4-bit grid flatters requantization")
    p.add_argument("--speed", action="store_true", help="the speed phase only (every point of --resume with a file)")
    p.add_argument("--repeats", type=int, default=3, help="--speed: timed generations per point and thread count")
    p.add_argument("--points", nargs="+", default=None, metavar="NAME", help="--speed: only these points (each a "
                   "label, e.g. 'llama.cpp Q4_K_M' 'SVD-LLM v1 keep 0.8 int8', or an id; case-insensitive)")
    p.add_argument("--longctx", action="store_true", help="only --points (default eval.long_context.DEFAULT_POINTS) "
                   "with their KV cache at --prompt-len tokens (default 8000), --gen-len continuation")
    add_budget(p, [0.25, 0.125], "--longctx: the composed cache's budgets")
    p.add_argument("--graph", default="whole-step", choices=("whole-step", "none"),
                   help="--speed: our engine's decode step (as in bench peer)")


def _none(v):                     # --quants none / --families none: no such point
    return [] if v == ["none"] else v


def factor_weights(bits, gptq: bool = False) -> tuple[str, ...]:
    """``--factor-bits`` (``--gptq``) -> our storages: bf16, then ``int<b>`` / ``mixed`` (``-gptq``); 0: none."""
    from ...eval.frontier import FACTOR_WEIGHTS

    out = ("bf16",) + tuple(dict.fromkeys((b if b == "mixed" else f"int{b}") + "-gptq" * gptq for b in bits if b))
    if bad := [w for w in out[1:] if w not in FACTOR_WEIGHTS]:
        raise SystemExit(f"error: --factor-bits: {bad} (ours: {sorted(FACTOR_WEIGHTS)})")
    return out


def workdir(a) -> Path:
    from ... import models

    return Path(a.workdir) if a.workdir else models.default_cache_dir() / "frontier" / Path(a.model).name


def quality(a, res: dict, write) -> dict:
    """The quality phase: adds every missing point to ``res["points"]`` (``write(res)`` after each)."""
    import torch

    from ... import models
    from ...eval.frontier import cross_check, llamacpp_points, lowrank_points
    from ...eval.quality import QualityConfig, eval_tokens
    from ..options import one

    seq = one(a.prompt_len, "--prompt-len") or 2048
    threads = one(a.threads, "--threads") or torch.get_num_threads()
    torch.manual_seed(0)
    model, tok = models.load(a.model)
    ids = eval_tokens(model, tok, QualityConfig(model=a.model, seq_len=seq, max_windows=a.windows))
    res["protocol"] = {"model": a.model, "eval": f"WikiText-2 test, first {a.windows} windows of {seq} tokens"
                       if tok is not None else f"{a.windows} windows of {seq} random tokens", "seq_len": seq,
                       "windows": a.windows, "calibration": f"WikiText-2 valid, {a.calib_samples} x {a.calib_len} "
                       "tokens, seed 0", "asvd_sensitivity_tokens": a.asvd_calib, "threads": threads,
                       "ours": "fp32 compression, weights rounded to bf16, forward in fp32",
                       "llama.cpp": "our dense weights written as F32 / BF16 GGUFs, quantized by llama_model_quantize; "
                                    "logits of every position, f32 KV cache, each window from an empty context"}
    done = {p["id"] for p in res["points"]}

    def add(p):
        res["points"].append(p)
        write(res)

    wd = workdir(a)
    for rt, types in (("llama.cpp", _none(a.quants)), ("ik_llama.cpp", a.ik)):
        llamacpp_points(model, ids, wd, types, seq, a.windows, threads, done, add, runtime=rt)
    fams = _none(a.families)
    if fams or not a.no_dense:
        lowrank_points(model, tok, ids, fams, tuple(a.keep), seq_len=seq, windows=a.windows,
                       calib_samples=a.calib_samples, calib_len=a.calib_len, asvd_calib=tuple(a.asvd_calib),
                       done=done | ({"lowrank_lib:dense:bf16"} if a.no_dense else set()), on_point=add,
                       save_dir=wd / "models", weights=factor_weights(a.factor_bits, a.gptq), factor_group=a.factor_group)
    if a.cross_check is not None:
        res["cross_check"] = cross_check(model, tok, wd, threads, tuple(a.cross_check or ("f32", "q8_0", "q4_k_m")))
        write(res)
    return res


# --------------------------------------------------------------------------- speed
def speed_unit(point: dict, prompt_len: int, gen_len: int, threads: list[int], repeats: int, graph: str = "whole-step",
               seed: int = 0) -> dict:
    """(A child.) One point's decode ms/token at every thread count (the one decode loop, :class:`Timed`)."""
    import torch

    from ...host import copy_bandwidth, read_bandwidth
    from ..peer_base import Timed, engine, llama_runner

    S = prompt_len + gen_len
    torch.set_num_threads(threads[0])
    if point["system"] != "lowrank_lib":           # llama.cpp or ik_llama.cpp (its cache bf16: it has no f32 one)
        runner = llama_runner(point["file"], "bf16" if point["weights"] != "f32" else "fp32", S, threads[0], True,
                              "ik_llamacpp" if point["system"] == "ik_llama.cpp" else "llamacpp_dense")
        vocab, system = runner.n_vocab, "llamacpp_dense"
    else:
        model = torch.load(point["file"], weights_only=False)
        vocab, runner = model.config.vocab_size, engine(model, "bf16", S, graph, "exact")
        system = "lowrank_lib_dense" if point["method"] == "dense" else "lowrank_lib_lowrank"
    ids = torch.randint(0, vocab, (1, prompt_len), generator=torch.Generator().manual_seed(seed))
    t, rows = Timed(system, runner), {}
    for th in threads:
        torch.set_num_threads(th)
        if t.llama:
            runner.set_threads(th)
        else:
            runner.invalidate()
            torch._dynamo.reset()
        bw, rbw = copy_bandwidth("cpu"), read_bandwidth("cpu")
        t.warm(ids, min(8, gen_len))
        for _ in range(repeats):
            t.generate(ids, gen_len)
        r = t.row(th, bw, rbw)
        rows[str(th)] = {"ms_per_token": r["decode_ms_per_token"], "iqr_ms": r["decode_iqr_ms"],
                         "prefill_ms": r["prefill_ms"], "steps": r["decode_steps"],
                         "timed_bytes_per_token": r["weight_bytes_per_token"], "copy_gbs": bw}
    if t.llama:
        runner.close()
    return rows


def speed(a, res: dict, write) -> dict:
    """The speed phase: one sitting (``eval.frontier.open_sitting``) that times its reference point (llama.cpp
    Q4_K_M) first, then every chosen point, each in its own child."""
    from ..child import run_child
    from ..options import one
    from ...eval.frontier import open_sitting, record_speed, select_points
    from ...host import load_average

    prompt = one(a.prompt_len, "--prompt-len") or 512
    threads = a.threads or [1, 2]
    try:
        chosen = select_points(res["points"], a.points)
    except ValueError as e:
        raise SystemExit(f"error: --points: {e}") from None
    sit = open_sitting(res, a.command_line, prompt_len=prompt, gen_len=one(a.gen_len, "--gen-len"), threads=threads,
                       repeats=a.repeats, graph=a.graph, load_average_start=load_average())
    ref = [p for p in res["points"] if p["id"] == sit["reference"] and p not in chosen]
    for p in ref + chosen:
        if not p.get("file") or not Path(p["file"]).exists():
            print(f"[frontier] {p['id']}: no file, no speed", flush=True)
            continue
        r = run_child("lowrank_lib.bench.commands.frontier:speed_unit", point=p, prompt_len=prompt,
                      gen_len=one(a.gen_len, "--gen-len"), threads=threads, repeats=a.repeats, graph=a.graph)
        record_speed(sit, p, r["result"], r["peak_rss"], r["wall_s"], own=p not in ref)
        ms = ", ".join(f"{th} t {v['ms_per_token']:.2f} ms" for th, v in r["result"].items())
        print(f"[frontier] {p['id']}: {ms}, peak RSS {r['peak_rss'] / 1e6:.0f} MB", flush=True)
        write(res)
    sit["load_average_end"] = load_average()
    return res


def run(a) -> int:
    from ...eval.frontier import caveat_runs, format_table, make_label, merge_runs
    from ..options import one
    from ..results import ResultFiles

    if a.resume:
        path = Path(a.resume)
        res = json.loads(path.read_text())
        md = path.with_suffix(".md")
        for p in res["points"]:                 # points of files older than labels
            p.setdefault("label", make_label(p))
    else:
        if a.speed or a.longctx:
            raise SystemExit("error: --speed / --longctx measure the points of a quality run: give it --resume FILE")
        files = ResultFiles(a.out, "frontier", Path(a.model).name)
        path, md, res = files.path, files.companion(".md"), {"points": []}

    def write(r: dict) -> None:
        r["commands"] = list(dict.fromkeys([*r.get("commands", []), a.command_line]))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(r, indent=1))
        md.write_text(format_table(r["points"], sittings=r.get("sittings", [])) + "\n")

    for other in a.merge:
        if not a.resume:
            raise SystemExit("error: --merge adds points into the file of --resume")
        merge_runs(res, json.loads(Path(other).read_text()))
        write(res)
    if a.points and not (a.speed or a.longctx):
        raise SystemExit("error: --points chooses the points --speed or --longctx measures")
    if a.longctx:
        from ...eval.long_context import DEFAULT_POINTS, long_context_table, measure
        try:
            measure(res, a.model, workdir(a), one(a.prompt_len, "--prompt-len") or 8000, a.points or DEFAULT_POINTS,
                    cont=one(a.gen_len, "--gen-len"), windows=a.windows, budgets=tuple(a.budget), threads=one(a.threads, "--threads") or 1,
                    on_point=lambda p: write(res))
        except ValueError as e:             # a name that is no point, a file of another model
            raise SystemExit(f"error: {e}") from None
        print(long_context_table(res["long_context"]["points"]))
    elif a.speed:
        speed(a, res, write)
    else:
        quality(a, res, write)
        if a.caveat:
            res["caveat"] = caveat_runs()
            write(res)
    write(res)
    print(format_table(res["points"], sittings=res.get("sittings", [])))
    print(f"wrote {path}")
    return 0
