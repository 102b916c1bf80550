"""THE child-process worker protocol of the benchmarks: one system per process, the child's peak memory reported.

    res = run_child("lowrank_lib.bench.load:load_jobs", jobs=[...])      # in the parent

The parent writes a spec (the target ``"module:function"`` and its keyword arguments, JSON) and runs
``python -m lowrank_lib.bench.child SPEC``; the child imports the target, calls it with the arguments and writes
its result (any JSON value) back as ``result``, with its memory: ``peak_rss`` (``VmHWM``, bytes), ``peak_anon`` / ``peak_file``
(anonymous and file-backed resident bytes, sampled every 0.2 s: mapped weight files count in ``VmHWM`` but the
OS can drop them). The parent adds ``wall_s``. (The kernel's ``ru_maxrss`` of the child is not used: on Linux it
keeps the RSS the child inherited from a large parent at fork, before its exec, so a small child of a 4 GB test
worker reported 4 GB.) A child that raises, exits non-zero or is killed (e.g. for memory) raises :class:`ChildError` in the
parent, naming the target, how it ended and the child's traceback. The child's stderr is the parent's
(progress bars and logs show as they come).
"""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from ..host import status_bytes


class ChildError(RuntimeError):
    """A benchmark child failed; the message says which target, how it ended, and the child's traceback."""


class MemorySampler:
    """Peak ``RssAnon`` and ``RssFile`` of this process, sampled every ``period`` seconds in a thread."""

    def __init__(self, period: float = 0.2):
        self.peak = {"peak_anon": 0, "peak_file": 0}
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, args=(period,), daemon=True)
        self._t.start()

    def _run(self, period: float | None):
        while period is None or not self._stop.wait(period):
            for k, key in (("peak_anon", "RssAnon"), ("peak_file", "RssFile")):
                self.peak[k] = max(self.peak[k], status_bytes(key) or 0)
            if period is None:
                return

    def stop(self) -> dict:
        self._stop.set()
        self._t.join()
        self._run(None)
        return dict(self.peak)


def run_child(target: str, timeout: float | None = None, **kwargs) -> dict:
    """Run ``target(**kwargs)`` (``"module:function"``, a module of lowrank_lib; JSON arguments and result) in a
    fresh interpreter; returns ``{"result": ..., "peak_rss", "peak_anon", "peak_file", "wall_s"}``
    (bytes, seconds). ``timeout`` (seconds) kills a child that runs longer."""
    module = target.split(":")[0]
    if not module.startswith("lowrank_lib.") or ":" not in target:
        raise ValueError(f"target {target!r}: a 'lowrank_lib.<module>:<function>'")
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="lowrank-child-") as td:
        spec, out = Path(td) / "spec.json", Path(td) / "result.json"
        spec.write_text(json.dumps({"target": target, "kwargs": kwargs, "result": str(out)}, default=str))
        t0, late = time.perf_counter(), False
        proc = subprocess.Popen([sys.executable, "-m", "lowrank_lib.bench.child", str(spec)], env=env)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            late = True
        res = json.loads(out.read_text()) if out.exists() else {}
    if proc.returncode != 0 or "error" in res:
        how = (f"was killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0
               else f"exited with code {proc.returncode}")
        if late:
            how += f" after the {timeout:.0f} s timeout"
        raise ChildError(f"benchmark child {target} {how}" + (f":\n{res['error']}" if "error" in res else
                                                            " (out of memory? its stderr is above)"))
    return {**res, "wall_s": time.perf_counter() - t0}


def worker(spec_path: str) -> int:
    """The child's side: import and call the target, write its result and peak memory (or the traceback)."""
    spec = json.loads(Path(spec_path).read_text())
    mem = MemorySampler()
    try:
        module, fn = spec["target"].split(":")
        res = {"result": vars(importlib.import_module(module))[fn](**spec["kwargs"]),
               "peak_rss": status_bytes("VmHWM"), **mem.stop()}
        code = 0
    except BaseException:                                   # noqa: BLE001 (reported to the parent, then exit 1)
        res, code = {"error": traceback.format_exc()}, 1
    Path(spec["result"]).write_text(json.dumps(res, default=str))
    return code


if __name__ == "__main__":
    raise SystemExit(worker(sys.argv[1]))
