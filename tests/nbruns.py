"""The CI-sized notebook runs of one test session, shared: each notebook is executed ONCE.

``tests/browser`` (collected first: ``browser/`` sorts before ``test_*.py``) runs a notebook in JupyterLab,
Run All as a person does, saves it and records the run here; a later ``executed_notebook(name)`` (the
fixture of ``tests/conftest.py``) then reuses that run's metrics and saved notebook instead of executing
the notebook a second time with papermill. Without Chromium (or with the browser tests deselected) the
first request runs papermill (``lowrank_lib.notebooks.run --ci``), as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass
class Run:
    """One executed notebook: its ``metrics.json`` content, the executed ``.ipynb`` and how it ran."""

    metrics: dict
    notebook: Path
    how: str                    # "browser" or "papermill"


RUNS: dict[str, Run] = {}


def record(name: str, metrics: dict, notebook: Path, how: str) -> None:
    RUNS[name] = Run(metrics, Path(notebook), how)


def get(name: str) -> Run:
    """The session's run of ``name``, executing it with papermill (CI parameters) if none was recorded."""
    if name not in RUNS:
        from lowrank_lib import notebooks

        metrics = notebooks.run([name], ci=True, progress=False)[name]
        record(name, metrics, notebooks.root() / "reports" / "ci" / f"{name}.ipynb", "papermill")
    return RUNS[name]
