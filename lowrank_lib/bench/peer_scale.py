"""``bench peer --shape``: llama.cpp against lowrank_lib at the geometries users run, one system per process.

    python -m lowrank_lib.bench peer --shape llama3.2-1b            # bf16 + fp32, keep 0.5 / 0.8, 1 and 2 threads
    python -m lowrank_lib.bench peer --shape llama2-7b              # bf16

Random weights at the real geometry (``lowrank_lib.models.SHAPES``: decode speed does not depend on the
values), written once as memory-mapped safetensors shards (``lowrank_lib.models.write_shape_weights``):
the dense bf16 model and, per keep, random factors of the canonical ranks. Systems (``rows[].system``):

=======================  =====================================================================================
``llamacpp_dense``       llama.cpp (``llama-cpp-python``) on a GGUF written by OUR exporter from the SAME dense
                         weights (``gguf_export.write_hf_gguf``, F32 / BF16, verified tensor by tensor), and on
                         ``Q8_0`` / ``Q4_K_M`` files made from the BF16 one by llama.cpp's own quantizer
                         (``rows[].dtype`` = q8_0 / q4_k_m; KV cache bf16): what a user picks instead of low rank
``lowrank_lib_dense``    our Engine on the dense weights (compiled step, our kernels where they run)
``lowrank_lib_lowrank``  our Engine on the random keep-``keep`` factors (``rows[].keep``)
=======================  =====================================================================================

Every (system, dtype, keep) runs in its OWN child process (``python -m lowrank_lib.bench.peer_scale
--worker``): a 7B dense model (13.5 GB in bf16) and its factors never share the machine's memory. A child
runs every thread count (copy bandwidth measured by the child before and after each, the median is the
row's ``copy_gbs``): a warm-up generation (our engine compiles its step there, timed apart), then
``repeats`` generations of ``gen_len`` greedy tokens after a ``prompt_len`` prompt of seeded random ids;
decode ms/token = median over every step, with its quartiles (``peer.decode_stats``, through
``bench.timing.summary``). The children run one after another, in a fixed order; the load average before
and after each is recorded (what else ran shows there). The systems are NOT interleaved round by round
(``bench.timing.interleaved``, as the SmolLM2 peer does): that needs every system alive in one process, which
is what this design rules out at 7B, and interleaving thread counts inside a child would recompile the step
(inductor fixes its thread count) every round. So ratios across children carry the drift of a shared
machine between them: run it on an idle machine, and read ``load_average`` and ``copy_gbs`` per row. The parent compares the
children's prefill logits and greedy tokens at the same dtype (``equivalence``: random weights have tiny
logit margins, so bf16 tokens may part early; the logit difference is the check).

A last child per dtype times each GEMV class of the geometry alone (``bench.gemv_classes``: the kernel's
GB/s per class, dense and every keep, beside the copy bandwidth), ``gemv_classes`` in the result.

Writes ``<out>/peer_scale_<shape>[_L<layers>].json`` through :class:`~lowrank_lib.bench.results.ResultFiles`
(never overwritten; rows: shape, system, dtype, threads, keep, decode_ms_per_token,
weight_bytes_per_token, copy_gbs, roofline_x and more) and ``figures/peer_scale_decode_vs_bytes.png``
(every committed shape result, or the ones given to ``--replot``).
"""
from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .peer import KV_FOR_DTYPE, SYSTEMS

#: llama.cpp's quantized file types (``llamacpp.QUANT_TYPES``) and their KV cache type
QUANTS = ("q8_0", "q4_k_m")
#: dtypes run by default at each shape (the issue: bf16 at both, fp32 at 1B)
DEFAULT_DTYPES = {"llama3.2-1b": ("bf16", "fp32"), "llama2-7b": ("bf16",)}
#: issue 22's targets
SPEEDUP_TARGETS = {("llama2-7b", 0.5): 1.8, ("llama2-7b", 0.8): 1.15}
ROOFLINE_TARGET = 1.2
ROW_KEYS = ("shape", "system", "dtype", "threads", "keep", "decode_ms_per_token", "weight_bytes_per_token", "copy_gbs",
            "roofline_x")


