"""``bench peer --shape``: llama.cpp against lowrank_lib at the geometries users run, one system per process.

    python -m lowrank_lib.bench peer --shape llama3.2-1b            # bf16 + fp32, keep 0.5 / 0.8, 1 and 2 threads
    python -m lowrank_lib.bench peer --shape llama2-7b              # bf16

Random weights at the real geometry (``lowrank_lib.models.SHAPES``: decode speed does not depend on the values), written
once as memory-mapped safetensors shards (``lowrank_lib.models.write_shape_weights``): the dense bf16 model and, per keep,
random factors of the canonical ranks. Systems (``rows[].system``, :data:`~.peer_base.SYSTEMS`): llama.cpp on a GGUF
written by OUR exporter from the SAME dense weights (``formats.gguf.write_hf_gguf``, F32 / BF16, verified tensor by
tensor) and on ``Q8_0`` / ``Q4_K_M`` files made from the BF16 one by llama.cpp's own quantizer (``rows[].dtype`` =
q8_0 / q4_k_m: what a user picks instead of low rank); our Engine on the dense weights; our Engine on the random
keep-``keep`` factors (``rows[].keep``), with ``factor_bits`` also as int8 / int4 factors (``rows[].factor_bits``).

Every (system, dtype, keep) runs in its OWN child process (:mod:`lowrank_lib.bench.child`: a 7B dense model and its
factors never share the machine's memory; each row carries the child's peak RSS, anonymous and file-backed); a
first child writes the files (:func:`prepare`), a last one per dtype times each GEMV class of the geometry alone
(:func:`lowrank_lib.runtime.bandwidth.measure`). A child runs every thread count: copy and read bandwidth before and after, a warm-up
generation (our engine compiles its step there, timed apart), then ``repeats`` generations; the row is
:class:`~.peer_base.Timed`'s. Systems cannot share a process at 7B, so a shared machine's drift lands between
children: ``rounds`` > 1 runs the list of children that many times in turn (A B C A B C), each row is its median
round (:func:`median_rows`), each comparison also holds per-round ratios (paired in time). The parent compares the
children's greedy tokens and logits per dtype (``equivalence``: random weights have tiny margins; the logits are the
check), then the comparisons and targets of :mod:`.peer_base`. A unit whose child fails (raises, aborts, is killed) is
left out, not the run: ``failed`` holds it and how it ended, the table names it, the command exits 1.

Writes ``<out>/peer_scale_<shape>[_L<layers>].json`` (never overwritten) and ``figures/peer_scale_decode_vs_bytes.png``
(every committed shape result, or the ones given to ``--replot``).
"""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..factorized import quantize_factors
from ..models import SHAPES, generated, load_shape_model, proj_shapes, shape_config, shape_dir, write_shape_weights
from ..ranks import keep_rank
from ..runtime import LM_HEADS as ENGINE_HEADS
from ..eval.speed_plot import draw_decode_vs_bytes
from ..host import load_average
from .child import ChildError, run_child
from .peer_base import (DEFAULT_SYSTEMS, GGUF_SYSTEMS, KV_FOR_DTYPE, SYSTEMS, Bandwidths, Timed, below_host_lines, check_choices,
                        compare_greedy, engine, equivalence_line, failed_lines, format_table, judged, llama_runner, save_figure, start)
from .results import slug

#: llama.cpp's quantized file types (``llamacpp.QUANT_TYPES``)
QUANTS = ("q8_0", "q4_k_m")
#: dtypes run by default at each shape (the issue: bf16 at both, fp32 at 1B)
DEFAULT_DTYPES = {"llama3.2-1b": ("bf16", "fp32"), "llama2-7b": ("bf16",)}
ROW_KEYS = ("shape", "system", "dtype", "threads", "keep", "decode_ms_per_token", "weight_bytes_per_token", "copy_gbs",
            "roofline_x")
GGUF_NAMES = {"fp32": "F32", "bf16": "BF16", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}
GB = 2 ** 30


