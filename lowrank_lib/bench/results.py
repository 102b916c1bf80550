"""The ONE result writer of every benchmark: ``<out>/<name>_<slug>.json`` (+ companions), never overwritten.

Rule: a run's files share one stem ``<name>_<slug>`` (the slug names the configuration, e.g.
``decode_smollm2_svd_k0.5_fp32_p512_g64_b1``); when any file with that stem exists (any suffix), the
run takes ``<stem>_2``, then ``_3``, ... The JSON holds the result (with its ``command`` and time); a
Markdown / text table goes beside it under the same stem. A long run may rewrite ITS OWN files as it
goes (partial results survive an interruption): the stem is chosen once, when the run starts, and
nothing is written before the first result.
"""
from __future__ import annotations

import glob
import json
import re
import time
from pathlib import Path

DEFAULT_OUT = "benchmarks/results"


def slug(*parts) -> str:
    """Join the non-empty parts with ``_``; characters outside [A-Za-z0-9.-] become ``-``."""
    return "_".join(re.sub(r"[^A-Za-z0-9.\-]+", "-", str(p)) for p in parts if p not in (None, ""))


class ResultFiles:
    """The files of one benchmark run in ``out_dir`` (a folder, created if needed)."""

    def __init__(self, out_dir: str | Path, name: str, config_slug: str = ""):
        self.dir = Path(out_dir)
        if self.dir.suffix == ".json":
            raise ValueError(f"--out is a folder, got a file name {str(out_dir)!r}")
        self.dir.mkdir(parents=True, exist_ok=True)
        base = f"{name}_{config_slug}" if config_slug else name
        stem, i = base, 2
        while any(self.dir.glob(f"{glob.escape(stem)}.*")):
            stem, i = f"{base}_{i}", i + 1
        self.stem = stem
        self.path = self.dir / f"{stem}.json"

    def companion(self, suffix: str) -> Path:
        return self.dir / f"{self.stem}{suffix}"

    def write(self, result: dict, **texts: str) -> Path:
        """Write the JSON (and ``md=``/``txt=`` companions); returns the JSON path."""
        result = {**result, "written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        self.path.write_text(json.dumps(result, indent=1, default=str) + "\n")
        for suffix, text in texts.items():
            self.companion(f".{suffix}").write_text(text if text.endswith("\n") else text + "\n")
        return self.path


def write_result(out_dir: str | Path, name: str, config_slug: str, result: dict, **texts: str) -> Path:
    """One-shot :class:`ResultFiles`: pick the stem and write; returns the JSON path."""
    return ResultFiles(out_dir, name, config_slug).write(result, **texts)