@dataclass
class ScaleConfig:
    shape: str = "llama3.2-1b"
    keeps: tuple[float, ...] = (0.5, 0.8)
    dtypes: tuple[str, ...] | None = None          # None: DEFAULT_DTYPES[shape]
    threads: tuple[int, ...] = (1, 2)
    quants: tuple[str, ...] = QUANTS
    systems: tuple[str, ...] = SYSTEMS
    prompt_len: int = 512
    gen_len: int = 64
    repeats: int = 3
    layers: int | None = None                       # a reduced layer count (dry runs, tests)
    overrides: dict = field(default_factory=dict)   # other geometry fields replaced (tests: a small vocabulary)
    graph: str = "whole-step"
    llama_flash_attn: str = "on"                    # "on" | "off" (llama-bench's CPU default is on)
    lm_head: str = "exact"
    gemv_classes: bool = True                       # also time each GEMV class of the geometry (bench/gemv_classes.py)
    seed: int = 0
    out: str = "benchmarks/results"
    cache_dir: str | None = None                    # the random weights and GGUFs; None = the model cache
    cleanup: bool = False                           # delete this shape's generated files after the run
    note: str = ""
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        from ..models import SHAPES

        if self.shape not in SHAPES:
            raise SystemExit(f"unknown shape {self.shape!r}: use one of {sorted(SHAPES)}")
        if self.dtypes is None:
            self.dtypes = DEFAULT_DTYPES.get(self.shape, ("bf16",))
        bad = [d for d in self.dtypes if d not in KV_FOR_DTYPE]
        if bad:
            raise SystemExit(f"unknown dtypes {bad}; choose from {sorted(KV_FOR_DTYPE)}")
        bad = [q for q in self.quants if q not in QUANTS]
        if bad:
            raise SystemExit(f"unknown llama.cpp quantizations {bad}; choose from {QUANTS}")
        bad = [s for s in self.systems if s not in SYSTEMS]
        if bad:
            raise SystemExit(f"unknown systems {bad}; choose from {SYSTEMS}")

    def slug(self) -> str:
        from .results import slug

        return slug(self.shape, None if self.layers is None else f"L{self.layers}", "o" if self.overrides else None)


# --------------------------------------------------------------------------- the units (one child each)
def units(cfg: ScaleConfig) -> list[dict]:
    """The (system, dtype, keep) of every child process, in run order."""
    out = []
    for dt in cfg.dtypes:
        if "llamacpp_dense" in cfg.systems:
            out.append({"system": "llamacpp_dense", "dtype": dt, "keep": None})
        if "lowrank_lib_dense" in cfg.systems:
            out.append({"system": "lowrank_lib_dense", "dtype": dt, "keep": None})
        if "lowrank_lib_lowrank" in cfg.systems:
            out += [{"system": "lowrank_lib_lowrank", "dtype": dt, "keep": k} for k in cfg.keeps]
    if "llamacpp_dense" in cfg.systems:
        out += [{"system": "llamacpp_dense", "dtype": q, "keep": None} for q in cfg.quants]
    if cfg.gemv_classes:
        out += [{"system": "gemv_classes", "dtype": dt, "keep": None} for dt in cfg.dtypes]
    return out


def gguf_dir(cfg: ScaleConfig) -> Path:
    from ..models import shape_dir

    return shape_dir(cfg.shape, None, cfg.seed, cfg.layers, cfg.cache_dir, cfg.overrides) / "gguf"


def gguf_path(cfg: ScaleConfig, dtype: str) -> Path:
    name = {"fp32": "F32", "bf16": "BF16", "q8_0": "Q8_0", "q4_k_m": "Q4_K_M"}[dtype]
    return gguf_dir(cfg) / f"model.{name}.gguf"


def disk_needed(cfg: ScaleConfig) -> int:
    """Bytes the generated files take (weights, factors, GGUFs), estimated from the geometry."""
    from ..ranks import keep_rank
    from ..models import proj_shapes, shape_config

    c = shape_config(cfg.shape, cfg.layers, cfg.overrides)
    proj = proj_shapes(c)
    dense = sum(o * i for o, i in proj.values()) * c.num_hidden_layers
    emb = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    n = {"dense": 2 * (dense + emb)}
    for k in cfg.keeps:
        n[f"keep{k}"] = 2 * c.num_hidden_layers * sum(keep_rank(o, i, k) * (o + i) for o, i in proj.values())
    per = {"fp32": 4, "bf16": 2, "q8_0": 34 / 32, "q4_k_m": 0.6}
    for dt in set(cfg.dtypes) | {"bf16"} | set(cfg.quants):
        n[dt] = per[dt] * (dense + emb)
    return int(sum(n.values()))


def prepare(cfg: ScaleConfig, log=print) -> dict:
    """Write (once) the random weights, the GGUFs of our exporter and llama.cpp's quantized files.

    Runs in a child process (the mapped model pages are released with it). Every GGUF is verified
    against the weights tensor by tensor after writing (bit-equal; BF16 = the bf16 weights), its size
    recorded in a marker beside it; a later run reuses files whose marker matches."""
    from . import gguf_export as ge
    from ..models import load_shape_model, write_shape_weights

    t0 = time.perf_counter()
    for k in (None, *cfg.keeps):
        if k is None or "lowrank_lib_lowrank" in cfg.systems:
            write_shape_weights(cfg.shape, k, cfg.seed, cfg.layers, cfg.cache_dir, overrides=cfg.overrides)
    d = gguf_dir(cfg)
    d.mkdir(parents=True, exist_ok=True)
    marker_p = d / ge.MARKER
    marker = json.loads(marker_p.read_text()) if marker_p.exists() else {}
    want_llama = "llamacpp_dense" in cfg.systems
    need = sorted(set(cfg.dtypes) | ({"bf16"} if cfg.quants else set())) if want_llama else []
    model = None
    for dt in need:
        p = gguf_path(cfg, dt)
        if not (p.exists() and marker.get(dt, {}).get("size") == p.stat().st_size):
            model = model or load_shape_model(cfg.shape, None, cfg.seed, cfg.layers, cfg.cache_dir,
                                              overrides=cfg.overrides)
            log(f"[peer-scale] writing {p} ({dt})")
            ge.write_hf_gguf(model, p, ge.GGUF_TYPES[dt][0], name=f"random {cfg.shape}", progress=True)
            res = ge.verify_gguf(p, model.state_dict(), dt)
            marker[dt] = {"size": p.stat().st_size, "verify": res}
            marker_p.write_text(json.dumps(marker, indent=1))
    del model
    if want_llama:
        from .llamacpp import quantize

        for q in cfg.quants:
            p = gguf_path(cfg, q)
            if not (p.exists() and marker.get(q, {}).get("size") == p.stat().st_size):
                log(f"[peer-scale] llama.cpp quantizer: {gguf_path(cfg, 'bf16').name} -> {p.name}")
                quantize(gguf_path(cfg, "bf16"), p, q)
                marker[q] = {"size": p.stat().st_size, "from": gguf_path(cfg, "bf16").name}
                marker_p.write_text(json.dumps(marker, indent=1))
    return {"seconds": time.perf_counter() - t0, "gguf": marker}


# --------------------------------------------------------------------------- one child
def _status_gb(key: str) -> float | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2 ** 20
    except OSError:
        pass
    return None


def run_unit(cfg: ScaleConfig, unit: dict, logits_path: str | None = None, progress: bool = True) -> dict:
    """One system at every thread count, in this process. Returns ``{"rows": [...], ...}``."""
    import numpy as np
    import torch
    from tqdm.auto import tqdm

    from ..generation import run_generation
    from ..runtime.config import parse_dtype
    from .decode import copy_bandwidth, read_bandwidth
    from ..models import load_shape_model, shape_config
    from .peer import CpuClocked, decode_stats, gguf_bytes_per_token, median_ms
    from .results import load_average

    system, dtype, keep = unit["system"], unit["dtype"], unit["keep"]
    c = shape_config(cfg.shape, cfg.layers, cfg.overrides)
    ids = torch.randint(0, c.vocab_size, (1, cfg.prompt_len), generator=torch.Generator().manual_seed(cfg.seed))
    S = cfg.prompt_len + cfg.gen_len
    t0 = time.perf_counter()
    if system == "llamacpp_dense":
        from .llamacpp import LlamaCppRunner

        path = gguf_path(cfg, dtype)
        kv = KV_FOR_DTYPE.get(dtype, "bf16")
        runner = LlamaCppRunner(path, n_ctx=S, threads=cfg.threads[0], kv_type=kv,
                                flash_attn=cfg.llama_flash_attn == "on")
        wb = gguf_bytes_per_token(path)
    else:
        from ..runtime import Engine, EngineConfig

        model = load_shape_model(cfg.shape, keep, cfg.seed, cfg.layers, cfg.cache_dir, progress=False,
                                 overrides=cfg.overrides)
        torch.set_num_threads(cfg.threads[0])
        runner = Engine(model, EngineConfig(max_batch=1, max_seq_len=S, dtype=parse_dtype(dtype), graph=cfg.graph,
                                            lm_head=cfg.lm_head))
        del model                                   # the engine holds its own (packed) copy; the file pages go
    build_s = time.perf_counter() - t0
    rows, first = [], None
    for th in cfg.threads:
        torch.set_num_threads(th)
        if system == "llamacpp_dense":
            runner.set_threads(th)
        elif runner.graphs is not None:
            runner.graphs.invalidate()               # inductor fixes its thread count: compile afresh
            torch._dynamo.reset()
        r = CpuClocked(runner)
        bws = [copy_bandwidth(torch.device("cpu"))]
        rbws = [read_bandwidth(torch.device("cpu"))]
        la0 = load_average()
        tw = time.perf_counter()
        warm = run_generation(r, ids, cfg.gen_len if first is None else min(4, cfg.gen_len),
                              return_logits=first is None)
        warm_s = time.perf_counter() - tw
        if first is None:
            first = warm
        r.cpu_s.clear()
        steps, pre = [], []
        if hasattr(runner, "lm_head") and hasattr(runner.lm_head, "reset_stats"):
            runner.lm_head.reset_stats()
        for _ in tqdm(range(cfg.repeats), desc=f"{system} {dtype} keep={keep} {th}t", disable=not progress,
                      leave=False):
            o = run_generation(r, ids, cfg.gen_len)
            steps += o.step_s
            pre.append(o.prefill_s)
        bws.append(copy_bandwidth(torch.device("cpu")))
        rbws.append(read_bandwidth(torch.device("cpu")))
        bw, rbw = statistics.median(bws), statistics.median(rbws)
        dec = decode_stats(steps)
        ms = dec["decode_ms_per_token"]
        w = wb if system == "llamacpp_dense" else runner.weight_bytes_per_token()
        row = {"shape": cfg.shape, "layers": c.num_hidden_layers, "system": system, "dtype": dtype, "threads": th,
               "keep": keep, **dec, "weight_bytes_per_token": w, "copy_gbs": bw,
               "copy_gbs_before_after": bws, "roofline_ms": w / (bw * 1e9) * 1e3,
               "roofline_x": ms / 1e3 / (w / (bw * 1e9)), "achieved_GBps": w / (ms / 1e3) / 1e9,
               "read_gbs": rbw, "read_roofline_x": ms / 1e3 / (w / (rbw * 1e9)),
               "prefill_ms": median_ms(pre),
               "decode_cpu_ms_per_token": median_ms(r.cpu_s) if th == 1 else None,
               "warmup_s": warm_s, "load_average": {"before": la0, "after": load_average()}}
        if system == "llamacpp_dense":
            row["info"] = {**runner.report(), "perf": runner.perf()}
        else:
            info = runner.report()
            row.update(compile_s=sum(x["seconds"] for x in info["compiles"]), gemv=info["gemv"],
                       gemv_reason=info["gemv_reason"], attention=info["backend"], lm_head=info["lm_head"],
                       info={k: v for k, v in info.items() if k not in ("config", "kv_store")})
        rows.append(row)
    if logits_path is not None and first is not None:
        np.save(logits_path, first.logits[0].float().numpy())
    if system == "llamacpp_dense":
        runner.close()
    return {"rows": rows, "build_s": build_s, "tokens": first.tokens[0].tolist() if first is not None else None,
            "peak_rss_gb": _status_gb("VmHWM"), "rss_anon_gb_end": _status_gb("RssAnon")}


def run_gemv_classes(cfg: ScaleConfig, dtype: str) -> dict:
    """:func:`lowrank_lib.bench.gemv_classes.measure` of the dense and every keep geometry, every thread count."""
    import torch

    from ..runtime.config import parse_dtype
    from .gemv_classes import measure
    from ..models import shape_config

    c = shape_config(cfg.shape, cfg.layers, cfg.overrides)
    out = []
    for th in cfg.threads:
        torch.set_num_threads(th)
        for k in (None, *cfg.keeps):
            out.append(measure(c, k, parse_dtype(dtype)))
    return {"rows": [], "gemv_classes": out, "build_s": 0.0, "tokens": None, "peak_rss_gb": _status_gb("VmHWM"),
            "rss_anon_gb_end": _status_gb("RssAnon")}


class MemorySampler:
    """Peak anonymous and file-backed resident memory of this process, sampled every ``period`` s in a thread.

    ``VmHWM`` (the kernel's peak RSS) counts the pages of memory-mapped weight files too, which the OS can
    drop at any time; the anonymous peak is what the process itself holds (weights packed by the engine,
    llama.cpp's buffers, the KV cache)."""

    def __init__(self, period: float = 0.2):
        import threading

        self.period, self.peak = period, {"RssAnon": 0.0, "RssFile": 0.0}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self):
        while not self._stop.wait(self.period):
            for k in self.peak:
                v = _status_gb(k)
                if v is not None:
                    self.peak[k] = max(self.peak[k], v)

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        return {"peak_anon_gb": self.peak["RssAnon"], "peak_file_gb": self.peak["RssFile"]}


def worker_main(argv: list[str]) -> int:
    """``python -m lowrank_lib.bench.peer_scale --worker SPEC.json`` (a child of :func:`run_scale`)."""
    spec = json.loads(Path(argv[argv.index("--worker") + 1]).read_text())
    mem = MemorySampler()
    cfg = ScaleConfig(**{**spec["config"], "keeps": tuple(spec["config"]["keeps"]),
                         "dtypes": tuple(spec["config"]["dtypes"]), "threads": tuple(spec["config"]["threads"]),
                         "quants": tuple(spec["config"]["quants"]), "systems": tuple(spec["config"]["systems"])})
    if spec["unit"] == "prepare":
        res = prepare(cfg, log=lambda m: print(m, file=sys.stderr, flush=True))
    elif spec["unit"]["system"] == "gemv_classes":
        res = run_gemv_classes(cfg, spec["unit"]["dtype"])
    else:
        res = run_unit(cfg, spec["unit"], spec.get("logits"))
    res.update(mem.stop())
    Path(spec["result"]).write_text(json.dumps(res, default=str))
    return 0


def _child(cfg: ScaleConfig, unit, tmp: Path, i: int, log) -> dict:
    """Run one unit in a child process; returns its result with the child's peak RSS (``os.wait4``)."""
    spec = {"config": asdict(cfg), "unit": unit, "result": str(tmp / f"r{i}.json"),
            "logits": str(tmp / f"logits{i}.npy")}
    sp = tmp / f"spec{i}.json"
    sp.write_text(json.dumps(spec))
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "lowrank_lib.bench.peer_scale", "--worker", str(sp)], env=env)
    _, status, ru = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"peer-scale child for {unit} failed with exit code {proc.returncode} (its stderr is above)")
    res = json.loads(Path(spec["result"]).read_text())
    res["wall_s"] = time.perf_counter() - t0
    res["child_maxrss_gb"] = ru.ru_maxrss / 2 ** 20
    res["logits"] = spec["logits"]
    log(f"[peer-scale] {unit}: {res['wall_s']:.0f} s, peak RSS {res['child_maxrss_gb']:.2f} GB (anonymous "
        f"{res.get('peak_anon_gb', float('nan')):.2f} GB, mapped files {res.get('peak_file_gb', float('nan')):.2f} GB)")
    return res


