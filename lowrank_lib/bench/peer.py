"""Peer benchmark on SmolLM2: llama.cpp on the dense model vs lowrank_lib (dense and low-rank), side by side.

    python -m lowrank_lib.bench peer --threads 1 2 --dtypes fp32 bf16 --repeats 3      # SmolLM2, in one process
    python -m lowrank_lib.bench peer --shape llama3.2-1b                               # see bench/peer_scale.py

One process, one prompt, interleaved rounds (:func:`lowrank_lib.timing.interleaved`): per thread count,
every system runs one whole generation (prompt 512, 64 new greedy tokens) in turn, ``repeats`` times, the order
rotated each round, so drift on a shared machine hits all alike. Systems (``rows[].system``,
:data:`~.peer_base.SYSTEMS`):

=======================  ================================================================================
``llamacpp_dense``       llama.cpp (``llama-cpp-python``, extra ``peer``) on an F32 / BF16 GGUF of the SAME
                         cached weights (``models.smollm2_ggufs``: dequantised from the Q4_1 file our cache came
                         from, verified tensor by tensor), KV cache at the model dtype
``lowrank_lib_dense``    our Engine on the dense model
``lowrank_lib_lowrank``  our Engine on the plain-SVD keep-``keep`` factors (as ``bench decode`` builds them)
=======================  ================================================================================

In bf16 two more kinds of row join (issues 29-30): llama.cpp on ``quants`` files that its own quantizer makes from the
BF16 GGUF (``dtype`` = the file type, e.g. ``q4_k_m``), and our low-rank engine with its factors quantized to each of
``factor_bits`` (``lowrank_lib.quantize_factors``, group 32: ``factor_bits`` in the row).

Each of our systems runs once per LM head of ``lm_heads`` (``exact``; ``certified``: the same greedy tokens from a
fraction of the head's bytes, its row holding the head's counters). Rows, comparisons against llama.cpp dense and
the targets are :mod:`lowrank_lib.bench.peer_base`'s (shared with ``--shape``). Before any timing, llama.cpp and
our dense engine must produce the same greedy tokens from the same prompt in fp32 (``equivalence``); with the
certified head, an audit on the fidelity prompts checks its greedy tokens against the exact head's
(``certified_audit``, ``--audit-prompts`` prompts x ``gen_len`` tokens). Copy and read bandwidth are measured
before and after each thread count. Compile time is reported apart (``compile_s``), never in decode time. Before
anything of llama.cpp runs in this process, each GGUF system loads and decodes each of its files in a child
(:func:`~.peer_base.gguf_preflight`): one that fails or aborts there is left out (``failed``, named in the table; the
command then exits 1), where it would have ended the whole run and lost every row.

Writes ``<out>/peer_cpu.json`` (never overwritten: :mod:`lowrank_lib.bench.results`) with the table as ``.txt``.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..eval.fidelity import audit_line, certified_audit
from ..eval.llamacpp import quantize
from ..factorized import quantize_factors
from ..host import load_average
from ..runtime import run_generation
from ..timing import interleaved, interleaved_samples, summary
from ..eval.speed_plot import draw_decode_vs_bytes, draw_thread_scaling
from .peer_base import (DEFAULT_SYSTEMS, LM_HEADS, SYSTEMS, Bandwidths, Timed, below_host_lines, check_choices, compare_greedy,
                        engine, equivalence_line, failed_lines, format_table, gguf_preflight, judged, kv_bytes_per_token,
                        llama_runner, save_figure, start)
from .results import ResultFiles

#: the keys every row holds (the notebooks' tables)
ROW_KEYS = ("system", "dtype", "threads", "decode_ms_per_token", "prefill_ms", "weight_bytes_per_token")


@dataclass
class PeerConfig:
    model: str = "smollm2"
    keep: float = 0.5
    dtypes: tuple[str, ...] = ("fp32", "bf16")
    threads: tuple[int, ...] = (1, 2)
    prompt_len: int = 512
    gen_len: int = 64
    repeats: int = 3
    systems: tuple[str, ...] = DEFAULT_SYSTEMS     # + "ik_llamacpp": ik_llama.cpp on the bf16 / quantized files
    lm_heads: tuple[str, ...] = LM_HEADS  # our systems run once per LM head (EngineConfig.lm_head)
    #: our engine's decode step: "none" (eager: one decode_stack call, then the head) or "whole-step" (torch.compile-d;
    #: with the fused layer op it has nothing left to fuse, and measured 3-5 % slower in paired steps: dynamo's entry)
    graph: str = "none"
    llama_flash_attn: str = "auto"       # "on" | "off" | "auto" (the faster of the two in a short probe)
    prompt: str = "wikitext"             # "wikitext" (a test-split window) or "random" token ids
    audit_prompts: int = 20              # the certified head's audit: fidelity prompts x gen_len tokens (0 = none)
    quants: tuple[str, ...] = ("q8_0", "q4_k_m")   # llama.cpp's quantized files (bf16 rows; needs dtype bf16)
    factor_bits: tuple[int, ...] = (8, 4)          # our low-rank factors quantized (bf16 rows, each LM head)
    seed: int = 0
    out: str = "benchmarks/results"
    note: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        self.dtypes = check_choices("dtypes", self.dtypes, ("fp32", "bf16"))
        self.systems = check_choices("systems", self.systems, SYSTEMS)
        self.lm_heads = check_choices("LM heads", self.lm_heads, LM_HEADS)
        self.quants = check_choices("llama.cpp quantizations", self.quants, ("q8_0", "q4_k_m"))
        self.factor_bits = check_choices("factor bits", self.factor_bits, (8, 4))


def prompt_ids(tok, vocab_size: int, n: int, source: str = "wikitext", seed: int = 0) -> torch.Tensor:
    """[1, n] prompt token ids: a WikiText-2 test window (real text: greedy decoding is meaningful) or seeded
    random ids (models without a tokenizer)."""
    g = torch.Generator().manual_seed(seed)
    if source == "wikitext" and tok is not None:
        from .. import data

        ids = data.tokens(tok, "test")
        start = int(torch.randint(0, ids.numel() - n, (1,), generator=g))
        return ids[start:start + n][None].clone()
    return torch.randint(0, vocab_size, (1, n), generator=g)


def peer_files(cfg: PeerConfig, dense, log=print) -> dict[str, Path]:
    """llama.cpp's files of the dense model at every dtype: SmolLM2's from its Q4_1 GGUF, any other model written
    from its HF weights (the tests' tiny models)."""
    from .. import models
    from ..formats.gguf import DTYPE_TYPES, write_hf_gguf

    if cfg.model == "smollm2":
        files = models.smollm2_ggufs(cfg.dtypes, log=log)
    else:
        d = models.default_cache_dir() / "peer-gguf" / Path(cfg.model).name
        files = {dt: write_hf_gguf(dense, d / f"model.{dt}.gguf", DTYPE_TYPES[dt]) for dt in cfg.dtypes}
    for q in cfg.quants if "bf16" in files else ():      # llama.cpp's quantizer on the BF16 file, once
        dst = files["bf16"].with_name(files["bf16"].name.replace(".BF16.", ".").replace(".gguf", f".{q.upper()}.gguf"))
        files[q] = dst if dst.exists() else quantize(files["bf16"], dst, q)
    return files


def flash_attn(cfg: PeerConfig, path, dtype: str, threads: int, ids, cache: dict) -> bool:
    """llama.cpp's fused attention: as configured, or (``auto``) the faster of on / off in a short interleaved probe
    per (dtype, threads), remembered in ``cache`` (with the probe's medians)."""
    if cfg.llama_flash_attn != "auto":
        return cfg.llama_flash_attn == "on"
    if (dtype, threads) not in cache:
        rs = {fa: llama_runner(path, dtype, cfg.prompt_len + cfg.gen_len, threads, fa) for fa in (True, False)}
        for r in rs.values():
            run_generation(r, ids, 4)
        t = interleaved_samples({fa: (lambda r=r: run_generation(r, ids, 16).step_s) for fa, r in rs.items()}, 2)
        ms = {fa: summary(v)["median_ms"] for fa, v in t.items()}
        for r in rs.values():
            r.close()
        cache[(dtype, threads)] = {"fa": ms[True] <= ms[False], "probe": {"on_ms": ms[True], "off_ms": ms[False]}}
    return cache[(dtype, threads)]["fa"]


def run_peer(cfg: PeerConfig, progress: bool = True, log=print) -> dict:
    """Run the whole benchmark (see the module docstring); returns the result dict."""
    from ..resolve import resolve_models

    want_llama, want_ik = "llamacpp_dense" in cfg.systems, "ik_llamacpp" in cfg.systems
    res = start(cfg, cfg.systems)
    dense, comp, tok = resolve_models(cfg.model, method="svd", keep=cfg.keep)
    ids = prompt_ids(tok, dense.config.vocab_size, cfg.prompt_len, cfg.prompt, cfg.seed)
    ggufs = peer_files(cfg, dense, log) if want_llama or want_ik else {}
    n_ctx, shape = cfg.prompt_len + cfg.gen_len, Path(cfg.model).name
    res.update(prompt_tokens=ids.shape[1], copy_bandwidth_GBps_by_threads={}, read_bandwidth_GBps_by_threads={})
    fa = {}
    q_bits = cfg.factor_bits if "bf16" in cfg.dtypes and "lowrank_lib_lowrank" in cfg.systems else ()
    quantized = {b: quantize_factors(copy.deepcopy(comp), b) for b in q_bits}   # only where a bf16 row uses it

    # 0. every GGUF system on every file it will time, first in a child: one that aborts is left out, not the run
    res["failed"] = gguf_preflight(gguf_checks(cfg, ggufs, ids, n_ctx), log)
    left_out = {(f["system"], f["file"]) for f in res["failed"]}
    ok = lambda system, file: (system, file) not in left_out  # noqa: E731

    # 1. same work: llama.cpp and our dense engine give the same greedy tokens in fp32 (1 thread)
    if want_llama and "fp32" in ggufs and ok("llamacpp_dense", "fp32"):
        torch.set_num_threads(1)
        r = llama_runner(ggufs["fp32"], "fp32", n_ctx, 1, flash_attn(cfg, ggufs["fp32"], "fp32", 1, ids, fa))
        a = run_generation(r, ids, cfg.gen_len, return_logits=True)
        r.close()
        b = run_generation(engine(dense, "fp32", n_ctx, cfg.graph), ids, cfg.gen_len, return_logits=True)
        res["equivalence"] = {"dtype": "fp32", "threads": 1, "a": "llamacpp_dense", "b": "lowrank_lib_dense",
                              "llama_flash_attn": r.flash_attn,
                              **compare_greedy(a.tokens[0], torch.cat(a.logits), b.tokens[0], torch.cat(b.logits))}
        log(f"[peer] {equivalence_line(res['equivalence'])}")
        torch._dynamo.reset()

    # 1b. the certified head's audit: the exact head's greedy tokens on the fidelity prompts, every dtype
    if "certified" in cfg.lm_heads and tok is not None and cfg.audit_prompts:
        torch.set_num_threads(cfg.threads[0])
        res["certified_audit"] = {dt: certified_audit(comp, tok, dt, cfg.audit_prompts, cfg.gen_len, progress)
                                  for dt in cfg.dtypes}
        for dt, a in res["certified_audit"].items():
            log(f"[peer] {audit_line(dt, a)}")

    # 2. timing, one thread count at a time (the two runtimes never run at once), every system in the same rounds
    for th in cfg.threads:
        torch.set_num_threads(th)
        bws, timed = Bandwidths(), {}
        for dt in cfg.dtypes:
            for f in gguf_files(cfg, "llamacpp_dense", dt) if want_llama else ():   # a quantized file: dt is bf16
                if ok("llamacpp_dense", f):
                    timed[("llamacpp_dense", f)] = Timed("llamacpp_dense", llama_runner(
                        ggufs[f], dt, n_ctx, th, flash_attn(cfg, ggufs[f], f, th, ids, fa)))
            for f in gguf_files(cfg, "ik_llamacpp", dt) if want_ik else ():       # its fused attention (no probe)
                if ok("ik_llamacpp", f):
                    timed[("ik_llamacpp", f)] = Timed("ik_llamacpp", llama_runner(ggufs[f], "bf16", n_ctx, th, True,
                                                                                 "ik_llamacpp"))
            for s, model in (("lowrank_lib_dense", dense), ("lowrank_lib_lowrank", comp)):
                for head in cfg.lm_heads if s in cfg.systems else ():
                    timed[(s, dt, head)] = Timed(s, engine(model, dt, n_ctx, cfg.graph, head))
            for b in q_bits if dt == "bf16" else ():               # quantized factors, with each head too
                for head in cfg.lm_heads:
                    timed[("lowrank_lib_lowrank", dt, head, b)] = Timed("lowrank_lib_lowrank", engine(
                        quantized[b], dt, n_ctx, cfg.graph, head))
        for t in timed.values():
            t.warm(ids, min(4, cfg.gen_len))
        bar = tqdm(total=cfg.repeats, desc=f"peer bench, {th} thread(s), rounds", disable=not progress)
        interleaved({k: (lambda t=t: t.generate(ids, cfg.gen_len)) for k, t in timed.items()}, rounds=cfg.repeats,
                    progress=lambda _: bar.update(1))
        bar.close()
        bw, rbw = bws.after()                                             # before and after
        res["copy_bandwidth_GBps_by_threads"][str(th)], res["read_bandwidth_GBps_by_threads"][str(th)] = bw, rbw
        res["load_average"][f"after_{th}_threads"] = load_average()      # what else ran shows here
        for (s, dt, *rest), t in timed.items():
            row = t.row(th, bw, rbw, shape=shape, dtype=dt, keep=cfg.keep if s == "lowrank_lib_lowrank" else None,
                        factor_bits=rest[1] if len(rest) > 1 else None)
            kvb = kv_bytes_per_token(dense.config, ids.shape[1], cfg.gen_len, 4 if dt == "fp32" else 2)
            row.update(kv_bytes_per_token=kvb, roofline_with_kv_x=row["decode_ms_per_token"] / 1e3 / (
                (row["weight_bytes_per_token"] + kvb) / (bw * 1e9)))
            row["breakdown"] = t.profile(ids, cfg.gen_len)                # after the row took the counters
            if t.llama:
                row["info"]["flash_attn_probe"] = fa.get((dt, th), {}).get("probe")
                t.runner.close()
            res["rows"].append(row)
        del timed
        torch._dynamo.reset()           # the next thread count compiles afresh (inductor fixes its thread count)
    by = res["copy_bandwidth_GBps_by_threads"]
    res["copy_bandwidth_GBps"] = by.get("1", next(iter(by.values()), float("nan")))
    return judged(res)


def gguf_files(cfg: PeerConfig, system: str, dt: str) -> tuple[str, ...]:
    """The GGUF files ``system`` (``llamacpp_dense`` / ``ik_llamacpp``) times for the activation dtype ``dt``: with
    bf16 its file and the quantized ones, else (llama.cpp only) the dtype's file. The timing loop and the preflight
    (:func:`gguf_checks`) both read it, so the preflight checks exactly what the timing loads."""
    if dt == "bf16":
        return (dt, *cfg.quants)
    return (dt,) if system == "llamacpp_dense" else ()


def gguf_checks(cfg: PeerConfig, ggufs: dict[str, Path], ids, n_ctx: int) -> dict[tuple, dict]:
    """:func:`~.peer_base.gguf_preflight`'s checks of a run: llama.cpp on each dtype's file and (bf16) its quantized
    ones, under each fused-attention setting it may use; ik_llama.cpp on the bf16 and quantized files (fused)."""
    fa = [True, False] if cfg.llama_flash_attn == "auto" else [cfg.llama_flash_attn == "on"]
    want = {"llamacpp_dense": fa, "ik_llamacpp": [True]}
    checks = {}
    for system in (s for s in want if s in cfg.systems):
        for dt in cfg.dtypes:
            for f in gguf_files(cfg, system, dt):
                checks[(system, f)] = dict(path=str(ggufs[f]), dtype="fp32" if f == "fp32" else "bf16", n_ctx=n_ctx,
                                           system=system, flash_attn=want[system], ids=ids[0].tolist())
    return checks


def table(res: dict) -> str:
    """:func:`~.peer_base.format_table` with this run's bandwidths, audit and equivalence."""
    bw = lambda d: ", ".join(f"{t} thread(s) {v:.1f}" for t, v in d.items())      # noqa: E731
    lines = [f"\ncopy bandwidth GB/s: {bw(res['copy_bandwidth_GBps_by_threads'])}; read-only stream bandwidth GB/s: "
             f"{bw(res.get('read_bandwidth_GBps_by_threads', {}))}; {res['machine']['cpu']}, "
             f"{res['machine']['cores']} cores"]
    lines += [audit_line(dt, a) for dt, a in res.get("certified_audit", {}).items()]
    lines += [equivalence_line(res["equivalence"])] if res.get("equivalence") else []
    return format_table(res, lines + below_host_lines(res) + failed_lines(res))


def save(res: dict, out_dir, table: str | None = None) -> Path:
    """Write ``<out_dir>/peer_cpu.json`` (``peer_cpu_2.json``, ... : never overwritten) through the one writer."""
    return ResultFiles(out_dir, "peer_cpu").write(res, **({"txt": table} if table else {}))


# --------------------------------------------------------------------------- figures
def plot_decode_vs_bytes(res: dict, threads: int = 1, ax=None):
    """Decode ms/token against weight bytes per token at ``threads`` (:func:`~lowrank_lib.eval.speed_plot.draw_decode_vs_bytes`, the
    copy roofline of that thread count). Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    ax = plt.subplots(figsize=(6.5, 4.2))[1] if ax is None else ax
    draw_decode_vs_bytes(ax, [r for r in res["rows"] if r["threads"] == threads],
                         res["copy_bandwidth_GBps_by_threads"].get(str(threads)))
    ax.set_title(f"decode vs bytes, {threads} thread(s); dashed: llama.cpp dense")
    return ax.figure


def save_figures(res: dict, fig_dir) -> list[str]:
    """``peer_decode_vs_bytes.png`` (1 thread, or the fewest run) and ``peer_thread_scaling.png``
    (:func:`~lowrank_lib.eval.speed_plot.draw_thread_scaling` of the rows) in ``fig_dir``."""
    import matplotlib.pyplot as plt

    _, ax = plt.subplots(figsize=(6.5, 4.2))
    draw_thread_scaling(ax, res["rows"], res["copy_bandwidth_GBps_by_threads"])
    return [save_figure(plot_decode_vs_bytes(res, min(r["threads"] for r in res["rows"])),
                        Path(fig_dir) / "peer_decode_vs_bytes.png"),
            save_figure(ax.figure, Path(fig_dir) / "peer_thread_scaling.png")]
