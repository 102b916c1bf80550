"""Notebook machinery: shared parameters, headless execution with papermill, figure/metrics output.

Every notebook in ``notebooks/`` has ONE code cell tagged ``parameters`` with UPPER_CASE names
shared across notebooks (``MODEL``, ``KEEP_RATIO``, ``SEED``, ``OUT_DIR``, ``FIG_DIR``, ...). Its
defaults are the full report run. ``notebooks/params/ci.yaml`` shrinks them for CI: ``parameters``
apply to every notebook that declares the name, ``overrides`` per notebook on top.

    python -m lowrank_lib.notebooks run                 # report: reports/<nb>.ipynb, figures/
    python -m lowrank_lib.notebooks run --ci            # CI: reports/ci/<nb>.ipynb, reports/ci/figures/
    python -m lowrank_lib.notebooks run --ci 00_quickstart
    python -m lowrank_lib.notebooks run --params notebooks/params/paper.yaml   # bigger machine
    python -m lowrank_lib.notebooks list
    python -m lowrank_lib.notebooks run --checkpoint PATH [--model DIR] [--params quick|full] --out reports/NAME
                                                        # your model through every notebook taking CHECKPOINT

    python -m lowrank_lib.notebooks prepare 04_attsvd_interpretability DIR   # CI-sized copy to open
    python -m lowrank_lib.notebooks prepare 00_quickstart DIR --checkpoint PATH [--model DIR]   # ... on your model
    python -m lowrank_lib.notebooks html                # reports/<nb>.html + reports/index.html (offline)
    python -m lowrank_lib.notebooks lab-settings        # JupyterLab saves widget state (make setup runs it)

Inside a notebook::

    from lowrank_lib.notebooks import NotebookContext
    ctx = NotebookContext(OUT_DIR, FIG_DIR)   # relative paths resolve against the working directory
    ctx.show(fig, "00_ppl_vs_keep")           # FIG_DIR/00_ppl_vs_keep.png, checked, displayed (lowrank_lib.figures)
    with ctx.working():                       # live progress bars / log lines, gone from the saved output
        rows = heavy_sweep()
    ctx.banner("timings at CI size are not meaningful")   # a visible note box
    ctx.write_metrics({...}, headline={...})  # OUT_DIR/metrics.json (headline: reports/index.html)

Outputs stay where the notebook runs: relative ``OUT_DIR`` / ``FIG_DIR`` resolve against the
kernel's working directory (in JupyterLab, the notebook's folder), so a copied notebook writes next
to the copy. The report runner executes with the checkout root as working directory, so its
``reports/<nb>/`` and ``figures/`` are the checkout's; ``--ci`` writes under ``reports/ci/`` (never
the committed report figures). Outside a runner, a context refuses to overwrite a file git tracks
(a committed figure or metrics file) and says how to write elsewhere.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import yaml


def root() -> Path:
    from ..models import repo_root

    r = repo_root()
    if r is None:
        raise RuntimeError("lowrank_lib.notebooks needs the source checkout (pip install -e .)")
    return r


def notebooks_dir() -> Path:
    return root() / "notebooks"


def on_disk() -> list[str]:
    """Names (stems) of the numbered notebooks on disk, sorted."""
    return sorted(p.stem for p in notebooks_dir().glob("[0-9][0-9]_*.ipynb"))


def read_params(path: str | Path | None = None) -> dict:
    """A parsed parameter file (keys: notebooks, parameters, overrides); default ``params/ci.yaml``."""
    with open(path or notebooks_dir() / "params" / "ci.yaml") as f:
        cfg = yaml.safe_load(f) or {}
    cfg.setdefault("notebooks", [])
    cfg.setdefault("parameters", {})
    cfg.setdefault("overrides", {})
    cfg["overrides"] = {k: (v or {}) for k, v in cfg["overrides"].items()}
    return cfg


def declared_parameters(path: Path) -> dict:
    """The names and default source of the notebook's ``parameters`` cell (papermill inspection)."""
    import papermill as pm

    return pm.inspect_notebook(str(path))