@dataclass
class ScaleConfig:
    shape: str = "llama3.2-1b"
    keeps: tuple[float, ...] = (0.5, 0.8)
    dtypes: tuple[str, ...] | None = None          # None: DEFAULT_DTYPES[shape]
    threads: tuple[int, ...] = (1, 2)
    quants: tuple[str, ...] = QUANTS
    factor_bits: tuple[int, ...] = ()               # our keep factors also quantized to these bits (bf16 rows)
    systems: tuple[str, ...] = DEFAULT_SYSTEMS     # + "ik_llamacpp"
    prompt_len: int = 512
    gen_len: int = 64
    repeats: int = 3
    layers: int | None = None                       # a reduced layer count (dry runs, tests)
    overrides: dict = field(default_factory=dict)   # other geometry fields replaced (tests: a small vocabulary)
    graph: str = "none"
    llama_flash_attn: str = "on"                    # "on" | "off" (llama-bench's CPU default is on)
    lm_heads: tuple[str, ...] = ("exact",)          # our systems run once per LM head (EngineConfig.lm_head)
    rounds: int = 1                                 # the unit list run this many times in turn: rows are medians
    gemv_classes: bool = True                       # also time each GEMV class of the geometry (runtime.bandwidth)
    bandwidth_bytes: int = 1 << 28                  # each copy / read bandwidth buffer (tests: small, numbers mean less)
    stream_bytes: float = 1.0e9                     # bytes each GEMV class streams per timed pass (runtime.bandwidth)
    seed: int = 0
    out: str = "benchmarks/results"
    cache_dir: str | None = None                    # the random weights and GGUFs; None = the model cache
    cleanup: bool = False                           # delete this shape's generated files after the run
    note: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.shape not in SHAPES:
            raise SystemExit(f"unknown shape {self.shape!r}: use one of {sorted(SHAPES)}")
        self.dtypes = tuple(self.dtypes or DEFAULT_DTYPES.get(self.shape, ("bf16",)))
        self.dtypes = check_choices("dtypes", self.dtypes, KV_FOR_DTYPE)
        self.quants = check_choices("llama.cpp quantizations", self.quants, QUANTS)
        self.systems = check_choices("systems", self.systems, SYSTEMS)
        self.keeps, self.threads = tuple(self.keeps), tuple(self.threads)
        self.factor_bits = tuple(check_choices("factor bits", tuple(self.factor_bits), (8, 4)))
        self.lm_heads = check_choices("LM heads", tuple(self.lm_heads), ENGINE_HEADS)
        if self.rounds < 1:
            raise SystemExit(f"--rounds {self.rounds}: at least 1")
        if self.factor_bits and "bf16" not in self.dtypes:
            raise SystemExit("--factor-bits: quantized factors run with bf16 activations; add bf16 to --dtypes")

    def slug(self) -> str:
        return slug(self.shape, None if self.layers is None else f"L{self.layers}", "o" if self.overrides else None)


def units(cfg: ScaleConfig) -> list[dict]:
    """The (system, dtype, keep) of every child process, in run order."""
    out = []
    for dt in cfg.dtypes:
        out += [{"system": "llamacpp_dense", "dtype": dt, "keep": None}] if "llamacpp_dense" in cfg.systems else []
        ours = [{"system": "lowrank_lib_dense", "keep": None}] if "lowrank_lib_dense" in cfg.systems else []
        if "lowrank_lib_lowrank" in cfg.systems:
            ours += [{"system": "lowrank_lib_lowrank", "keep": k} for k in cfg.keeps]
            ours += [{"system": "lowrank_lib_lowrank", "keep": k, "factor_bits": b}   # quantized: bf16
                     for k in cfg.keeps for b in (cfg.factor_bits if dt == "bf16" else ())]
        out += [{**u, "dtype": dt, **({"lm_head": h} if h != "exact" else {})} for u in ours for h in cfg.lm_heads]
    if "llamacpp_dense" in cfg.systems:
        out += [{"system": "llamacpp_dense", "dtype": q, "keep": None} for q in cfg.quants]
    if "ik_llamacpp" in cfg.systems:                   # ik_llama.cpp on the bf16 and quantized files (a bf16 cache)
        out += [{"system": "ik_llamacpp", "dtype": q, "keep": None} for q in ("bf16", *cfg.quants)]
    return out + [{"system": "gemv_classes", "dtype": dt, "keep": None} for dt in cfg.dtypes if cfg.gemv_classes]


def gguf_path(cfg: ScaleConfig, dtype: str) -> Path:
    return shape_dir(cfg.shape, None, cfg.seed, cfg.layers, cfg.cache_dir, cfg.overrides) / "gguf" / \
        f"model.{GGUF_NAMES[dtype]}.gguf"


def disk_needed(cfg: ScaleConfig) -> int:
    """Bytes the generated files take (weights, factors, GGUFs), estimated from the geometry."""
    c = shape_config(cfg.shape, cfg.layers, cfg.overrides)
    proj = proj_shapes(c)
    dense = sum(o * i for o, i in proj.values()) * c.num_hidden_layers
    emb = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    n = 2 * (dense + emb) + sum(2 * c.num_hidden_layers * sum(keep_rank(o, i, k) * (o + i) for o, i in proj.values())
                                for k in cfg.keeps)
    per = {"fp32": 4, "bf16": 2, "q8_0": 34 / 32, "q4_k_m": 0.6}
    return int(n + sum(per[dt] * (dense + emb) for dt in set(cfg.dtypes) | {"bf16"} | set(cfg.quants)))


def disk_present(cfg: ScaleConfig) -> int:
    """Bytes of this shape's generated files already on disk (a later run reuses them, so they need no new space)."""
    dirs = [shape_dir(cfg.shape, k, cfg.seed, cfg.layers, cfg.cache_dir, cfg.overrides) for k in (None, *cfg.keeps)]
    return sum(f.stat().st_size for d in dirs if d.is_dir() for f in d.rglob("*") if f.is_file())


# --------------------------------------------------------------------------- the children's work
def prepare(config: dict) -> dict:
    """(A child.) Write, once, the random weights, our exporter's GGUFs and llama.cpp's quantized files. Every GGUF
    is verified against the weights after writing, its size recorded in a marker beside it; a later run reuses files
    whose marker matches."""
    from ..formats.gguf import write_hf_gguf, verify_gguf
    from .llamacpp import quantize

    cfg, t0 = ScaleConfig(**config), time.perf_counter()
    for k in (None, *cfg.keeps):
        if k is None or "lowrank_lib_lowrank" in cfg.systems:
            write_shape_weights(cfg.shape, k, cfg.seed, cfg.layers, cfg.cache_dir, overrides=cfg.overrides)
    want = sorted(set(cfg.dtypes) | ({"bf16"} if cfg.quants or "ik_llamacpp" in cfg.systems else set())) \
        if set(GGUF_SYSTEMS) & set(cfg.systems) else []
    model = None

    def make(dt: str) -> dict:
        nonlocal model
        p = gguf_path(cfg, dt)
        print(f"[peer-scale] writing {p} ({dt})", flush=True)
        if dt in QUANTS:
            quantize(gguf_path(cfg, "bf16"), p, dt)
            return {"from": gguf_path(cfg, "bf16").name}
        model = model or load_shape_model(cfg.shape, None, cfg.seed, cfg.layers, cfg.cache_dir, overrides=cfg.overrides)
        write_hf_gguf(model, p, GGUF_NAMES[dt], name=f"random {cfg.shape}", progress=True)
        return {"verify": verify_gguf(p, model.state_dict(), dt)}

    marker = {dt: generated(gguf_path(cfg, dt), dt, lambda dt=dt: make(dt)) for dt in [*want, *(cfg.quants if want
                                                                                                  else ())]}
    return {"seconds": time.perf_counter() - t0, "gguf": marker}


def run_unit(config: dict, unit: dict, logits: str) -> dict:
    """(A child.) One system at every thread count; its first generation's tokens and logits saved to ``logits``."""
    from tqdm.auto import tqdm

    cfg, (system, dtype, keep) = ScaleConfig(**config), (unit["system"], unit["dtype"], unit["keep"])
    c = shape_config(cfg.shape, cfg.layers, cfg.overrides)
    ids = torch.randint(0, c.vocab_size, (1, cfg.prompt_len), generator=torch.Generator().manual_seed(cfg.seed))
    S, t0 = cfg.prompt_len + cfg.gen_len, time.perf_counter()
    torch.set_num_threads(cfg.threads[0])
    if system in GGUF_SYSTEMS:                     # ik_llama.cpp: its fused attention, a bf16 cache
        runner = llama_runner(gguf_path(cfg, dtype), dtype, S, cfg.threads[0],
                              cfg.llama_flash_attn == "on" or system == "ik_llamacpp", system)
    else:                    # the engine holds its own (packed) copy; the mapped file pages go with the model
        model = load_shape_model(cfg.shape, keep, cfg.seed, cfg.layers, cfg.cache_dir, progress=False,
                                 overrides=cfg.overrides)
        bits = unit.get("factor_bits")                 # int8 / int4 factors (lowrank_lib.quantize_factors, group 32)
        runner = engine(quantize_factors(model, bits) if bits else model, dtype, S, cfg.graph,
                        unit.get("lm_head", "exact"))
        del model
    build_s, t, rows, first = time.perf_counter() - t0, Timed(system, runner), [], None
    for th in cfg.threads:
        torch.set_num_threads(th)
        if t.llama:
            runner.set_threads(th)
        else:
            runner.invalidate()                     # inductor fixes its thread count: compile afresh
            torch._dynamo.reset()
        bws, la0 = Bandwidths(cfg.bandwidth_bytes), load_average()
        warm = t.warm(ids, cfg.gen_len if first is None else min(4, cfg.gen_len), return_logits=first is None)
        first = warm if first is None else first
        for _ in tqdm(range(cfg.repeats), desc=f"{system} {dtype} keep={keep} {th}t", leave=False):
            t.generate(ids, cfg.gen_len)
        rows.append(t.row(th, *bws.after(), shape=cfg.shape, layers=c.num_hidden_layers, dtype=dtype,
                          keep=keep, factor_bits=unit.get("factor_bits"), copy_gbs_before_after=bws.copy, build_s=build_s,
                          load_average={"before": la0, "after": load_average()}))
        rows[-1]["breakdown"] = t.profile(ids, cfg.gen_len)
    torch.save({"tokens": first.tokens[0], "logits": torch.cat(first.logits)}, logits)
    if t.llama:
        runner.close()
    return {"rows": rows}


def run_gemv_classes(config: dict, dtype: str) -> dict:
    """(A child.) :func:`lowrank_lib.runtime.bandwidth.measure` of the dense and every keep geometry, every thread
    count."""
    from ..runtime.bandwidth import measure

    cfg = ScaleConfig(**config)
    c, out = shape_config(cfg.shape, cfg.layers, cfg.overrides), []
    for th in cfg.threads:
        torch.set_num_threads(th)
        out += [measure(c, k, dtype, cfg.stream_bytes, copy_bytes=cfg.bandwidth_bytes) for k in (None, *cfg.keeps)]
    return {"rows": [], "gemv_classes": out}


# --------------------------------------------------------------------------- the whole run
def run_scale(cfg: ScaleConfig, log=print) -> dict:
    """Prepare the files, run every unit in its own process, compare and judge (see the module docstring)."""
    from .. import models

    res = start(cfg, cfg.systems)
    root = Path(cfg.cache_dir) if cfg.cache_dir else models.default_cache_dir() / "random-models"
    root.mkdir(parents=True, exist_ok=True)
    need, free = max(0, disk_needed(cfg) - disk_present(cfg)), shutil.disk_usage(root).free
    if need > free:
        raise SystemExit(f"peer --shape {cfg.shape}: the generated files need about {need / 1e9:.1f} GB, "
                         f"{root} has {free / 1e9:.1f} GB free")
    config = res["config"]
    res.update(units=[], disk_needed_gb=need / 1e9, gemv_classes=[], failed=[])
    res["prepare"] = run_child("lowrank_lib.bench.peer_scale:prepare", config=config)
    first, todo = {}, [(n, u) for n in range(cfg.rounds) for u in units(cfg) if not n or u["system"] != "gemv_classes"]
    with tempfile.TemporaryDirectory(prefix="peer-scale-") as td:
        for i, (n, u) in enumerate(todo):
            logits = str(Path(td) / f"logits{i}.pt")
            try:            # a unit whose child fails (a library's abort, memory) is left out, not the whole run
                r = (run_child("lowrank_lib.bench.peer_scale:run_gemv_classes", config=config, dtype=u["dtype"])
                     if u["system"] == "gemv_classes" else
                     run_child("lowrank_lib.bench.peer_scale:run_unit", config=config, unit=u, logits=logits))
            except ChildError as e:
                res["failed"].append({"system": u["system"], "unit": {**u, "round": n}, "error": str(e)})
                log(f"[peer-scale] round {n + 1}/{cfg.rounds} {u} FAILED, left out: {str(e).splitlines()[0]}")
                continue
            mem = {f"{k}_gb": r[k] / GB for k in ("peak_rss", "peak_anon", "peak_file")}
            log(f"[peer-scale] round {n + 1}/{cfg.rounds} {u}: {r['wall_s']:.0f} s, peak RSS {mem['peak_rss_gb']:.2f} "
                f"GB (anonymous {mem['peak_anon_gb']:.2f} GB, mapped files {mem['peak_file_gb']:.2f} GB)")
            res["rows"] += [{**row, **mem, "round": n} for row in r["result"]["rows"]]
            res["gemv_classes"] += r["result"].get("gemv_classes", [])
            res["units"].append({**u, "round": n, "wall_s": r["wall_s"], **mem})
            if u["keep"] is None and u["system"] != "gemv_classes" and not n and "lm_head" not in u:
                first[(u["system"], u["dtype"])] = torch.load(logits, weights_only=True)
    res["rows"] = median_rows(res["rows"])
    res["equivalence"] = [{"dtype": dt, **compare_greedy(a["tokens"], a["logits"], b["tokens"], b["logits"])}
                          for (s, dt), a in first.items() if s == "llamacpp_dense"
                          for b in [first.get(("lowrank_lib_dense", dt))] if b is not None]
    res["load_average"]["end"] = load_average()
    if cfg.cleanup:
        res["cleaned_up"] = cleanup(cfg)
    return judged(res)


