"""Checkpoints of the size users have: every family written at a real model's shape, loaded in a child process.

Per family the checkpoint is written with random weights at a model geometry (Llama-3.2-1B by default, LLaMA-7B on
request) by :func:`lowrank_lib.synthetic.write_family` (the native writer streaming zero-page placeholders, then
filled in place with random finite bytes: the model is never held in memory).

The load runs in a child process (:func:`load_jobs` through :mod:`lowrank_lib.bench.child`), so its peak RSS
(``VmHWM``) is the loader's alone: the baseline RSS after ``import lowrank_lib, transformers`` is recorded, the peak
is reset (``/proc/self/clear_refs``) before each load, and the row holds the file bytes, the loaded model's
bytes, wall time, peak RSS and the contract ``peak - baseline <= 1.15 x model + 0.5 GB``. Before a
load the files are read once (a warm page cache: what the 1 GB/s target is about), timed as
``cache_read_GBps``. A *refusal* row writes the SVD-LLM file with a tokenizer that pickles a global
the allow-list refuses (after every tensor of the model) and times its refusal.
"""
from __future__ import annotations

import shutil
import time
from pathlib import Path

import torch

from ..synthetic import SHAPES, RefusedTokenizer, families_format, synthetic_tokenizer, write_family

GB = 1 << 30          # GiB: sizes in the tables; throughput is file bytes / 1e9 per second


def file_bytes(path: Path) -> int:
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def warm_read(path: Path) -> float:
    """Read every file of the checkpoint once (into the page cache); returns GB/s of that read."""
    t0, n = time.perf_counter(), 0
    for p in ([path] if Path(path).is_file() else sorted(q for q in Path(path).rglob("*") if q.is_file())):
        with open(p, "rb", buffering=0) as fh:
            while b := fh.read(16 << 20):
                n += len(b)
    return n / max(time.perf_counter() - t0, 1e-9) / 1e9