def _json_safe(obj):
    if isinstance(obj, dict):
        return {str(k): _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_safe(v) for v in obj]
    if hasattr(obj, "item") and callable(obj.item) and getattr(obj, "ndim", 0) == 0:
        obj = obj.item()
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, (str, int, float, bool)) or obj is None:
        return obj
    if hasattr(obj, "tolist"):
        return _json_safe(obj.tolist())
    return str(obj)


#: Set (to "1") by :func:`run` while it executes notebooks: committed report files may be rewritten.
REPORT_RUN_ENV = "LOWRANK_LIB_REPORT_RUN"


def _git_tracked(path: Path) -> bool:
    """Whether ``path`` is a file git tracks in the repository that contains it (False without git)."""
    if not path.exists():
        return False
    try:
        r = subprocess.run(["git", "-C", str(path.parent), "ls-files", "--error-unmatch", "--", path.name],
                           capture_output=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


def _shown(path: Path) -> str:
    """``path`` relative to the working directory when it lies below it, else absolute."""
    try:
        return str(path.relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _peak_rss() -> int | None:
    from ..host import status_bytes

    return status_bytes("VmHWM")


@dataclass
class NotebookContext:
    """Where a notebook writes: figures into ``FIG_DIR``, ``metrics.json`` into ``OUT_DIR``.

    Relative directories resolve against the working directory (the notebook's folder in JupyterLab).
    Writing over a git-tracked file is refused unless the report runner (:func:`run`) is executing
    the notebook or ``overwrite_tracked=True``.
    """

    out_dir: str | Path
    fig_dir: str | Path = "figures"
    overwrite_tracked: bool | None = None

    def __post_init__(self):
        self.out_dir = Path(self.out_dir).expanduser().resolve()
        self.fig_dir = Path(self.fig_dir).expanduser().resolve()
        if self.overwrite_tracked is None:
            self.overwrite_tracked = os.environ.get(REPORT_RUN_ENV) == "1"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.fig_dir.mkdir(parents=True, exist_ok=True)
        self.figures: list[str] = []
        self.metrics_path: Path | None = None
        self.started = time.time()
        plain_text_views()

    def _writable(self, path: Path) -> Path:
        if not self.overwrite_tracked and _git_tracked(path):
            raise FileExistsError(
                f"{path} is a file committed to git (a report output); this notebook run would overwrite it. "
                f"Point OUT_DIR / FIG_DIR elsewhere (relative paths resolve against {Path.cwd()}), regenerate "
                f"reports with `python -m lowrank_lib.notebooks run`, or pass overwrite_tracked=True.")
        return path

    def savefig(self, fig, name: str) -> None:
        """Check ``fig`` (:mod:`lowrank_lib.figures`) and save it as ``FIG_DIR/<name>.png``, listed in the metrics."""
        from .. import figures

        path = self._writable(self.fig_dir / f"{name}.png")
        figures.save(fig, path, name)
        self.figures.append(_shown(path))

    def show(self, fig, name: str) -> None:
        """:meth:`savefig`, then display that same PNG at its true size and close ``fig`` (matplotlib's inline
        copy, drawn at another resolution, is never shown): the figure checked is the figure seen."""
        from .. import figures

        path = self._writable(self.fig_dir / f"{name}.png")
        figures.show(fig, path, name)
        self.figures.append(_shown(path))

    def write_metrics(self, metrics: dict, headline: dict | None = None) -> None:
        """Write ``OUT_DIR/metrics.json`` (adds the figure list, the wall time and ``peak_rss_bytes``: the kernel
        process's peak RSS so far, ``VmHWM``); path in ``self.metrics_path``.

        ``headline``: a few ``{label: formatted value}`` pairs, the numbers ``reports/index.html`` lists for
        this notebook."""
        data = dict(_json_safe(metrics))
        data.setdefault("figures", self.figures)
        data.setdefault("wall_s", round(time.time() - self.started, 2))
        data.setdefault("peak_rss_bytes", _peak_rss())
        if headline is not None:
            data["headline"] = {str(k): str(v) for k, v in headline.items()}
        path = self._writable(self.out_dir / "metrics.json")
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")      # whole or absent: a reader never sees half
        tmp.write_text(json.dumps(data, indent=2, sort_keys=True))
        os.replace(tmp, path)
        self.metrics_path = path

    @staticmethod
    def working():
        """A block whose live progress (tqdm bars, log lines on stdout/stderr) is shown while it runs and
        removed from the cell's output when it ends: see :func:`working`."""
        return working()

    @staticmethod
    def banner(text: str, kind: str = "warning") -> None:
        """A visible note box in the cell's output (``kind``: warning or info): see :func:`banner`."""
        banner(text, kind)


def plain_text_views() -> None:
    """In a kernel: give tables (pandas ``Styler``), Markdown and images a plain-text form worth reading (the
    table itself, the Markdown source, ``[figure W px wide]``) instead of ``<... object at 0x7f...>``, the text
    a plain-text viewer, a diff or a test sees of the output. Idempotent; nothing outside a kernel."""
    try:
        from IPython import get_ipython
        from IPython.display import Image, Markdown
    except ImportError:
        return
    ip = get_ipython()
    if ip is None:
        return
    fmt = ip.display_formatter.formatters["text/plain"]
    try:
        from pandas.io.formats.style import Styler

        fmt.for_type(Styler, lambda obj, p, cycle: p.text(obj.data.to_string()))
    except ImportError:
        pass
    fmt.for_type(Markdown, lambda obj, p, cycle: p.text(obj.data or ""))
    fmt.for_type(Image, lambda obj, p, cycle: p.text(f"[figure {obj.width or '?'} px wide]"))


@contextlib.contextmanager
def working():
    """Run a block with its progress shown live in a transient area, and none of it left in the output.

    Inside a kernel with ipywidgets, the block's outputs (tqdm's notebook bars, ``[quality] ... done`` lines
    on stderr, anything printed) go to an ``ipywidgets.Output`` shown under the cell; when the block ends
    normally that area is replaced by an empty output and the widgets created inside are closed, so the
    saved notebook holds neither progress text nor widget models that a reopened notebook could not find.
    If the block raises, the area stays as it was (the progress up to the failure) and the error propagates.
    Outside a kernel it does nothing: progress goes to stderr as usual. Print results AFTER the block.
    """
    from ..explore.ui import in_kernel_with_widgets

    if not in_kernel_with_widgets():
        yield
        return
    import ipywidgets as W
    from ipywidgets.widgets import widget as widget_module
    from IPython.display import display

    # ipywidgets keeps every live model in this module-level dict; no public listing exists
    instances = getattr(widget_module, "_instances", {})
    before = set(instances)
    area = W.Output()
    handle = display(area, display_id=True)
    failed = None
    with area:          # Output.__exit__ would swallow an exception inside a kernel: catch it, raise it below
        try:
            yield
        except BaseException as e:
            failed = e
    if failed is not None:
        raise failed
    handle.update({"text/plain": ""}, raw=True)
    area.clear_output()             # a saved state of the closed area (papermill keeps one) holds no progress
    for mid in [m for m in list(instances) if m not in before]:
        w = instances.get(mid)
        if w is not None:
            w.close()


BANNER_STYLE = {"warning": "background:#fff3cd;border:1px solid #d39e00;color:#533f03",
                "info": "background:#e7f1ff;border:1px solid #3d7fd6;color:#0b2e59"}


def banner(text: str, kind: str = "warning") -> None:
    """Display ``text`` as a coloured box (HTML; plain text ``NOTE: ...`` where HTML is not rendered)."""
    import html

    from IPython.display import display

    style = BANNER_STYLE[kind]
    display({"text/html": f'<div style="{style};padding:8px 12px;border-radius:4px;font-size:14px;'
                          f'margin:4px 0"><b>{"Note" if kind == "info" else "Read with care"}:</b> {html.escape(text)}</div>',
             "text/plain": f"{'NOTE' if kind == 'info' else 'READ WITH CARE'}: {text}"}, raw=True)


def timing_banner(ci: bool, repeats: int | None = None) -> str | None:
    """The warning a notebook shows above its timings when they are not meaningful: at CI size, with fewer
    than 3 repeats, or on a busy machine (other processes keeping half a core or more busy over 2 s; the load
    average where /proc cannot tell); None otherwise.
    Displays it (:func:`banner`) and returns its text."""
    from ..host import load_average, others_busy_cores

    why = []
    if ci:
        why.append("this is the CI-sized run (tiny inputs, few repeats)")
    if repeats is not None and repeats < 3:
        why.append(f"each timing has only {repeats} repeat(s)")
    cores = os.cpu_count() or 1
    busy = others_busy_cores()             # not the load average: that counts this kernel's own model loading
    if busy is not None and busy > 0.5:
        why.append(f"other processes kept {busy:.1f} of {cores} cores busy")
    elif busy is None:
        load = load_average()
        if load and load[0] > 0.5 * cores:
            why.append(f"the machine was busy (load average {load[0]:.1f} on {cores} cores)")
    if not why:
        return None
    text = ("The timings below are NOT meaningful: " + "; ".join(why) + ". Compare systems only by ratios "
            "measured side by side; the committed full-size report, run on an idle machine, has the real numbers.")
    banner(text)
    return text


@contextlib.contextmanager
def _report_run(tracked: bool = True):
    """While the runner executes: committed report files may be rewritten (``tracked``), and an unreadable figure
    is an error (:mod:`lowrank_lib.figures`), in the kernels it starts too (they inherit the environment)."""
    from ..figures import CHECK_ENV

    set_to = {REPORT_RUN_ENV: "1", CHECK_ENV: "error"} if tracked else {CHECK_ENV: "error"}
    old = {k: os.environ.get(k) for k in set_to}
    os.environ.update(set_to)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def plan(name: str, ci: bool, params_file: str | Path | None = None) -> dict:
    """The parameters a run of notebook ``name`` gets (only names the notebook declares).

    Report runs use the notebook's defaults, or ``params_file`` on top of them; ``ci`` uses
    ``params/ci.yaml`` and redirects outputs under ``reports/ci``. ``OUT_DIR`` / ``FIG_DIR`` are
    relative to the checkout root, the working directory :func:`run` executes in.
    """
    path = notebooks_dir() / f"{name}.ipynb"
    declared = declared_parameters(path)
    out_base = "reports/ci" if ci else "reports"
    params = {"OUT_DIR": f"{out_base}/{name}", "FIG_DIR": f"{out_base}/figures" if ci else "figures"}
    if ci or params_file:
        cfg = read_params(None if ci else params_file)
        overrides = cfg["overrides"].get(name, {})
        unknown = [k for k in overrides if k not in declared]
        if unknown:
            raise ValueError(f"{params_file or 'ci.yaml'} overrides {unknown} for {name}, which its parameters "
                             f"cell does not declare")
        params.update(cfg["parameters"])
        params.update(overrides)
    return {k: v for k, v in params.items() if k in declared}


def execute(name: str, ci: bool = False, kernel: str = "python3", progress: bool = True,
            params_file: str | Path | None = None) -> dict:
    """Execute one notebook headless with papermill (one sweep task of :func:`run`); its metrics dict."""
    base = root()
    out_nb = base / ("reports/ci" if ci else "reports") / f"{name}.ipynb"
    return papermill_run(name, out_nb, plan(name, ci, params_file), kernel, progress)


def papermill_run(name: str, out_nb: Path, params: dict, kernel: str = "python3", progress: bool = True,
                  tracked: bool = True) -> dict:
    """Execute notebook ``name`` with ``params`` into ``out_nb`` (working directory: the checkout root; widget
    state no output shows pruned); its metrics dict (``OUT_DIR/metrics.json``). ``tracked``: the run may rewrite
    committed report files (the report runner's own outputs)."""
    import papermill as pm

    from .kernel import PollingKernelManager

    base = root()
    out_nb.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    print(f"[notebooks] {name}: {json.dumps(params)}", file=sys.stderr, flush=True)
    with _report_run(tracked):
        pm.execute_notebook(str(notebooks_dir() / f"{name}.ipynb"), str(out_nb), parameters=params,
                            kernel_name=kernel, cwd=str(base), progress_bar=progress,
                            request_save_on_cell_execute=False,
                            kernel_manager_class=PollingKernelManager)     # never waits on a lost wake-up: kernel.py
    _prune(out_nb)
    metrics_path = base / params["OUT_DIR"] / "metrics.json"
    if not metrics_path.exists():
        raise RuntimeError(f"{name} ran but wrote no {metrics_path}")
    print(f"[notebooks] {name}: done in {time.time() - t0:.1f}s -> {_shown(out_nb)}", file=sys.stderr, flush=True)
    return json.loads(metrics_path.read_text())


def _prune(path: Path) -> None:
    """Rewrite the executed notebook without the saved state of widgets no output shows
    (:func:`lowrank_lib.notebooks.html.prune_widget_state`: closed progress bars and areas)."""
    import nbformat

    from .html import prune_widget_state

    nb = nbformat.read(path, as_version=4)
    if prune_widget_state(nb):
        nbformat.write(nb, path)


def run(names: list[str] | None = None, ci: bool = False, kernel: str = "python3", progress: bool = True,
        params_file: str | Path | None = None, executor=None) -> dict:
    """Execute notebooks headless with papermill; return ``{name: metrics dict}``.

    ``names`` default: every notebook CI runs (``ci.yaml`` list) in CI mode, every one on disk otherwise.
    Each notebook is one task of ``executor`` (:mod:`lowrank_lib.executor`, default serial; ``--executor
    ray`` runs them in parallel): a failing notebook is retried once, then reported by name
    (:class:`~lowrank_lib.executor.SweepError`) after the others ran; papermill keeps its partial copy.
    """
    from ..executor import Task, run_sweep

    if not names:
        names = read_params()["notebooks"] if ci else on_disk()
    missing = [n for n in names if not (notebooks_dir() / f"{n}.ipynb").exists()]
    if missing:
        raise FileNotFoundError(f"no notebook named {missing} in {notebooks_dir()}")
    tasks = [Task(n, execute, (n, ci, kernel, progress, params_file)) for n in names]
    done = run_sweep(tasks, executor, progress=progress, desc="notebooks")
    if not ci:
        write_html(names)
    return done


def write_html(names: list[str] | None = None) -> list[Path]:
    """``reports/<name>.html`` (offline, :func:`lowrank_lib.notebooks.html.to_html`) for each executed report
    among ``names`` (default: every notebook on disk), then ``reports/index.html`` over all of them."""
    from .html import to_html, write_index

    reports = root() / "reports"
    out = [to_html(reports / f"{n}.ipynb") for n in (names or on_disk()) if (reports / f"{n}.ipynb").exists()]
    out.append(write_index(reports, on_disk()))
    return out


#: JupyterLab setting overrides this package installs (``{sys.prefix}/share/jupyter/lab/settings/overrides.d``,
#: the folder JupyterLab reads packages' defaults from): save widget state with the notebook, so a reopened
#: notebook shows its sliders and their last view instead of "Error displaying widget: model not found"
LAB_SETTINGS = {"@jupyter-widgets/jupyterlab-manager:plugin": {"saveState": True}}


def install_lab_settings(prefix: str | Path | None = None) -> Path:
    """Write :data:`LAB_SETTINGS` as ``<prefix>/share/jupyter/lab/settings/overrides.d/lowrank_lib.json``
    (default prefix: this interpreter's, the venv ``make setup`` builds); returns the path. Idempotent."""
    path = Path(prefix or sys.prefix) / "share" / "jupyter" / "lab" / "settings" / "overrides.d" / "lowrank_lib.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(LAB_SETTINGS, indent=2) + "\n"
    if not path.exists() or path.read_text() != text:
        path.write_text(text)
    return path


def prepare(name: str, dest: str | Path, ci: bool = True, params_file: str | Path | None = None,
            checkpoint: str | Path | None = None, model: str | None = None) -> Path:
    """Write ``dest/<name>.ipynb``: the notebook with the CI (or ``params_file``) parameters injected, not run.

    This is papermill's parameter injection (``papermill --prepare-only``): an ``injected-parameters``
    cell after the ``parameters`` cell, exactly what a headless run executes. Open the copy in
    JupyterLab and Run All to get the CI-sized notebook interactively. ``OUT_DIR`` / ``FIG_DIR`` are
    not injected: the copy writes relative to the folder it runs in. With ``checkpoint`` (a notebook
    that declares ``CHECKPOINT``) the copy runs on that file, with ``model`` as its reference (None: none).
    """
    import papermill as pm

    src = notebooks_dir() / f"{name}.ipynb"
    if not src.exists():
        raise FileNotFoundError(f"no notebook named {name!r} in {notebooks_dir()}")
    params = {k: v for k, v in plan(name, ci, params_file).items() if k not in ("OUT_DIR", "FIG_DIR")}
    if checkpoint is not None:
        if "CHECKPOINT" not in declared_parameters(src):
            raise ValueError(f"{name} does not take CHECKPOINT (it studies the built-in model only)")
        params |= {"CHECKPOINT": str(Path(checkpoint).resolve()), "MODEL": model}
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    out = dest / f"{name}.ipynb"
    pm.execute_notebook(str(src), str(out), parameters=params, prepare_only=True, progress_bar=False)
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m lowrank_lib.notebooks")
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="execute notebooks headless with papermill")
    r.add_argument("names", nargs="*", help="notebook stems (default: all)")
    r.add_argument("--ci", action="store_true", help="small CI parameters from notebooks/params/ci.yaml")
    r.add_argument("--params", default=None, help="report run: a YAML of parameters/overrides on top of the "
                   "defaults (e.g. notebooks/params/paper.yaml); with --checkpoint also quick (default) or full")
    r.add_argument("--checkpoint", default=None, help="YOUR compressed model (any family's checkpoint): run every "
                   "notebook that takes CHECKPOINT on it into --out (lowrank_lib.notebooks.checkpoint)")
    r.add_argument("--model", default=None, help="with --checkpoint: its dense reference (smollm2, a tiny preset, a "
                   "local HF directory); default none")
    r.add_argument("--out", default=None, help="with --checkpoint: the report folder (reports/NAME)")
    r.add_argument("--no-progress", action="store_true")
    from ..executor import add_arguments as add_executor_arguments

    add_executor_arguments(r)           # each notebook a task: --executor ray [--address ...]
    pp = sub.add_parser("prepare", help="copy notebooks with parameters injected (not executed), to open in JupyterLab")
    pp.add_argument("names", nargs="+", help="notebook stems")
    pp.add_argument("dest", help="folder to write the copies into (outputs then go below it)")
    pp.add_argument("--params", default=None, help="a parameter YAML instead of notebooks/params/ci.yaml")
    pp.add_argument("--checkpoint", default=None, help="your compressed model: the copies run on it")
    pp.add_argument("--model", default=None, help="with --checkpoint: its dense reference (default: none)")
    sub.add_parser("list", help="notebooks on disk and whether CI runs them")
    h = sub.add_parser("html", help="render reports/<nb>.ipynb to offline reports/<nb>.html, and reports/index.html")
    h.add_argument("names", nargs="*", help="notebook stems (default: every executed report)")
    sub.add_parser("lab-settings", help="make this environment's JupyterLab save widget state with notebooks")
    args = ap.parse_args(argv)
    if args.cmd == "html":
        for p in write_html(args.names or None):
            print(p)
        return 0
    if args.cmd == "lab-settings":
        print(install_lab_settings())
        return 0
    if args.cmd == "list":
        ci = set(read_params()["notebooks"])
        for n in on_disk():
            print(f"{n}\t{'ci' if n in ci else 'NOT IN CI'}")
        return 0
    if args.cmd == "prepare":
        for n in args.names:
            print(prepare(n, args.dest, ci=args.params is None, params_file=args.params, checkpoint=args.checkpoint,
                          model=args.model))
        return 0
    if args.checkpoint is not None or args.model is not None or args.out is not None:
        if args.checkpoint is None or args.out is None or args.ci:
            ap.error("run on your model: --checkpoint PATH and --out DIR together (and no --ci)")
        from .checkpoint import main as run_checkpoint

        return run_checkpoint(args)
    from ..executor import SweepError, from_args

    try:
        run(args.names or None, ci=args.ci, progress=not args.no_progress, params_file=args.params,
            executor=from_args(args))
    except SweepError as e:
        print(e, file=sys.stderr)
        return 1
    return 0
