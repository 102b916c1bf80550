"""A report on YOUR compressed model: every notebook that takes ``CHECKPOINT``, run on it (issue 28).

    python -m lowrank_lib.notebooks run --checkpoint PATH [--model DIR] [--params quick|full] --out reports/NAME

executes each such notebook with papermill into ``--out`` (``<out>/<nb>.ipynb``, ``<out>/<nb>/metrics.json``,
``<out>/figures/``), renders the offline HTML reports and ``<out>/index.html`` (:mod:`.html`), and prints one table:
which notebook measured what on which model. ``quick``: ``notebooks/params/quick.yaml`` (fewer, shorter runs for a
real 1B-8B model); ``full``: the notebooks' own defaults; or a parameter YAML's path. The checkpoint is read once:
the first notebook normalises it into the model cache (:func:`lowrank_lib.resolve.load_normalised`), the others map
that back. A checkpoint the loader refuses stops the run at the first notebook's first code cell, with the loader's
error.
"""
from __future__ import annotations

from pathlib import Path

from . import declared_parameters, notebooks_dir, on_disk, papermill_run, read_params, root

#: what ``--params`` names besides a YAML path
PARAMS = {"quick": "quick.yaml", "full": None}


def checkpoint_notebooks() -> list[str]:
    """The notebooks whose parameters cell declares ``CHECKPOINT``, in order."""
    return [n for n in on_disk() if "CHECKPOINT" in declared_parameters(notebooks_dir() / f"{n}.ipynb")]


def plan(name: str, checkpoint: str | Path, model: str | None, out: Path, params: str = "quick") -> dict:
    """The parameters notebook ``name`` runs with: ``params`` (quick / full / a YAML) for the names it declares,
    then ``CHECKPOINT`` (absolute), ``MODEL`` and the output folders under ``out``; ``DTYPE: auto`` becomes
    :func:`lowrank_lib.resolve.run_dtype`'s choice for the checkpoint (the dtype its model is loaded in)."""
    declared = declared_parameters(notebooks_dir() / f"{name}.ipynb")
    chosen = {}
    if params in PARAMS:
        path = notebooks_dir() / "params" / PARAMS[params] if PARAMS[params] else None
    else:
        path = Path(params)
    if path is not None:
        cfg = read_params(path)
        unknown = [k for k in cfg["overrides"].get(name, {}) if k not in declared]
        if unknown:
            raise ValueError(f"{path} overrides {unknown} for {name}, which its parameters cell does not declare")
        chosen.update(cfg["parameters"])
        chosen.update(cfg["overrides"].get(name, {}))
    chosen.update({"CHECKPOINT": str(Path(checkpoint).resolve()), "MODEL": model,
                   "OUT_DIR": str(out / name), "FIG_DIR": str(out / "figures")})
    if chosen.get("DTYPE") == "auto" and "DTYPE" in declared:    # the dtype the model is loaded in (resolve)
        from ..formats import CheckpointError
        from ..resolve import run_dtype

        try:
            chosen["DTYPE"] = run_dtype("auto", checkpoint)
        except CheckpointError:         # the notebook's first code cell stops with the loader's named error
            chosen["DTYPE"] = "fp32"
    return {k: v for k, v in chosen.items() if k in declared}


def run(checkpoint: str | Path, out: str | Path, model: str | None = None, params: str = "quick",
        names: list[str] | None = None, kernel: str = "python3", progress: bool = True) -> list[dict]:
    """Run ``names`` (default: :func:`checkpoint_notebooks`) on ``checkpoint`` into ``out``; one row per notebook
    (:func:`table`: what it ran on, its wall time and its kernel's peak RSS, its headline). A notebook that fails is a
    row with its error; a refused checkpoint stops the run there."""
    import papermill as pm

    from .html import to_html, write_index

    out = Path(out).resolve()
    if out == (root() / "reports").resolve():
        raise ValueError(f"--out {out} is the committed reports' folder: name a folder of your own (reports/NAME)")
    names = names or checkpoint_notebooks()
    rows = []
    for n in names:
        row = {"notebook": n}
        try:
            m = papermill_run(n, out / f"{n}.ipynb", plan(n, checkpoint, model, out, params), kernel, progress,
                              tracked=False)
        except pm.PapermillExecutionError as e:
            rows.append({**row, "error": f"{e.ename}: {e.evalue}", "cell": e.exec_count})
            if e.ename == "CheckpointError":            # every notebook would stop at the same first cell
                break
            continue
        head = m.get("headline", {})
        rows.append({**row, "measured on": head.get("model") or m.get("label") or m.get("model"),
                     "reference": model or "none", "tokenizer": m.get("tokenizer"), "wall_s": m.get("wall_s"),
                     "peak_rss_bytes": m.get("peak_rss_bytes"),
                     "headline": {k: v for k, v in head.items() if k != "model"},
                     "html": str(to_html(out / f"{n}.ipynb"))})
    rows.append({"index": str(write_index(out, names))})
    return rows


def table(rows: list[dict]) -> str:
    """The rows of :func:`run` as one plain-text table (and where the index is)."""
    lines = []
    for r in rows:
        if "index" in r:
            lines.append(f"index: {r['index']}")
        elif "error" in r:
            lines.append(f"{r['notebook']}: FAILED at execution {r['cell']}: {r['error']}")
        else:
            heads = "; ".join(f"{k}: {v}" for k, v in r["headline"].items())
            rss = f", peak RSS {r['peak_rss_bytes'] / 2 ** 30:.2f} GiB" if r.get("peak_rss_bytes") else ""
            lines.append(f"{r['notebook']}: on {r['measured on']} (reference {r['reference']}, tokenizer "
                         f"{'yes' if r['tokenizer'] else 'no: random token ids'}; {r['wall_s']:.0f} s{rss}) | {heads}")
    return "\n".join(lines)


def main(args) -> int:
    """``run --checkpoint``: :func:`run`, print :func:`table`; 1 when a notebook failed."""
    rows = run(args.checkpoint, args.out, model=args.model, params=args.params or "quick", names=args.names or None,
               progress=not args.no_progress)
    print(table(rows))
    return 1 if any("error" in r for r in rows) else 0


__all__ = ["PARAMS", "checkpoint_notebooks", "main", "plan", "run", "table"]
