"""Shared fixtures: tiny models, the real SmolLM2 (cached once by `make test`), executed notebooks."""
from __future__ import annotations

import os

import pytest
import torch

import deprecations
import xdist_threads
import xdist_units


def pytest_configure(config):
    """Deprecations triggered by our calls are attributed to our frames (see ``deprecations.py``); the
    ``filterwarnings`` of pyproject.toml make those errors. In a pytest-xdist worker, torch and every process the
    worker starts (JupyterLab's kernels, papermill, benchmark children) get the worker's share of the cores
    (``xdist_threads.py``). ``LOWRANK_LIB_UNIT_SECONDS=PATH``: the controller (or a serial run) writes the seconds
    each unit of work took to PATH (``xdist_units.py``)."""
    deprecations.install()
    xdist_threads.share_cores()
    path = os.environ.get(xdist_units.WRITE_ENV)
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(xdist_units.SecondsRecorder(path), "lowrank-lib-unit-seconds")


def pytest_collection_modifyitems(config, items):
    """The units of work longest first (``xdist_units.longest_first``); order kept within each unit (the
    browser's Run All of a notebook before the tests that reuse it). The seconds are recorded by the controller
    when ``LOWRANK_LIB_UNIT_SECONDS`` names a file."""
    rank = {nid: i for i, nid in enumerate(xdist_units.longest_first([it.nodeid for it in items],
                                                                     xdist_units.measured_seconds()))}
    items.sort(key=lambda it: rank[it.nodeid])
    _compat_tests_are_where_make_looks(items)


#: `make test-oldest` collects only the files that spell this (the Makefile's COMPAT_FILES, a grep)
COMPAT_MARK = "pytest.mark.compat"


def _compat_tests_are_where_make_looks(items) -> None:
    """A ``compat`` test in a file that does not spell :data:`COMPAT_MARK` (a marker applied some other way) would
    never run on the oldest transformers: collection stops and names the file."""
    texts: dict = {}
    strays = sorted({str(it.path) for it in items if it.get_closest_marker("compat")
                     and COMPAT_MARK not in texts.setdefault(it.path, it.path.read_text())})
    if strays:
        raise pytest.UsageError(f"compat tests in {strays}, whose text lacks {COMPAT_MARK!r}: `make test-oldest` "
                                "collects only the files containing it (COMPAT_FILES in the Makefile)")


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduler with our units (``xdist_units.unit_of``) as the scopes, handed out in the collection
    order above, not re-sorted by their number of tests (xdist's ``--loadscope-reorder``, on by default)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByUnit(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_units.unit_of(nodeid)

        def schedule(self) -> None:
            self.config.option.loadscopereorder = False
            super().schedule()

    return ByUnit(config, log)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the real SmolLM2-135M-Instruct, fp32, eval mode. Do not modify in place."""
    from lowrank_lib import models

    return models.load("smollm2")


@pytest.fixture
def tiny_mha():
    from lowrank_lib import models

    return models.tiny_model("tiny-mha", seed=0)


@pytest.fixture
def tiny_gqa():
    from lowrank_lib import models

    return models.tiny_model("tiny-gqa", seed=0)


@pytest.fixture(scope="session")
def executed_notebook():
    """``executed_notebook(name) -> metrics dict``: the notebook run once per session with CI params (by the
    browser tests' Run All when they ran it, else papermill: ``tests/nbruns.py``)."""
    import nbruns

    return lambda name: nbruns.get(name).metrics


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield
