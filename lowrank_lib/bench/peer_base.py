"""What both peer runs share: llama.cpp beside lowrank_lib, measured, compared and judged the same way.

:mod:`.peer` (SmolLM2, every system in one process, interleaved rounds) and :mod:`.peer_scale` (the 1B / 7B
geometries, one system per process) both build on this module and on nothing of each other:

- the systems (:data:`SYSTEMS`) and how each is built (:func:`llama_runner`, :func:`engine`);
- :class:`Timed`: one system's generations through the one decode loop (``run_generation``) and its row: decode
  ms/token = median over every step (quartiles, p10 / p90 by :func:`lowrank_lib.timing.summary`), prefill,
  weight bytes per token, achieved GB/s, ``roofline_x`` = decode time / (weight bytes / copy bandwidth) and the
  same against the read-only bandwidth, the calling thread's CPU time at 1 thread (:class:`lowrank_lib.host.CpuClocked`),
  what our engine ran (kernels, compiles, the LM head's counters) or llama.cpp's own clocks, and (:meth:`Timed.profile`,
  after the timed generations) where our engine's token goes (``breakdown``:
  :func:`lowrank_lib.runtime.profiling.token_breakdown`);
- :func:`~lowrank_lib.eval.fidelity.compare_greedy` (re-exported): two runtimes' greedy tokens and logits on one prompt;
- :func:`across`: R runs of one benchmark as one result, every row a median across the runs; :func:`judged`: a
  result's comparisons and targets, from :mod:`lowrank_lib.eval.peer_targets` (``comparisons``, THE ``TARGETS``,
  ``evaluate``, ``met``: re-exported here);
- :func:`gguf_preflight`: each GGUF system's files loaded and decoded in a child before a run loads them itself;
- the table (:func:`format_table`); the decode-vs-bytes drawing is :mod:`lowrank_lib.eval.speed_plot`'s.
"""
from __future__ import annotations

import time
from copy import deepcopy
from dataclasses import asdict
from pathlib import Path

from ..formats.gguf import decode_bytes_per_token
from ..host import CpuClocked, copy_bandwidth, load_average, machine, read_bandwidth
from ..runtime import Engine, EngineConfig, run_generation
from ..eval.fidelity import compare_greedy, equivalence_line  # noqa: F401  (peer / peer_scale use them from here)
from ..eval.peer_targets import TARGETS, Target, comparisons, evaluate, met  # noqa: F401  (judged here; re-exported)
from ..runtime.profiling import breakdown_table, token_breakdown
from ..timing import across_runs, summary
from .llamacpp import IkLlama, LlamaCppRunner, available, version
from ..eval import ik_llamacpp

#: every system; ``ik_llamacpp`` (ik_llama.cpp, the CPU-tuned fork, on mainline's bf16 and quantized files, its cache
#: bf16 or f16 by its build, ``ik_llamacpp.cache_type``: it has none in f32) only when asked for (the optional ``ik``
#: extra); the others are the default
SYSTEMS = ("llamacpp_dense", "ik_llamacpp", "lowrank_lib_dense", "lowrank_lib_lowrank")
DEFAULT_SYSTEMS = tuple(s for s in SYSTEMS if s != "ik_llamacpp")
#: the systems that run a GGUF (a :class:`LlamaCppRunner` / :class:`IkLlama`)
GGUF_SYSTEMS = ("llamacpp_dense", "ik_llamacpp")
LM_HEADS = ("exact", "certified")
#: llama.cpp KV cache type for each model dtype: the same bytes our engine's cache holds (bf16 for quantized files)
KV_FOR_DTYPE = {"fp32": "f32", "bf16": "bf16"}


def check_choices(what: str, values, allowed) -> tuple:
    """``values`` as a tuple, or SystemExit naming the ones not in ``allowed``."""
    bad = [v for v in values if v not in allowed]
    if bad:
        raise SystemExit(f"unknown {what} {bad}; choose from {tuple(allowed)}")
    return tuple(values)