# --------------------------------------------------------------------------- the whole run
def run_scale(cfg: ScaleConfig, log=print) -> dict:
    """Prepare the files, run every unit in its own process, compare and summarise (see the module docstring)."""
    import platform

    import numpy as np
    import torch

    from .llamacpp import available, version
    from .peer import cpu_name, nproc
    from .results import load_average

    if "llamacpp_dense" in cfg.systems:
        ok, why = available()
        if not ok:
            raise SystemExit(f"peer benchmark: {why}")
    from .. import models

    root = Path(cfg.cache_dir) if cfg.cache_dir else models.default_cache_dir() / "random-models"
    root.mkdir(parents=True, exist_ok=True)
    need, free = disk_needed(cfg), shutil.disk_usage(root).free
    if need > free:
        raise SystemExit(f"peer --shape {cfg.shape}: the generated files need about {need / 1e9:.1f} GB, "
                         f"{root} has {free / 1e9:.1f} GB free")
    res = {"config": asdict(cfg), "command": None, "units": [],
           "machine": {"cpu": cpu_name(), "cores": nproc(), "torch": torch.__version__,
                       "llama_cpp_python": version(), "python": platform.python_version()},
           "load_average": {"start": load_average()}, "disk_needed_gb": need / 1e9, "note": cfg.note,
           "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="peer-scale-") as td:
        tmp = Path(td)
        res["prepare"] = _child(cfg, "prepare", tmp, 0, log)
        rows, outs, classes = [], [], []
        for i, u in enumerate(units(cfg), 1):
            r = _child(cfg, u, tmp, i, log)
            classes += r.get("gemv_classes", [])
            outs.append((u, r))
            mem = {k: r.get(k) for k in ("peak_rss_gb", "child_maxrss_gb", "peak_anon_gb", "peak_file_gb")}
            for row in r["rows"]:
                row.update(**mem, build_s=r["build_s"])
            rows += r["rows"]
            res["units"].append({**u, "wall_s": r["wall_s"], "build_s": r["build_s"], **mem,
                                 "rss_anon_gb_end": r["rss_anon_gb_end"]})
        res["rows"] = rows
        res["gemv_classes"] = classes
        res["equivalence"] = equivalence([(u, r) for u, r in outs if u["system"] != "gemv_classes"], np)
    res["load_average"]["end"] = load_average()
    res["comparisons"] = comparisons(res["rows"])
    res["targets"] = targets(res["comparisons"], res["rows"])
    if cfg.cleanup:
        res["cleaned_up"] = cleanup(cfg)
    return res


def equivalence(outs, np) -> list[dict]:
    """Per dtype: llama.cpp dense against our dense engine on the same prompt: prefill logits and greedy tokens."""
    by = {(u["system"], u["dtype"]): r for u, r in outs if u["keep"] is None}
    out = []
    for (s, dt), a in by.items():
        b = by.get(("lowrank_lib_dense", dt))
        if s != "llamacpp_dense" or b is None:
            continue
        la, lb = np.load(a["logits"]), np.load(b["logits"])
        ta, tb = a["tokens"], b["tokens"]
        n = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        out.append({"dtype": dt, "prefill_max_abs_logit_diff": float(np.abs(la - lb).max()),
                    "logit_scale": float(np.abs(lb).max()), "prefill_argmax_equal": int(la.argmax()) == int(lb.argmax()),
                    "tokens_equal_before_divergence": n, "n_tokens": len(ta)})
    return out


def comparisons(rows: list[dict]) -> list[dict]:
    """Per (dtype, threads) of each shape: every lowrank_lib row against llama.cpp dense of that dtype."""
    out = []
    ref = {(r["shape"], r["dtype"], r["threads"]): r for r in rows if r["system"] == "llamacpp_dense"}
    for r in rows:
        if r["system"] == "llamacpp_dense":
            continue
        ll = ref.get((r["shape"], r["dtype"], r["threads"]))
        out.append({"shape": r["shape"], "system": r["system"], "dtype": r["dtype"], "threads": r["threads"],
                    "keep": r["keep"], "roofline_x": r["roofline_x"],
                    "speedup_vs_llamacpp_dense": ll["decode_ms_per_token"] / r["decode_ms_per_token"] if ll else None,
                    "bytes_vs_llamacpp_dense": r["weight_bytes_per_token"] / ll["weight_bytes_per_token"] if ll else None})
    return out


def targets(comps: list[dict], rows: list[dict]) -> list[dict]:
    """Issue 22's targets (1 thread): 7B bf16 speedups, every low-rank row within 1.2x of its roofline, our
    dense engine at least as fast as llama.cpp dense at every shape and dtype."""
    out = []
    for c in comps:
        if c["threads"] != 1:
            continue
        if c["system"] == "lowrank_lib_lowrank":
            out.append({**{k: c[k] for k in ("shape", "dtype", "keep")}, "target": "roofline_x", "bound": ROOFLINE_TARGET,
                        "measured": c["roofline_x"], "met": c["roofline_x"] <= ROOFLINE_TARGET})
            b = SPEEDUP_TARGETS.get((c["shape"], c["keep"]))
            if b is not None and c["dtype"] == "bf16" and c["speedup_vs_llamacpp_dense"] is not None:
                out.append({**{k: c[k] for k in ("shape", "dtype", "keep")}, "target": "speedup_vs_llamacpp_dense",
                            "bound": b, "measured": c["speedup_vs_llamacpp_dense"],
                            "met": c["speedup_vs_llamacpp_dense"] >= b})
        elif c["system"] == "lowrank_lib_dense" and c["speedup_vs_llamacpp_dense"] is not None:
            out.append({**{k: c[k] for k in ("shape", "dtype", "keep")}, "target": "dense_speedup_vs_llamacpp_dense",
                        "bound": 1.0, "measured": c["speedup_vs_llamacpp_dense"],
                        "met": c["speedup_vs_llamacpp_dense"] >= 1.0})
    return out


def cleanup(cfg: ScaleConfig) -> list[str]:
    """Delete the generated weights, factors and GGUFs of this shape / seed / layer count."""
    from ..models import shape_dir

    gone = []
    for k in (None, *cfg.keeps):
        d = shape_dir(cfg.shape, k, cfg.seed, cfg.layers, cfg.cache_dir, cfg.overrides)
        if d.exists():
            shutil.rmtree(d)
            gone.append(str(d))
    return gone


# --------------------------------------------------------------------------- tables and the figure
def _label(r: dict) -> str:
    if r["system"] == "llamacpp_dense":
        return f"llama.cpp {r['dtype']}"
    if r["system"] == "lowrank_lib_dense":
        return f"lowrank_lib dense {r['dtype']}"
    return f"lowrank_lib keep {r['keep']} {r['dtype']}"


def format_table(res: dict) -> str:
    lines = ["shape | system | dtype | keep | threads | decode ms/tok | MB/tok | GB/s | copy GB/s | x roofline | "
             "read GB/s | x read roofline | prefill ms", "---|---|---|---|---|---|---|---|---|---|---|---|---"]
    for r in sorted(res["rows"], key=lambda r: (r["shape"], r["threads"], r["dtype"], r["system"], r["keep"] or 1)):
        lines.append(f"{r['shape']} | {r['system']} | {r['dtype']} | {r['keep'] if r['keep'] is not None else '-'} | "
                     f"{r['threads']} | {r['decode_ms_per_token']:.1f} | {r['weight_bytes_per_token'] / 1e6:.0f} | "
                     f"{r['achieved_GBps']:.1f} | {r['copy_gbs']:.1f} | {r['roofline_x']:.2f} | "
                     f"{r.get('read_gbs', float('nan')):.1f} | {r.get('read_roofline_x', float('nan')):.2f} | "
                     f"{r['prefill_ms']:.0f}")
    for t in res.get("targets", []):
        lines.append(f"target {t['target']} ({t['shape']}, {t['dtype']}, keep {t['keep']}): {t['measured']:.2f} vs "
                     f"{'<=' if t['target'] == 'roofline_x' else '>='} {t['bound']}: " + ("met" if t["met"] else "NOT met"))
    for g in res.get("gemv_classes", []):
        if "classes" in g:
            lines.append(f"GEMV classes, {g['dtype']}, keep {g['keep']}, {g['threads']} thread(s), copy {g['copy_gbs']:.1f} "
                         "GB/s: " + ", ".join(f"{c['class']} {c['GBps']:.1f}" for c in g["classes"]))
    for e in res.get("equivalence", []):
        lines.append(f"llama.cpp vs lowrank_lib dense, {e['dtype']}: prefill max |logit diff| "
                     f"{e['prefill_max_abs_logit_diff']:.3g} (scale {e['logit_scale']:.3g}), greedy tokens equal for "
                     f"{e['tokens_equal_before_divergence']} of {e['n_tokens']}")
    return "\n".join(lines)


_COLOR = {"fp32": "tab:blue", "bf16": "tab:orange", "q8_0": "tab:green", "q4_k_m": "tab:red"}


def plot_scale(results: list[dict], threads: int = 1):
    """Decode ms/token against weight bytes per token, one panel per shape (log-log), every system at
    ``threads``; the copy-bandwidth roofline (bytes / copy GB/s of the run) dotted. Returns the figure."""
    import matplotlib.pyplot as plt

    shapes = sorted({r["shape"] for res in results for r in res["rows"]})
    fig, axes = plt.subplots(1, len(shapes), figsize=(6.4 * len(shapes), 5.0), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        rows = [r for res in results for r in res["rows"] if r["shape"] == shape and r["threads"] == threads]
        for r in rows:
            mk = {"llamacpp_dense": "s", "lowrank_lib_dense": "o", "lowrank_lib_lowrank": "*"}[r["system"]]
            ax.plot(r["weight_bytes_per_token"] / 1e6, r["decode_ms_per_token"], mk, color=_COLOR.get(r["dtype"], "gray"),
                    ms=12 if mk == "*" else 8, label=_label(r))
            if r["system"] == "lowrank_lib_lowrank":
                ax.annotate(f"{r['keep']}", (r["weight_bytes_per_token"] / 1e6, r["decode_ms_per_token"]),
                            textcoords="offset points", xytext=(-8, 8), fontsize=8)
        if rows:
            bw = statistics.median(r["copy_gbs"] for r in rows)
            xs = [min(r["weight_bytes_per_token"] for r in rows) / 1e6 * 0.8,
                  max(r["weight_bytes_per_token"] for r in rows) / 1e6 * 1.2]
            ax.plot(xs, [x * 1e6 / (bw * 1e9) * 1e3 for x in xs], ":", color="k", lw=1,
                    label=f"roofline (copy {bw:.1f} GB/s)")
        ax.set(xscale="log", yscale="log", xlabel="weight bytes per token (MB)", ylabel="decode ms/token",
               title=f"{shape}, {threads} thread(s)")
        ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    return fig


def save_figure(results: list[dict], fig_dir, threads: int = 1) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig_dir = Path(fig_dir)
    fig_dir.mkdir(parents=True, exist_ok=True)
    p = fig_dir / "peer_scale_decode_vs_bytes.png"
    fig = plot_scale(results, threads)
    fig.savefig(p, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return p


def committed_results(out_dir="benchmarks/results") -> list[dict]:
    """The newest committed full-size result of each shape (``peer_scale_<shape>*.json``, no reduced layers)."""
    best = {}
    for p in sorted(Path(out_dir).glob("peer_scale_*.json"), key=lambda p: p.stat().st_mtime):
        r = json.loads(p.read_text())
        if r.get("config", {}).get("layers") is None and not r["config"].get("overrides") and r.get("rows"):
            best[r["config"]["shape"]] = r
    return list(best.values())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--worker" in argv:
        return worker_main(argv)
    from .cli import main as cli_main

    return cli_main(["peer", *argv])


if __name__ == "__main__":
    raise SystemExit(main())
