"""Shared fixtures: tiny models, the real SmolLM2 (cached once by `make test`), executed notebooks."""
from __future__ import annotations

import os

import pytest
import torch

import compat_files
import deprecations
import xdist_threads
import xdist_units


def pytest_configure(config):
    """Deprecations triggered by our calls are attributed to our frames (see ``deprecations.py``); the
    ``filterwarnings`` of pyproject.toml make those errors. In a pytest-xdist worker, torch and every process the
    worker starts (JupyterLab's kernels, papermill, benchmark children) get the worker's share of the cores, and
    OpenMP's idle threads wait passively (the controller sets it before the workers start; ``xdist_threads.py``).
    ``LOWRANK_LIB_UNIT_SECONDS=PATH``: the controller (or a serial run) writes the seconds
    each unit of work took to PATH (``xdist_units.py``)."""
    deprecations.install()
    xdist_threads.passive_waits(config)
    xdist_threads.share_cores()
    path = os.environ.get(xdist_units.WRITE_ENV)
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(xdist_units.SecondsRecorder(path), "lowrank-lib-unit-seconds")


def pytest_collection_modifyitems(config, items):
    """The units of work longest first (``xdist_units.longest_first``); order kept within each unit (the
    browser's Run All of a notebook before the tests that reuse it). The seconds are recorded by the controller
    when ``LOWRANK_LIB_UNIT_SECONDS`` names a file. A compat test where `make test-oldest` would not find it stops
    the run (``compat_files.py``)."""
    rank = {nid: i for i, nid in enumerate(xdist_units.longest_first([it.nodeid for it in items],
                                                                     xdist_units.measured_seconds()))}
    items.sort(key=lambda it: rank[it.nodeid])
    compat_files.check(items)



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