# --------------------------------------------------------------------------- the child process
def load_jobs(jobs: list[dict]) -> list[dict]:
    """In a child (:func:`load_in_child`): ``load_checkpoint`` of every job ({path, dtype}) in turn, one row each:
    wall time, peak RSS (``VmHWM``, reset before each load through ``/proc/self/clear_refs``), the baseline RSS
    before it, the loaded model's bytes and dtypes, or the :class:`~lowrank_lib.formats.CheckpointError`."""
    import gc

    from transformers import LlamaForCausalLM  # noqa: F401  (imported before the baseline: part of any load)

    from ..formats import CheckpointError, load_checkpoint
    from ..host import status_bytes

    rows = []
    for job in jobs:
        gc.collect()
        try:
            Path("/proc/self/clear_refs").write_text("5")           # VmHWM := VmRSS (Linux >= 4.0)
            reset = True
        except OSError:
            reset = False
        row = {"reset_peak": reset, "baseline_rss": status_bytes("VmRSS")}
        t0 = time.perf_counter()
        try:
            dt = job["dtype"] or "stored"        # "int8" / "int4": the factors served quantized (Dobi remap: its codes)
            kw = {"factor_bits": int(dt[3:])} if dt.startswith("int") else {"dtype": {
                "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(dt)}
            m = load_checkpoint(job["path"], progress=False, **kw)
            row.update(wall_s=time.perf_counter() - t0, peak_rss=status_bytes("VmHWM"), ok=True,
                       model_bytes=sum(t.numel() * t.element_size() for t in
                                       {t.data_ptr(): t for t in [*m.parameters(), *m.buffers()]}.values()),
                       dtypes=m.lowrank_meta.get("dtypes"), meta_family=m.lowrank_meta.get("family"),
                       n_factorized=len(m.lowrank_meta.get("ranks", {})))
            del m
        except CheckpointError as e:
            row.update(wall_s=time.perf_counter() - t0, peak_rss=status_bytes("VmHWM"), ok=False,
                       error=type(e).__name__, message=str(e)[:300])
        rows.append(row)
    return rows


def load_in_child(jobs: list[dict], timeout: float = 1800) -> list[dict]:
    """:func:`load_jobs` on ``jobs`` ([{path, dtype}]) in one fresh interpreter (:mod:`lowrank_lib.bench.child`)."""
    from .child import run_child

    return run_child("lowrank_lib.bench.load:load_jobs", timeout,
                     jobs=[{"path": str(j["path"]), "dtype": j.get("dtype")} for j in jobs])["result"]


def contract(row: dict) -> dict:
    """The memory and speed contract of one successful row (the README's numbers)."""
    over = row["peak_rss"] - row["baseline_rss"]
    limit = 1.15 * row["model_bytes"] + 0.5e9
    return {"peak_over_baseline": over, "rss_limit": int(limit), "within_rss_limit": over <= limit,
            "file_GBps": row["file_bytes"] / row["wall_s"] / 1e9}


# --------------------------------------------------------------------------- the benchmark
def run_rows(shape: str, families: list[str], dtypes: dict[str, list], workdir: Path, keep: float = 0.8,
             refusal: bool = True, one_child_per_row: bool = True, log=print, extra: list[dict] = ()) -> list[dict]:
    """Write, warm, load (in a child) and delete each family's checkpoint at ``shape``; one row per (family,
    dtype), plus the refusal row. ``dtypes``: family -> list of "stored" / "float32" / "bfloat16" / "int8" / "int4".
    ``one_child_per_row``: each load in its own child with only its file on disk (big files); else every load
    in one child after all are written (the tests' small files). ``extra``: rows ({family, shape, path, file_bytes})
    of files written elsewhere, loaded as stored last (in that same child) and left on disk."""
    tok = synthetic_tokenizer(SHAPES[shape]["vocab_size"])
    pending: list[tuple[dict, dict]] = []
    rows, written = [], []

    def flush():
        for (job, row), res in zip(pending, load_in_child([job for job, _ in pending]) if pending else []):
            row.update(res)
            if row["ok"]:
                row.update(contract(row))
            rows.append(row)
            log(table_row(row))
        pending.clear()

    for fam, refused in [(fam, False) for fam in families] + ([("svdllm", True)] if refusal else []):
        d = workdir / f"{fam}{'-refused' if refused else ''}"
        d.mkdir(parents=True, exist_ok=True)
        written.append(d)
        t0 = time.perf_counter()
        path = write_family(fam, shape, d, keep, tokenizer=RefusedTokenizer() if refused else tok, fill=not refused)
        row = {"family": fam, "format": families_format(fam), "shape": shape, "keep": keep, "refusal": refused,
               "path": path.name, "write_s": round(time.perf_counter() - t0, 2), "file_bytes": file_bytes(path),
               "cache_read_GBps": round(warm_read(path), 2)}
        for dt in (["stored"] if refused else dtypes.get(fam, ["stored"])):
            if one_child_per_row:
                flush()
            pending.append(({"path": path, "dtype": dt}, {**row, "dtype": dt}))
        if one_child_per_row:           # big files: one at a time on disk
            flush()
            shutil.rmtree(d, ignore_errors=True)
    pending += [({"path": r["path"], "dtype": "stored"}, {**r, "refusal": False, "dtype": "stored"}) for r in extra]
    flush()
    for d in written:
        shutil.rmtree(d, ignore_errors=True)
    return rows


COLUMNS = "| family | shape | dtype | file GiB | model GiB | wall s | file GB/s | peak - baseline GiB | limit GiB | ok |"


def table_row(r: dict) -> str:
    """One row of :func:`format_table` (a failed or refused load: its error in the last column)."""
    if not r["ok"]:
        return (f"| {r['family']} ({'refused' if r['refusal'] else 'FAILED'}) | {r['shape']} | - | "
                f"{r['file_bytes'] / GB:.2f} | - | {r['wall_s']:.2f} | - | "
                f"{(r['peak_rss'] - r['baseline_rss']) / GB:.2f} | - | {r.get('error')}: {r.get('message', '')[:80]} |")
    return (f"| {r['family']} | {r['shape']} | {r['dtype']} | {r['file_bytes'] / GB:.2f} | {r['model_bytes'] / GB:.2f} | "
            f"{r['wall_s']:.2f} | {r['file_GBps']:.2f} | {r['peak_over_baseline'] / GB:.2f} | {r['rss_limit'] / GB:.2f} | "
            f"{'yes' if r['within_rss_limit'] else 'NO'} |")


def format_table(res: dict) -> str:
    return (f"checkpoint loads at shape {res['shape']} (keep {res['keep']}); {res['machine']}; load average "
            f"{res['load_average']}; copy bandwidth {res['copy_bandwidth_GBps']:.1f} GB/s\n\n{COLUMNS}\n"
            + "|---" * COLUMNS.count(" | ") + "|---|\n" + "\n".join(table_row(r) for r in res["rows"]))


__all__ = ["contract", "file_bytes", "format_table", "load_in_child", "load_jobs", "run_rows", "table_row", "warm_read"]