def start(cfg, systems) -> dict:
    """A run's result before its rows (config, machine, load average, time); SystemExit when ``systems`` need
    llama.cpp and it cannot be imported."""
    for system, (ok, why) in (("llamacpp_dense", available()), ("ik_llamacpp", ik_llamacpp.available())):
        if system in systems and not ok:
            raise SystemExit(f"peer benchmark: {why}")
    return {"config": asdict(cfg), "command": None, "machine": machine(llama_cpp_python=version()), "rows": [],
            "load_average": {"start": load_average()}, "note": cfg.note,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def judged(res: dict) -> dict:
    """``res`` with its comparisons against llama.cpp dense and the targets judged on them."""
    res["comparisons"] = comparisons(res["rows"])
    res["targets"] = evaluate(res["comparisons"])
    return res


def across(results: list[dict]) -> dict:
    """R runs of one peer benchmark -> the last run, each row's decode ms/token (and the ratios it feeds) the median
    over the runs, ``decode_runs`` its :func:`~lowrank_lib.timing.across_runs`, comparisons and targets re-judged."""
    if not results:
        raise ValueError("across() of no runs")
    key = lambda r: (r["system"], r["dtype"], r["threads"], r.get("lm_head"), r.get("factor_bits"))  # noqa: E731
    out = deepcopy(results[-1])
    for r in out["rows"]:
        r["decode_runs"] = across_runs([x["decode_ms_per_token"] for res in results for x in res["rows"]
                                        if key(x) == key(r)])
        f = r["decode_runs"]["median_ms"] / r["decode_ms_per_token"]
        r.update(decode_ms_per_token=r["decode_runs"]["median_ms"], achieved_GBps=r["achieved_GBps"] / f,
                 roofline_x=r["roofline_x"] * f, read_roofline_x=r["read_roofline_x"] * f)
    return judged(out)


class Bandwidths:
    """Copy and read-only bandwidth (GB/s) over buffers of ``nbytes``, measured before a timed block (at construction)
    and after it (:meth:`after`, which returns the two means)."""

    def __init__(self, nbytes: int = 1 << 28):
        self.nbytes, self.copy, self.read = nbytes, [copy_bandwidth("cpu", nbytes)], [read_bandwidth("cpu", nbytes)]

    def after(self) -> tuple[float, float]:
        self.copy.append(copy_bandwidth("cpu", self.nbytes))
        self.read.append(read_bandwidth("cpu", self.nbytes))
        return sum(self.copy) / 2, sum(self.read) / 2


def llama_runner(path, dtype: str, n_ctx: int, threads: int, flash_attn: bool, system: str = "llamacpp_dense"):
    """Mainline llama.cpp (or ``system="ik_llamacpp"``: ik_llama.cpp, its cache bf16 where its build takes one under
    its fused attention, else f16: ``ik_llamacpp.cache_type``) on a GGUF."""
    if system == "ik_llamacpp":
        return IkLlama(path, n_ctx=n_ctx, threads=threads, kv_type=None, flash_attn=flash_attn)
    return LlamaCppRunner(path, n_ctx=n_ctx, threads=threads, kv_type=KV_FOR_DTYPE.get(dtype, "bf16"),
                          flash_attn=flash_attn)


def gguf_smoke(path: str, dtype: str, n_ctx: int, system: str, flash_attn: list[bool], ids: list[int]) -> dict:
    """A child's check of one GGUF system on one file (:func:`gguf_preflight`): load it, prefill ``ids`` and decode two
    tokens, under each ``flash_attn`` setting, as the timing will; returns the tokens per setting."""
    import torch

    out = {}
    for fa in flash_attn:
        r = llama_runner(path, dtype, n_ctx, 1, fa, system)
        try:
            out[str(fa)] = run_generation(r, torch.tensor([ids]), 2).tokens[0].tolist()
        finally:
            r.close()
    return out


def gguf_preflight(checks: dict[tuple, dict], log=print, timeout: float = 600) -> list[dict]:
    """Every GGUF system a run will load in its own process, first run in a child (:func:`gguf_smoke`): a library that
    aborts on a file or setting (ik_llama.cpp's AVX2 wheel on a bf16 cache: SIGABRT) or fails to load it would take
    the whole run, and every row measured so far, with it. ``checks``: ``{(system, file): gguf_smoke's kwargs}``.
    Returns the failures, ``{"system", "file", "error"}`` each (the child's end and traceback); the run leaves those
    out and says so (:func:`failed_lines`)."""
    from .child import ChildError, run_child

    failed = []
    for (system, file), kw in checks.items():
        try:
            run_child("lowrank_lib.bench.peer_base:gguf_smoke", timeout=timeout, **kw)
        except ChildError as e:
            failed.append({"system": system, "file": file, "error": str(e)})
            log(f"[peer] {system} on {file} left out: {str(e).splitlines()[0]}")
    return failed


def failed_lines(res: dict) -> list[str]:
    """The table's lines for what a run left out (``res["failed"]``): the system, its file or unit, how it ended."""
    where = lambda f: f["file"] if "file" in f else ", ".join(      # noqa: E731
        f"{k} {v}" for k, v in f["unit"].items() if k != "system" and v is not None)
    return [f"FAILED, left out: {f['system']} on {where(f)}: {f['error'].splitlines()[0]}" for f in res.get("failed", ())]


def below_host_lines(res: dict) -> list[str]:
    """The table's lines for every peer build that lacks CPU features this host has (the rows' ``isa_below_host``,
    :func:`lowrank_lib.eval.llamacpp.isa_below_host`): its rows are not that peer's best on this CPU, and the table
    says so next to them."""
    seen: dict[str, list[str]] = {}
    for r in res.get("rows", ()):
        info = r.get("info") or {}
        if info.get("isa_below_host"):
            seen.setdefault(info.get("runner", r["system"]), info["isa_below_host"])
    return [f"NOT ITS BEST HERE: this {name} build lacks {', '.join(missing)}, which this CPU has (its system_info "
            "is in the rows' info); build it for this CPU to compare with its best" for name, missing in seen.items()]


def kv_bytes_per_token(config, prompt_len: int, gen_len: int, elem: int) -> int:
    """The K and V bytes a decode step reads, on average over a generation after a ``prompt_len`` prompt: every layer's
    K and V rows of the live context (mean ``prompt_len + gen_len / 2`` slots), ``elem`` bytes a value (the cache's
    type: bf16 2, fp32 4; llama.cpp's cache holds the same type, ``KV_FOR_DTYPE``). Not in ``weight_bytes_per_token``
    nor in the rows' ``roofline_x``: the rows' ``roofline_with_kv_x`` adds them."""
    D = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return int(2 * config.num_hidden_layers * config.num_key_value_heads * D * elem * (prompt_len + gen_len / 2))


def engine(model, dtype: str, n_ctx: int, graph: str, lm_head: str = "exact") -> Engine:
    return Engine(model, EngineConfig(max_batch=1, max_seq_len=n_ctx, dtype=dtype, graph=graph, lm_head=lm_head))


#: tokens of the profiled generation behind a row's ``breakdown``
BREAKDOWN_TOKENS = 16


class Timed:
    """One system's generations (a :class:`~lowrank_lib.runtime.Runner`, CPU-clocked) and its result row."""

    def __init__(self, system: str, runner):
        self.system, self.runner, self.clocked = system, runner, CpuClocked(runner)
        self.llama = system in GGUF_SYSTEMS
        self.outs, self.evals, self.perf, self.warmup_s = [], [], [], 0.0

    def warm(self, ids, n: int, return_logits: bool = False):
        """An untimed generation (our engine compiles its step here: ``capture_s``, never in decode time); the
        counters start afresh after it. Returns its output."""
        t0 = time.perf_counter()
        out = run_generation(self.clocked, ids, n, return_logits=return_logits)
        self.warmup_s = time.perf_counter() - t0
        self.clocked.reset_counters()
        self.outs, self.evals, self.perf = [], [], []
        return out

    def generate(self, ids, n: int) -> None:
        """One timed generation; its per-step times are the samples."""
        self.outs.append(run_generation(self.clocked, ids, n))
        if self.llama:
            self.evals += self.runner.eval_s
            self.perf.append(self.runner.perf())

    def profile(self, ids, gen_len: int) -> dict | None:
        """Our engine, after :meth:`row` (its generation would count in the row's counters): a phase breakdown."""
        return None if self.llama else token_breakdown(self.runner, ids, min(BREAKDOWN_TOKENS, gen_len))

    def row(self, threads: int, copy_gbs: float, read_gbs: float, **fields) -> dict:
        st = summary([s for o in self.outs for s in o.step_s])
        # bytes one step reads (a certified head: on average over the timed steps, so read after them)
        wb = decode_bytes_per_token(self.runner.path) if self.llama else self.runner.weight_bytes_per_token()
        ms = st["median_ms"]
        row = {"system": self.system, **fields, "threads": threads, "lm_head": self.runner.lm_head_mode,
               "decode_ms_per_token": ms,
               "decode_iqr_ms": [st["q1_ms"], st["q3_ms"]], "decode_ms_p10": st["p10_ms"], "decode_ms_p90": st["p90_ms"],
               "decode_steps": st["n"], "prefill_ms": summary([o.prefill_s for o in self.outs])["median_ms"],
               "weight_bytes_per_token": wb, "achieved_GBps": wb / (ms / 1e3) / 1e9, "copy_gbs": copy_gbs,
               "roofline_ms": wb / (copy_gbs * 1e9) * 1e3, "roofline_x": ms / 1e3 / (wb / (copy_gbs * 1e9)),
               "read_gbs": read_gbs, "read_roofline_x": ms / 1e3 / (wb / (read_gbs * 1e9)),
               "decode_cpu_ms_per_token": summary(self.clocked.cpu_s)["median_ms"] if threads == 1 else None,
               "warmup_s": self.warmup_s}
        if self.llama:
            row.update(eval_ms_per_token=summary(self.evals)["median_ms"],
                       perf_eval_ms_per_token=summary([p["eval_ms_per_token"] / 1e3 for p in self.perf])["median_ms"],
                       perf_prefill_ms=summary([p["t_p_eval_ms"] / 1e3 for p in self.perf])["median_ms"],
                       info=self.runner.report())
        else:
            info, counts = self.runner.report(), self.runner.counters()
            row.update(lm_head_report=counts["lm_head"], compile_s=self.runner.capture_s, compiles=info["compiles"], gemv=info["gemv"],
                       gemv_reason=info["gemv_reason"], attention=info["backend"],
                       attention_reason=info["backend_reason"],
                       info={k: v for k, v in info.items() if k not in ("config", "kv_store")})
        return row


# --------------------------------------------------------------------------- the table and the figure
COLUMNS = (("model", "{shape}"), ("system", "{system}"), ("lm head", "{lm_head}"), ("dtype", "{dtype}"),
           ("keep", "{keep}"), ("factor bits", "{factor_bits}"), ("threads", "{threads}"), ("decode ms/tok", "{decode_ms_per_token:.2f}"),
           ("cpu ms/tok", "{decode_cpu_ms_per_token:.2f}"), ("prefill ms", "{prefill_ms:.1f}"), ("MB/tok", "{mb:.1f}"),
           ("GB/s", "{achieved_GBps:.1f}"), ("copy GB/s", "{copy_gbs:.1f}"), ("x roofline", "{roofline_x:.2f}"),
           ("read GB/s", "{read_gbs:.1f}"), ("x read roofline", "{read_roofline_x:.2f}"))


class _Dash:
    def __format__(self, spec: str) -> str:
        return "-"


class _Cells(dict):
    """A row for ``str.format_map``: ``-`` for a field the row lacks or holds as None."""

    def __missing__(self, key):
        return _Dash()


def format_table(res: dict, lines: list[str] = ()) -> str:
    """The rows as a Markdown table (``-`` where a row has no value), then ``lines``, then the targets."""
    out = [" | ".join(h for h, _ in COLUMNS), "|".join("---" for _ in COLUMNS)]
    for r in sorted(res["rows"], key=lambda r: (str(r.get("shape")), r["threads"], r["dtype"],
                                                SYSTEMS.index(r["system"]), str(r.get("lm_head")), r.get("keep") or 1)):
        cells = _Cells({k: v for k, v in r.items() if v is not None}, mb=r["weight_bytes_per_token"] / 1e6)
        out.append(" | ".join(f.format_map(cells) for _, f in COLUMNS))
    out += breakdown_table(res["rows"])
    out += list(lines)
    out += [f"target {t['target']} ({t['shape']}, {t['system']}, {t['dtype']}, keep {t['keep']}, issue {t['issue']}): "
            f"{t['measured']:.2f} vs {t['op']} {t['bound']}: " + ("met" if t["met"] else "NOT met")
            for t in res.get("targets", [])]
    return "\n".join(out)


def save_figure(fig, path) -> str:
    import matplotlib.pyplot as plt

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return str(path)