def median_rows(rows: list[dict]) -> list[dict]:
    """One row per (system, dtype, keep, factor bits, head, threads): its round of median decode time (the lower
    middle of an even count), with every round's decode ms/token and copy GB/s in ``rounds`` (round order)."""
    key = lambda r: tuple(str(r.get(k)) for k in (*ROW_KEYS[:5], "factor_bits", "lm_head"))       # noqa: E731
    return [{**sorted(g, key=lambda r: r["decode_ms_per_token"])[(len(g) - 1) // 2],
             "rounds": [{k: r[k] for k in ("round", "decode_ms_per_token", "copy_gbs")} for r in g]}
            for g in ([r for r in rows if key(r) == k] for k in dict.fromkeys(map(key, rows)))]


def cleanup(cfg: ScaleConfig) -> list[str]:
    """Delete the generated weights, factors and GGUFs of this shape / seed / layer count."""
    gone = [shape_dir(cfg.shape, k, cfg.seed, cfg.layers, cfg.cache_dir, cfg.overrides) for k in (None, *cfg.keeps)]
    for d in gone:
        shutil.rmtree(d, ignore_errors=True)
    return [str(d) for d in gone]


# --------------------------------------------------------------------------- the table and the figure
def table(res: dict) -> str:
    """:func:`~.peer_base.format_table` with the GEMV classes and the equivalence per dtype."""
    return format_table(res, [
        f"GEMV classes, {g['dtype']}, keep {g['keep']}, {g['threads']} thread(s), copy {g['copy_gbs']:.1f} GB/s: "
        + ", ".join(f"{c['class']} {c['GBps']:.1f}" for c in g["classes"])
        for g in res.get("gemv_classes", []) if "classes" in g] + [equivalence_line(e) for e in res["equivalence"]]
        + below_host_lines(res) + failed_lines(res))


def save_figures(results: list[dict], fig_dir, threads: int = 1) -> str:
    """``peer_scale_decode_vs_bytes.png``: decode ms/token against weight bytes per token, one log-log panel per
    shape, every system at ``threads``; the copy-bandwidth roofline (bytes / the rows' mean copy GB/s) dotted."""
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for res in results for r in res["rows"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.4 * len(shapes), 5.0), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for res in results for r in res["rows"] if r["shape"] == shape and r["threads"] == threads]
        draw_decode_vs_bytes(ax, rows, sum(r["copy_gbs"] for r in rows) / len(rows) if rows else None, log=True)
        ax.set_title(f"{shape}, {threads} thread(s)")
    fig.tight_layout()
    return save_figure(fig, Path(fig_dir) / "peer_scale_decode_vs_bytes.png")


def committed_results(out_dir="benchmarks/results") -> list[dict]:
    """The newest committed full-size result of each shape (``peer_scale_<shape>*.json``, no reduced layers)."""
    best = {}
    for p in sorted(Path(out_dir).glob("peer_scale_*.json"), key=lambda p: p.stat().st_mtime):
        r = json.loads(p.read_text())
        if r["config"].get("layers") is None and not r["config"].get("overrides") and r.get("rows"):
            best[r["config"]["shape"]] = r
    return list(best.values())
