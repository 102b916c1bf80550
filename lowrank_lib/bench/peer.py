"""Peer benchmark: llama.cpp on the dense model vs lowrank_lib (dense and low-rank), side by side.

    python -m lowrank_lib.bench peer --threads 1 2 --dtypes fp32 bf16 --repeats 3      # SmolLM2, in one process
    python -m lowrank_lib.bench peer --shape llama3.2-1b                               # see bench/peer_scale.py

One process, one prompt, interleaved repeats: per thread count, every system runs one whole
generation (prompt 512, 64 new greedy tokens) in turn, ``repeats`` times, with the order rotated
each repeat, so drift on a shared machine hits all alike. Systems (``rows[].system``):

=======================  ================================================================================
``llamacpp_dense``       llama.cpp (``llama-cpp-python``, extra ``peer``) on an F32 / BF16 GGUF of the SAME
                         cached weights (``gguf_export.peer_ggufs``: dequantised from the Q4_1 file our cache
                         came from, verified tensor by tensor), KV cache at the model dtype
``lowrank_lib_dense``    our Engine on the dense model
``lowrank_lib_lowrank``  our Engine on the plain-SVD keep-``keep`` factors (as ``bench decode`` builds them)
=======================  ================================================================================

Each of our two systems runs once per LM head of ``lm_heads`` (``rows[].lm_head``: ``exact``, and
``certified``: ``EngineConfig(lm_head="certified")``, the same greedy tokens from a fraction of the head's
bytes; its row holds the head's path counts and ``weight_bytes_per_token`` counts the bytes it read on
average).

All three run through ``runtime.run_generation`` (the one decode loop): decode ms/token is the
median over every decode step of every repeat (the step that feeds one token and returns its
logits); prefill ms the median prompt time. For llama.cpp the bare ``Llama.eval`` of each token
(``eval_ms_per_token``) and llama.cpp's own perf counters (``perf_eval_ms_per_token``) are
reported too, and at 1 thread the calling thread's CPU time per step (``decode_cpu_ms_per_token``,
:class:`CpuClocked`: what an idle core would give, robust to other jobs on a shared machine). Before any timing, llama.cpp and our dense engine must produce the same 64 greedy
tokens from the same prompt tokens in fp32 (``equivalence``: the first divergence and the logit
margins there if not). Copy bandwidth (``decode.copy_bandwidth``) is measured at each thread count
in the same run; ``roofline_x`` = decode time / (weight bytes / copy bandwidth). Compile time of
the engine (inductor) is reported apart (``compile_s``), never in decode or prefill time.

Writes ``<out>/peer_cpu.json`` (``peer_cpu_2.json``, ... if it exists: never overwritten; through
:class:`~lowrank_lib.bench.results.ResultFiles`, with the table as ``.txt``) and prints the table.

``--shape llama3.2-1b|llama2-7b`` runs the same comparison at those geometries, one system per process
(:mod:`lowrank_lib.bench.peer_scale`). The options are the bench vocabulary (:mod:`lowrank_lib.bench.options`):
``--prompt-len``, ``--gen-len``, lists space-separated (``--threads 1 2``; a comma value still splits).
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

SYSTEMS = ("llamacpp_dense", "lowrank_lib_dense", "lowrank_lib_lowrank")
#: llama.cpp KV cache type for each model dtype: the same bytes our engine's cache holds
KV_FOR_DTYPE = {"fp32": "f32", "bf16": "bf16"}
ROW_KEYS = ("system", "dtype", "threads", "decode_ms_per_token", "prefill_ms", "weight_bytes_per_token")
LM_HEADS = ("exact", "certified")
#: the targets (1 thread, same dtype): key -> (bound, ">=" or "<=", dtypes it applies to, issue)
TARGETS = {"lowrank_speedup_vs_llamacpp": (1.4, ">=", ("fp32", "bf16"), 12),
           "dense_ratio_vs_llamacpp": (1.0, "<=", ("fp32", "bf16"), 22),
           "lowrank_roofline_x": (1.2, "<=", ("fp32", "bf16"), 22),
           "certified_speedup_vs_llamacpp": (2.3, ">=", ("bf16",), 22)}


@dataclass
class PeerConfig:
    model: str = "smollm2"
    keep: float = 0.5
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    threads: tuple[int, ...] = (1, 2)
    prompt_len: int = 512
    gen_len: int = 64
    repeats: int = 3
    systems: tuple[str, ...] = SYSTEMS
    lm_heads: tuple[str, ...] = LM_HEADS  # our systems run once per LM head (EngineConfig.lm_head)
    graph: str = "whole-step"            # our engine's decode step: compiled (CPU "graph") or "none"
    llama_flash_attn: str = "auto"       # "on" | "off" | "auto" (the faster of the two in a short probe)
    prompt: str = "wikitext"             # "wikitext" (a test-split window) or "random" token ids
    audit_prompts: int = 20              # the certified head's audit: fidelity prompts x greedy tokens (0 = none)
    audit_tokens: int = 64
    seed: int = 0
    out: str = "benchmarks/results"
    note: str = ""
    extra: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- inputs
def prompt_ids(tok, vocab_size: int, n: int, source: str = "wikitext", seed: int = 0) -> torch.Tensor:
    """[1, n] prompt token ids: a WikiText-2 test window (real text, greedy decoding is meaningful)
    or seeded random ids (models without a tokenizer)."""
    if source == "wikitext" and tok is not None:
        from .. import data

        ids = data.tokens(tok, "test")
        start = int(torch.randint(0, ids.numel() - n, (1,), generator=torch.Generator().manual_seed(seed)))
        return ids[start:start + n][None].clone()
    return torch.randint(0, vocab_size, (1, n), generator=torch.Generator().manual_seed(seed))


def gguf_bytes_per_token(path) -> int:
    """Bytes of the tensors one llama.cpp decode step reads: every tensor of the file but the input
    embedding when a separate ``output.weight`` exists (one row is read); with a tied head the
    embedding table IS the output matrix and counts in full (as our engine's lm_head does)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    names = {t.name for t in r.tensors}
    return sum(int(t.n_bytes) for t in r.tensors if not (t.name == "token_embd.weight" and "output.weight" in names))


# --------------------------------------------------------------------------- the fp32 equivalence check
def compare_greedy(a, b) -> dict:
    """Two GenerateOutputs (with logits) of the same prompt -> equality of tokens and where they part."""
    ta, tb = a.tokens[0], b.tokens[0]
    n = min(len(ta), len(tb))
    diff = (ta[:n] != tb[:n]).nonzero()
    first = int(diff[0]) if len(diff) else None
    dl = [float((x - y).abs().max()) for x, y in zip(a.logits, b.logits)]
    res = {"tokens_equal": first is None and len(ta) == len(tb), "n_tokens": n,
           "first_divergence": first, "n_equal_before_divergence": n if first is None else first,
           "max_abs_logit_diff": max(dl), "prefill_abs_logit_diff": dl[0],
           "logit_scale": float(b.logits[0].abs().max())}
    if first is not None:
        def margin(lg):
            top = lg[0].topk(2).values
            return float(top[0] - top[1])

        res.update(tokens_a=ta[first].item(), tokens_b=tb[first].item(),
                   top2_margin_a=margin(a.logits[first]), top2_margin_b=margin(b.logits[first]))
    return res


# --------------------------------------------------------------------------- one benchmark run
class CpuClocked:
    """A runner wrapper that also records the calling thread's CPU seconds of every ``step``.

    At 1 thread every runner computes on the calling thread, so this is the wall time an idle core
    would give: robust to other processes taking turns on a shared machine (not to their memory
    traffic). Everything else is delegated to the wrapped runner.
    """

    def __init__(self, runner):
        self.runner, self.cpu_s = runner, []

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def step(self, tokens):
        c0 = time.thread_time()
        y = self.runner.step(tokens)
        self.cpu_s.append(time.thread_time() - c0)
        return y


def median_ms(xs) -> float:
    return 1e3 * statistics.median(xs) if xs else float("nan")


def decode_stats(step_s: list[float]) -> dict:
    """A row's decode fields from every timed step (seconds): the median (``decode_ms_per_token``) and quartiles
    (``decode_iqr_ms``) by :func:`lowrank_lib.bench.timing.summary`, p10 / p90, the step count."""
    from .timing import summary

    st = summary(step_s)
    return {"decode_ms_per_token": st["median_ms"], "decode_iqr_ms": [st["q1_ms"], st["q3_ms"]],
            "decode_ms_p10": 1e3 * quantile(step_s, 0.1), "decode_ms_p90": 1e3 * quantile(step_s, 0.9),
            "decode_steps": st["n"]}


def _engine(model, dtype, cfg: PeerConfig, lm_head: str = "exact"):
    from ..runtime import Engine, EngineConfig

    return Engine(model, EngineConfig(max_batch=1, max_seq_len=cfg.prompt_len + cfg.gen_len, dtype=dtype,
                                      graph=cfg.graph, lm_head=lm_head))


def _llama(path, dtype: str, threads: int, cfg: PeerConfig, fa: bool):
    from .llamacpp import LlamaCppRunner

    return LlamaCppRunner(path, n_ctx=cfg.prompt_len + cfg.gen_len, threads=threads, kv_type=KV_FOR_DTYPE[dtype],
                          flash_attn=fa)


def _probe_flash_attn(path, dtype, threads, ids, cfg, n: int = 16) -> tuple[bool, dict]:
    """llama.cpp's fused attention on and off, a short generation each (twice): the faster wins."""
    from ..runtime import run_generation

    ms = {}
    for fa in (True, False):
        r = _llama(path, dtype, threads, cfg, fa)
        run_generation(r, ids, 4)
        ms[fa] = min(run_generation(r, ids, n).decode_ms_per_token for _ in range(2))
        r.close()
    return ms[True] <= ms[False], {"on_ms": ms[True], "off_ms": ms[False]}


def run_peer(cfg: PeerConfig, progress: bool = True, log=print) -> dict:
    """Run the whole benchmark (see the module docstring); returns the result dict."""
    from ..runtime import run_generation
    from ..runtime.config import parse_dtype
    from .decode import copy_bandwidth, read_bandwidth
    from .llamacpp import available, version
    from .models import load_bench_models
    from .results import load_average
    from .timing import interleaved

    want_llama = "llamacpp_dense" in cfg.systems
    ok, why = available()
    if want_llama and not ok:
        raise SystemExit(f"peer benchmark: {why}")
    dense, comp, tok = load_bench_models(cfg.model, "svd", cfg.keep)
    ids = prompt_ids(tok, dense.config.vocab_size, cfg.prompt_len, cfg.prompt, cfg.seed)
    ggufs = {}
    if want_llama:
        from .gguf_export import peer_ggufs, write_hf_gguf

        if cfg.model == "smollm2":
            ggufs = peer_ggufs(cfg.dtypes, log=log)
        else:             # any other model: written from its HF weights (the tiny models of the tests)
            from .. import models

            d = models.default_cache_dir() / "peer-gguf" / Path(cfg.model).name
            ggufs = {dt: write_hf_gguf(dense, d / f"model.{dt}.gguf", {"fp32": "F32", "bf16": "BF16"}[dt])
                     for dt in cfg.dtypes}
    res = {"config": asdict(cfg), "command": None,
           "machine": {"cpu": cpu_name(), "cores": nproc(),
                       "torch": torch.__version__, "llama_cpp_python": version(), "python": platform.python_version()},
           "prompt_tokens": ids.shape[1], "rows": [], "copy_bandwidth_GBps_by_threads": {},
           "read_bandwidth_GBps_by_threads": {},
           "load_average": {"start": load_average()},
           "note": cfg.note, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}

    # 1. same work: llama.cpp and our dense engine give the same greedy tokens in fp32 (1 thread)
    fa_choice = {}
    if want_llama and "fp32" in ggufs:
        torch.set_num_threads(1)
        fa = _resolve_fa(cfg, ggufs["fp32"], "fp32", 1, ids, fa_choice)
        r = _llama(ggufs["fp32"], "fp32", 1, cfg, fa)
        e = _engine(dense, torch.float32, cfg)
        a = run_generation(r, ids, cfg.gen_len, return_logits=True)
        b = run_generation(e, ids, cfg.gen_len, return_logits=True)
        res["equivalence"] = {"dtype": "fp32", "threads": 1, "a": "llamacpp_dense", "b": "lowrank_lib_dense",
                              "llama_flash_attn": fa, **compare_greedy(a, b)}
        r.close()
        del e
        eq = res["equivalence"]
        log("[peer] fp32 greedy tokens, llama.cpp vs lowrank_lib dense: "
            + ("EQUAL" if eq["tokens_equal"] else f"DIVERGE at token {eq['first_divergence']}")
            + f" ({eq['n_tokens']} tokens; max |logit diff| {eq['max_abs_logit_diff']:.3g})")
        torch._dynamo.reset()

    # 1b. the certified head's audit: the exact head's greedy tokens on the fidelity prompts, every dtype
    if "certified" in cfg.lm_heads and tok is not None and cfg.audit_prompts:
        torch.set_num_threads(cfg.threads[0])
        res["certified_audit"] = {dt: certified_audit(comp, tok, parse_dtype(dt), cfg.audit_prompts, cfg.audit_tokens,
                                                      progress) for dt in cfg.dtypes}
        for dt, a in res["certified_audit"].items():
            log(f"[peer] certified head audit, keep {cfg.keep} {dt}: {a['identical_prompts']}/{a['prompts']} prompts "
                f"x {a['tokens']} tokens identical to the exact head; {a['lm_head']['head_bytes_fraction']:.3f} of the "
                f"head's bytes read, {a['lm_head']['fallback_calls']} fallbacks in {a['lm_head']['calls']} calls")

    # 2. timing, one thread count at a time (the two runtimes never run at once)
    for th in cfg.threads:
        torch.set_num_threads(th)
        bws = [copy_bandwidth(torch.device("cpu"))]
        rbws = [read_bandwidth(torch.device("cpu"))]
        runners = {}
        for dt in cfg.dtypes:
            tdt = parse_dtype(dt)
            for s in cfg.systems:
                if s == "llamacpp_dense":
                    fa = _resolve_fa(cfg, ggufs[dt], dt, th, ids, fa_choice)
                    runners[(s, dt, "exact")] = CpuClocked(_llama(ggufs[dt], dt, th, cfg, fa))
                    continue
                for head in cfg.lm_heads:
                    runners[(s, dt, head)] = CpuClocked(_engine(dense if s == "lowrank_lib_dense" else comp, tdt, cfg,
                                                                head))
        compile_s = {}
        for k, r in runners.items():          # warm-up; our engine compiles its step here (timed apart)
            t0 = time.perf_counter()
            run_generation(r, ids, min(4, cfg.gen_len))
            compile_s[k] = (getattr(r.runner, "capture_s", 0.0), time.perf_counter() - t0)
            r.cpu_s.clear()
            if k[2] == "certified":
                r.runner.lm_head.reset_stats()    # count the timed generations only
        steps = {k: [] for k in runners}
        pre = {k: [] for k in runners}
        evals = {k: [] for k in runners}
        perf = {k: [] for k in runners}

        def generation(k, r):
            """One whole generation of system ``k``; its per-step times are the samples (not the call's time)."""
            o = run_generation(r, ids, cfg.gen_len)
            steps[k] += o.step_s
            pre[k].append(o.prefill_s)
            if k[0] == "llamacpp_dense":
                evals[k] += r.eval_s
                perf[k].append(r.perf())

        bar = tqdm(total=cfg.repeats, desc=f"peer bench, {th} thread(s), rounds", disable=not progress)
        interleaved({k: (lambda k=k, r=r: generation(k, r)) for k, r in runners.items()}, rounds=cfg.repeats,
                    progress=lambda _: bar.update(1))           # rotated order per round (bench/timing.py)
        bar.close()
        bws.append(copy_bandwidth(torch.device("cpu")))
        rbws.append(read_bandwidth(torch.device("cpu")))
        res["load_average"][f"after_{th}_threads"] = load_average()    # what else ran shows here
        bw, rbw = statistics.median(bws), statistics.median(rbws)
        res["copy_bandwidth_GBps_by_threads"][str(th)] = bw
        res["read_bandwidth_GBps_by_threads"][str(th)] = rbw
        for (s, dt, head), r in runners.items():
            k = (s, dt, head)
            dec = decode_stats(steps[k])
            ms = dec["decode_ms_per_token"]
            wb = gguf_bytes_per_token(ggufs[dt]) if s == "llamacpp_dense" else r.weight_bytes_per_token()
            row = {"system": s, "dtype": dt, "threads": th, "lm_head": head, **dec,
                   "prefill_ms": median_ms(pre[k]), "weight_bytes_per_token": wb, "achieved_GBps": wb / (ms / 1e3) / 1e9,
                   "roofline_ms": wb / (bw * 1e9) * 1e3, "roofline_x": ms / 1e3 / (wb / (bw * 1e9)),
                   "read_gbs": rbw, "read_roofline_x": ms / 1e3 / (wb / (rbw * 1e9)),
                   "decode_cpu_ms_per_token": median_ms(r.cpu_s) if th == 1 else None}
            if s == "llamacpp_dense":
                row.update(eval_ms_per_token=median_ms(evals[k]),
                           perf_eval_ms_per_token=statistics.median(p["eval_ms_per_token"] for p in perf[k]),
                           perf_prefill_ms=statistics.median(p["t_p_eval_ms"] for p in perf[k]),
                           info={**r.report(), "flash_attn_probe": fa_choice.get((dt, th), {}).get("probe")})
                r.close()
            else:
                info = r.report()         # which kernels ran and why (the engine's backend registries)
                row.update(compile_s=compile_s[k][0], warmup_s=compile_s[k][1], gemv=info["gemv"],
                           gemv_reason=info["gemv_reason"], attention=info["backend"],
                           attention_reason=info["backend_reason"], compiles=info["compiles"],
                           lm_head_report=info["lm_head"], info=info)
            res["rows"].append(row)
        del runners
        torch._dynamo.reset()           # the next thread count compiles afresh (inductor fixes its thread count)
    res["copy_bandwidth_GBps"] = res["copy_bandwidth_GBps_by_threads"].get("1", next(
        iter(res["copy_bandwidth_GBps_by_threads"].values()), float("nan")))
    res["comparisons"] = comparisons(res["rows"])
    res["targets"] = targets(res["comparisons"])
    return res


def certified_audit(model, tok, dtype, n_prompts: int = 20, n_tokens: int = 64, progress: bool = True) -> dict:
    """Greedy tokens of the certified head against the exact head (same engine otherwise, eager) on the
    fidelity audit's prompts (``eval.fidelity.PROMPTS``): prompts whose ``n_tokens`` tokens are identical,
    the first difference if any, and the certified head's path counts over the whole audit."""
    from ..eval.fidelity import PROMPTS
    from ..runtime import Engine, EngineConfig, run_generation

    enc = [tok(p, return_tensors="pt").input_ids for p in PROMPTS[:n_prompts]]
    S = max(e.shape[1] for e in enc) + n_tokens
    exact = Engine(model, EngineConfig(max_seq_len=S, dtype=dtype))
    cert = Engine(model, EngineConfig(max_seq_len=S, dtype=dtype, lm_head="certified"))
    same, first = 0, []
    for i, ids in enumerate(tqdm(enc, desc=f"certified head audit {dtype}", disable=not progress)):
        a, b = run_generation(exact, ids, n_tokens).tokens[0], run_generation(cert, ids, n_tokens).tokens[0]
        same += bool(torch.equal(a, b))
        if not torch.equal(a, b):
            first.append({"prompt": i, "position": int((a != b).nonzero()[0])})
    return {"prompts": len(enc), "tokens": n_tokens, "identical_prompts": same, "differences": first,
            "lm_head": cert.report()["lm_head"]}


def _resolve_fa(cfg, path, dt, th, ids, cache: dict) -> bool:
    if cfg.llama_flash_attn in ("on", "off"):
        return cfg.llama_flash_attn == "on"
    if (dt, th) not in cache:
        fa, probe = _probe_flash_attn(path, dt, th, ids, cfg)
        cache[(dt, th)] = {"fa": fa, "probe": probe}
    return cache[(dt, th)]["fa"]


def quantile(xs, q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def nproc() -> int:
    import os

    return os.cpu_count() or 0


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------- summaries
def comparisons(rows: list[dict]) -> list[dict]:
    """Per (dtype, threads): our systems (exact head; certified where run) against llama.cpp dense and their rooflines."""
    by = {(r["dtype"], r["threads"], r["system"], r.get("lm_head", "exact")): r for r in rows}
    out = []
    for dt, th in sorted({(r["dtype"], r["threads"]) for r in rows}, key=lambda k: (k[1], k[0])):
        ll, de, lr = (by.get((dt, th, s, "exact")) for s in SYSTEMS)
        cde, clr = (by.get((dt, th, s, "certified")) for s in SYSTEMS[1:])
        c = {"dtype": dt, "threads": th}
        if ll and lr:
            c["lowrank_speedup_vs_llamacpp"] = ll["decode_ms_per_token"] / lr["decode_ms_per_token"]
            c["lowrank_prefill_ratio_vs_llamacpp"] = lr["prefill_ms"] / ll["prefill_ms"]
        if ll and de:
            c["dense_ratio_vs_llamacpp"] = de["decode_ms_per_token"] / ll["decode_ms_per_token"]
            c["dense_prefill_ratio_vs_llamacpp"] = de["prefill_ms"] / ll["prefill_ms"]
        if lr:
            c["lowrank_roofline_x"] = lr["roofline_x"]
            c["lowrank_bytes_vs_dense"] = (lr["weight_bytes_per_token"] / de["weight_bytes_per_token"]) if de else None
        if ll and clr:
            c["certified_speedup_vs_llamacpp"] = ll["decode_ms_per_token"] / clr["decode_ms_per_token"]
        if clr:
            c["certified_roofline_x"] = clr["roofline_x"]
            c["certified_head_bytes_fraction"] = clr.get("lm_head_report", {}).get("head_bytes_fraction")
            if lr:
                c["certified_speedup_vs_exact_head"] = lr["decode_ms_per_token"] / clr["decode_ms_per_token"]
        if ll and cde:
            c["dense_certified_ratio_vs_llamacpp"] = cde["decode_ms_per_token"] / ll["decode_ms_per_token"]
        if ll:
            c["llamacpp_roofline_x"] = ll["roofline_x"]
        out.append(c)
    return out


def targets(comps: list[dict]) -> list[dict]:
    """The targets of :data:`TARGETS` at 1 thread: measured ratio, bound, the issue, and whether it is met."""
    out = []
    for c in comps:
        if c["threads"] != 1:
            continue
        for key, (bound, op, dtypes, issue) in TARGETS.items():
            if key not in c or c["dtype"] not in dtypes:
                continue
            v = c[key]
            out.append({"dtype": c["dtype"], "threads": 1, "target": key, "bound": bound, "op": op, "issue": issue,
                        "measured": v, "met": v >= bound if op == ">=" else v <= bound})
    return out


def format_table(res: dict) -> str:
    lines = ["system | lm head | dtype | threads | decode ms/tok | cpu ms/tok | prefill ms | MB/tok | GB/s | x roofline",
             "---|---|---|---|---|---|---|---|---|---"]
    for r in sorted(res["rows"], key=lambda r: (r["threads"], r["dtype"], SYSTEMS.index(r["system"]),
                                                r.get("lm_head", "exact"))):
        cpu = r.get("decode_cpu_ms_per_token")
        lines.append(f"{r['system']} | {r.get('lm_head', 'exact')} | {r['dtype']} | {r['threads']} | "
                     f"{r['decode_ms_per_token']:.2f} | "
                     f"{'-' if cpu is None else f'{cpu:.2f}'} | "
                     f"{r['prefill_ms']:.1f} | {r['weight_bytes_per_token'] / 1e6:.1f} | {r['achieved_GBps']:.1f} | "
                     f"{r['roofline_x']:.2f}")
    bw = ", ".join(f"{t} thread(s) {v:.1f}" for t, v in res["copy_bandwidth_GBps_by_threads"].items())
    lines.append(f"\ncopy bandwidth GB/s: {bw}; {res['machine']['cpu']}, {res['machine']['cores']} cores")
    if res.get("read_bandwidth_GBps_by_threads"):
        rb = ", ".join(f"{t} thread(s) {v:.1f}" for t, v in res["read_bandwidth_GBps_by_threads"].items())
        lines.append(f"read-only stream bandwidth GB/s (the best a GEMV can stream): {rb}")
    for dt, a in res.get("certified_audit", {}).items():
        lines.append(f"certified head audit ({dt}): {a['identical_prompts']}/{a['prompts']} prompts x {a['tokens']} "
                     f"greedy tokens identical to the exact head; {a['lm_head']['head_bytes_fraction']:.3f} of the head's "
                     f"bytes read per token, {a['lm_head']['fallback_calls']} fallbacks in {a['lm_head']['calls']} calls")
    eq = res.get("equivalence")
    if eq:
        lines.append("fp32 greedy tokens llama.cpp vs lowrank_lib dense: "
                     + ("equal" if eq["tokens_equal"] else f"diverge at {eq['first_divergence']}")
                     + f" over {eq['n_tokens']} (max |logit diff| {eq['max_abs_logit_diff']:.3g})")
    for r in res["rows"]:
        h = r.get("lm_head_report") or {}
        if h.get("mode") == "certified":
            lines.append(f"certified head, {r['system']} {r['dtype']} {r['threads']} thread(s): {h['calls']} calls, "
                         f"{h['fallback_calls']} fallbacks, {h['candidates_per_row']:.1f} candidate rows, "
                         f"{h['exact_rows_per_call']:.0f} exact rows per call, {h['head_bytes_fraction']:.3f} of the "
                         f"head's bytes read")
    for t in res.get("targets", []):
        lines.append(f"target {t['target']} ({t['dtype']}, 1 thread, issue {t.get('issue', 12)}): {t['measured']:.2f} "
                     f"vs {t.get('op', '<=')} {t['bound']}: " + ("met" if t["met"] else "NOT met"))
    return "\n".join(lines)


#: one look per system and dtype in every peer figure
_MARKER = {"llamacpp_dense": "s", "lowrank_lib_dense": "o", "lowrank_lib_lowrank": "*"}
_COLOR = {"fp32": "tab:blue", "bf16": "tab:orange"}


def plot_decode_vs_bytes(res: dict, threads: int = 1, ax=None):
    """Decode ms/token against weight bytes per token, one marker per (system, dtype) at ``threads``;
    llama.cpp dense as the horizontal reference line of each dtype, and the copy-bandwidth roofline
    (bytes / bandwidth) as the diagonal. Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if r["threads"] == threads]
    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4.2))
    for r in rows:
        cert = r.get("lm_head") == "certified"
        ax.plot(r["weight_bytes_per_token"] / 1e6, r["decode_ms_per_token"], "P" if cert else _MARKER[r["system"]],
                color=_COLOR.get(r["dtype"], "gray"), ms=11 if r["system"] == "lowrank_lib_lowrank" else 8,
                label=f"{r['system']} {r['dtype']}" + (" + certified head" if cert else ""))
        if r["system"] == "llamacpp_dense":
            ax.axhline(r["decode_ms_per_token"], color=_COLOR.get(r["dtype"], "gray"), ls="--", lw=1)
    bw = res["copy_bandwidth_GBps_by_threads"].get(str(threads))
    if bw and rows:
        xs = [0.0, max(r["weight_bytes_per_token"] for r in rows) / 1e6 * 1.05]
        ax.plot(xs, [x * 1e6 / (bw * 1e9) * 1e3 for x in xs], ":", color="k", lw=1,
                label=f"roofline (copy {bw:.0f} GB/s)")
    ax.set(xlabel="weight bytes per token (MB)", ylabel="decode ms/token", xlim=(0, None), ylim=(0, None),
           title=f"decode vs bytes, {threads} thread(s); dashed: llama.cpp dense")
    ax.legend(fontsize=7)
    return ax.figure


def plot_thread_scaling(res: dict, ax=None):
    """Decode ms/token against torch / llama.cpp threads, one line per (system, dtype), with each thread
    count's copy-bandwidth roofline of the low-rank bytes (dotted). Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(6.5, 4.2))
    threads = sorted({r["threads"] for r in res["rows"]})
    for (system, dtype) in sorted({(r["system"], r["dtype"]) for r in res["rows"]}):
        rows = sorted((r for r in res["rows"] if r["system"] == system and r["dtype"] == dtype
                       and r.get("lm_head", "exact") == "exact"), key=lambda r: r["threads"])
        ax.plot([r["threads"] for r in rows], [r["decode_ms_per_token"] for r in rows], marker=_MARKER[system],
                ls="--" if system == "llamacpp_dense" else "-", color=_COLOR.get(dtype, "gray"),
                label=f"{system} {dtype}")
        if system == "lowrank_lib_lowrank":
            bws = res["copy_bandwidth_GBps_by_threads"]
            ax.plot([r["threads"] for r in rows],
                    [r["weight_bytes_per_token"] / (bws[str(r["threads"])] * 1e9) * 1e3 for r in rows], ":",
                    color=_COLOR.get(dtype, "gray"), lw=1, label=f"roofline, low-rank bytes {dtype}")
    ax.set(xlabel="threads", ylabel="decode ms/token", xticks=threads, ylim=(0, None),
           title="thread scaling (dashed: llama.cpp dense; dotted: bytes / copy bandwidth)")
    ax.legend(fontsize=7)
    return ax.figure


def save_figures(res: dict, fig_dir) -> list[Path]:
    """``peer_decode_vs_bytes.png`` (1 thread, or the fewest run) and ``peer_thread_scaling.png`` in ``fig_dir``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir = Path(fig_dir)
    fig_dir.mkdir(parents=True, exist_ok=True)
    out = []
    for name, fig in (("peer_decode_vs_bytes", plot_decode_vs_bytes(res, threads=min(r["threads"] for r in res["rows"]))),
                      ("peer_thread_scaling", plot_thread_scaling(res))):
        path = fig_dir / f"{name}.png"
        fig.savefig(path, dpi=110, bbox_inches="tight")
        plt.close(fig)
        out.append(path)
    return out


def save(res: dict, out_dir, table: str | None = None) -> Path:
    """Write ``<out_dir>/peer_cpu.json`` (``peer_cpu_2.json``, ... : never overwritten) through the one writer."""
    from .results import ResultFiles

    return ResultFiles(out_dir, "peer_cpu").write(res, **({"txt": table} if table else {}))


# --------------------------------------------------------------------------- CLI
def add_arguments(p: argparse.ArgumentParser, out: bool = True) -> None:
    """The peer's options (the bench vocabulary, :mod:`lowrank_lib.bench.options`); ``out=False`` when the bench
    CLI already gives ``--out``."""
    from ..models import SHAPES
    from .options import add_gen_len, add_list, add_prompt_len

    d = PeerConfig()
    p.add_argument("--shape", default=None, choices=sorted(SHAPES),
                   help="random weights at this geometry, one system per process (bench/peer_scale.py)")
    p.add_argument("--model", default=d.model, help="smollm2 (default) or a tiny preset / local HF dir")
    add_list(p, "--keep", float, None, "keep ratio(s) of the low-rank system (SmolLM2: one, plain SVD, default "
             "0.5; --shape: random factors, default 0.5 0.8)")
    add_list(p, "--dtypes", str, None, "fp32 bf16 (SmolLM2 default fp32 bf16; --shape: default by shape)")
    add_list(p, "--threads", int, d.threads, "thread counts, each measured in the same run")
    add_prompt_len(p, d.prompt_len)
    add_gen_len(p, d.gen_len, "new greedy tokens per generation")
    p.add_argument("--repeats", type=int, default=d.repeats)
    add_list(p, "--systems", str, d.systems, f"of {SYSTEMS}")
    add_list(p, "--lm-heads", str, d.lm_heads, "LM heads of our systems (SmolLM2), of exact certified")
    add_list(p, "--quants", str, None, "--shape: llama.cpp quantizations (default q8_0 q4_k_m)")
    p.add_argument("--layers", type=int, default=None, help="--shape: a reduced layer count (dry runs)")
    p.add_argument("--cleanup", action="store_true", help="--shape: delete the generated weights and GGUFs after")
    p.add_argument("--graph", default=d.graph, choices=("whole-step", "none"), help="our engine's decode step")
    p.add_argument("--llama-flash-attn", default=None, choices=("auto", "on", "off"),
                   help="SmolLM2 default auto (the faster in a probe); --shape default on")
    p.add_argument("--prompt", default=d.prompt, choices=("wikitext", "random"))
    p.add_argument("--audit-prompts", type=int, default=d.audit_prompts,
                   help="SmolLM2: certified head vs exact head on this many fidelity prompts (0 = no audit)")
    p.add_argument("--audit-tokens", type=int, default=d.audit_tokens)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--note", default="", help="free text stored in the JSON (e.g. what else was running)")
    if out:
        p.add_argument("--out", default=d.out, help="output FOLDER (peer_cpu.json, never overwritten)")
    p.add_argument("--figures", default="figures", help="folder for the figures ('' = none)")
    p.add_argument("--replot", default=None, nargs="+", metavar="JSON",
                   help="only redraw the figures of committed results (peer_cpu*.json, or peer_scale*.json)")


def _check(values, allowed, what):
    bad = [v for v in values if v not in allowed]
    if bad:
        raise SystemExit(f"unknown {what} {bad}; choose from {tuple(allowed)}")
    return tuple(values)


def config_from_args(a) -> PeerConfig:
    systems = _check(a.systems, SYSTEMS, "systems")
    dtypes = _check(a.dtypes or PeerConfig.dtypes, KV_FOR_DTYPE, "dtypes")
    heads = _check(a.lm_heads, LM_HEADS, "LM heads")
    keep = a.keep or (PeerConfig.keep,)
    if len(keep) != 1:
        raise SystemExit(f"--keep {' '.join(map(str, keep))}: the SmolLM2 peer runs one keep (several need --shape)")
    return PeerConfig(model=a.model, keep=keep[0], dtypes=dtypes, threads=tuple(a.threads), prompt_len=a.prompt_len,
                      gen_len=a.gen_len, repeats=a.repeats, systems=systems, lm_heads=heads, graph=a.graph,
                      llama_flash_attn=a.llama_flash_attn or "auto", prompt=a.prompt, audit_prompts=a.audit_prompts,
                      audit_tokens=a.audit_tokens, seed=a.seed, out=a.out, note=a.note)


def scale_config_from_args(a):
    from .peer_scale import QUANTS, ScaleConfig

    return ScaleConfig(shape=a.shape, keeps=tuple(a.keep or (0.5, 0.8)),
                       dtypes=tuple(a.dtypes) if a.dtypes else None, threads=tuple(a.threads),
                       quants=tuple(a.quants or QUANTS), systems=tuple(a.systems), prompt_len=a.prompt_len,
                       gen_len=a.gen_len, repeats=a.repeats, layers=a.layers, graph=a.graph,
                       llama_flash_attn=a.llama_flash_attn or "on", seed=a.seed, out=a.out, cleanup=a.cleanup,
                       note=a.note)


def _command(a) -> str:
    import shlex

    return getattr(a, "command_line", None) or (
        "python -m lowrank_lib.bench.peer " + shlex.join(getattr(a, "_argv", None) or sys.argv[1:]))


def run(a) -> int:
    if getattr(a, "replot", None):
        results = [json.loads(Path(p).read_text()) for p in a.replot]
        scale = [r for r in results if r.get("rows") and "shape" in r["rows"][0]]
        if scale:
            from .peer_scale import save_figure

            print(f"wrote {save_figure(scale, a.figures or 'figures')}")
        for res in (r for r in results if r not in scale):
            for path in save_figures(res, a.figures or "figures"):
                print(f"wrote {path}")
        return 0
    if a.shape:
        return run_shape(a)
    cfg = config_from_args(a)
    res = run_peer(cfg)
    res["command"] = _command(a)
    table = format_table(res)
    print(table)
    print(f"\nwrote {save(res, cfg.out, table)}")
    if getattr(a, "figures", ""):
        for path in save_figures(res, a.figures):
            print(f"wrote {path}")
    return 0


def run_shape(a) -> int:
    """``--shape``: :func:`lowrank_lib.bench.peer_scale.run_scale`, written as ``peer_scale_<shape>.json``."""
    from . import peer_scale
    from .results import ResultFiles

    cfg = scale_config_from_args(a)
    files = ResultFiles(cfg.out, "peer_scale", cfg.slug())
    res = peer_scale.run_scale(cfg)
    res["command"] = _command(a)
    table = peer_scale.format_table(res)
    print(table)
    print(f"\nwrote {files.write(res, txt=table)}")
    if getattr(a, "figures", "") and cfg.layers is None:
        others = [r for r in peer_scale.committed_results(cfg.out) if r["config"]["shape"] != cfg.shape]
        print(f"wrote {peer_scale.save_figure(others + [res], a.figures)}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowrank_lib.bench.peer", description=__doc__.split("\n")[0])
    add_arguments(ap)
    a = ap.parse_args(argv)
    a._argv = argv if argv is not None else sys.argv[1:]
    return run(a)


if __name__ == "__main__":
    raise SystemExit(main())
