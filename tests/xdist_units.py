"""How ``make test``'s pytest-xdist workers share the suite: units of work, longest first.

A unit is what one worker takes whole (``conftest.pytest_xdist_make_scheduler``): a notebook unit (a notebook's
browser Run All and every test reading it, ``NOTEBOOK_UNITS``), else one test file, so module-scoped fixtures are
built once, as in a serial run. Units are handed out longest first (LPT: the last unit a worker starts is a short
one, so the two workers finish together), by the seconds each unit took in a measured run, committed in
``unit_seconds.json``. A unit not in it (a new file) is assumed as long as the median unit.

xdist's own scope scheduler would sort units by their number of tests instead (``--loadscope-reorder``, its
default), which put the 41-test notebook unit behind five files of many short tests; our order replaces it.

Refresh the seconds after the suite changes much (the controller sums every phase of every test per unit):

    LOWRANK_LIB_UNIT_SECONDS=tests/unit_seconds.json make test
"""
from __future__ import annotations

import json
import os
import re
import statistics
from collections import defaultdict
from pathlib import Path

#: files whose tests share the session's notebook runs (``tests/nbruns.py``: the browser's Run All, reused by the
#: metrics tests): a notebook's run and the tests that read it must run in ONE process
NOTEBOOK_FILES = ("browser/test_lab.py", "test_nb_", "test_notebooks.py")
#: the notebooks split into two units of about equal CI time, so the two ``make test`` workers share them; a
#: notebook and every test reading its run are in the same unit (03's test reads 02's run too)
NOTEBOOK_UNITS = {"notebooks-a": ("00", "02", "03", "07"), "notebooks-b": ("01", "04", "05", "06")}
#: measured seconds per unit (see the module docstring)
SECONDS_FILE = Path(__file__).with_name("unit_seconds.json")
#: set to a path: the controller writes the seconds per unit of this run there
WRITE_ENV = "LOWRANK_LIB_UNIT_SECONDS"


def _notebook_unit(nodeid: str) -> str:
    """The unit of a notebook-group test: by the notebook its file or parameter names (``test_nb_03.py``,
    ``[05_attsvd_quality_memory]``); a test that names none (``test_quickstart_metrics`` reads 00) joins unit a."""
    path, _, rest = nodeid.partition("::")
    m = re.search(r"test_nb_(\d\d)", path) or re.search(r"\[(\d\d)_", rest)
    num = m.group(1) if m else "00"
    for unit, nums in NOTEBOOK_UNITS.items():
        if num in nums:
            return unit
    raise AssertionError(f"notebook {num} ({nodeid}) is in no unit of NOTEBOOK_UNITS: add it")


def unit_of(nodeid: str) -> str:
    """The unit of work a worker takes whole: a notebook unit, else the test's file (relative to ``tests/``)."""
    path = nodeid.split("::")[0].removeprefix("tests/")
    return _notebook_unit(nodeid) if path.startswith(NOTEBOOK_FILES) else path


def measured_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    """The committed seconds per unit ({} when the file is missing)."""
    return json.loads(path.read_text())["seconds"] if path.exists() else {}


def longest_first(nodeids: list[str], seconds: dict[str, float]) -> list[str]:
    """``nodeids`` grouped by unit, the units in decreasing measured seconds (an unmeasured unit counts as the
    median one; ties keep the order of first appearance), each unit's tests in their given order."""
    units: dict[str, list[str]] = defaultdict(list)
    for nid in nodeids:
        units[unit_of(nid)].append(nid)
    default = statistics.median(seconds.values()) if seconds else 0.0
    order = sorted(units, key=lambda u: -seconds.get(u, default))      # sorted() is stable
    return [nid for u in order for nid in units[u]]


class SecondsRecorder:
    """Controller-side plugin: sums each test report's duration (setup, call, teardown) per unit and writes
    ``{"seconds": {unit: s}}`` at the end of the session."""

    def __init__(self, path: str):
        self.path = Path(path)
        self.seconds: dict[str, float] = defaultdict(float)

    def pytest_runtest_logreport(self, report):
        self.seconds[unit_of(report.nodeid)] += report.duration

    def pytest_sessionfinish(self, session):
        data = {"what": "seconds per xdist unit of one `make test` run (tests/xdist_units.py)",
                "cores": os.cpu_count(),
                "seconds": {u: round(s, 1) for u, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}}
        self.path.write_text(json.dumps(data, indent=1) + "\n")
