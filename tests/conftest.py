"""Shared fixtures: tiny models, the real SmolLM2 (cached once by `make test`), executed notebooks."""
from __future__ import annotations

import re

import pytest
import torch

import deprecations
import xdist_threads


def pytest_configure(config):
    """Deprecations triggered by our calls are attributed to our frames (see ``deprecations.py``); the
    ``filterwarnings`` of pyproject.toml make those errors. In a pytest-xdist worker, torch and every process the
    worker starts (JupyterLab's kernels, papermill, benchmark children) get the worker's share of the cores
    (``xdist_threads.py``)."""
    deprecations.install()
    xdist_threads.share_cores()


#: files whose tests share the session's notebook runs (``tests/nbruns.py``: the browser's Run All, reused by the
#: metrics tests): a notebook's run and the tests that read it must run in ONE process
NOTEBOOK_FILES = ("browser/test_lab.py", "test_nb_", "test_notebooks.py")
#: the notebooks split into two units of about equal CI time (measured: 00 and 05 are the two longest Run Alls), so
#: the two ``make test`` workers share them instead of one worker running every notebook while the other idles at
#: the end; a notebook and every test reading its run are in the same unit (03's test reads 02's run too)
NOTEBOOK_UNITS = {"notebooks-a": ("00", "02", "03", "07"), "notebooks-b": ("01", "04", "05", "06")}


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


def xdist_group_of(nodeid: str) -> str:
    """The unit of work a pytest-xdist worker takes whole (``make test`` runs ``pytest -n 2``): a notebook unit,
    else the test's file, so module-scoped fixtures are built once, as in a serial run."""
    path = nodeid.split("::")[0].removeprefix("tests/")
    return _notebook_unit(nodeid) if path.startswith(NOTEBOOK_FILES) else path


def pytest_collection_modifyitems(config, items):
    """The notebook units first (the longest units: each worker starts one at once); order kept within each unit
    (the browser's Run All of a notebook before the tests that reuse it)."""
    items.sort(key=lambda it: not xdist_group_of(it.nodeid).startswith("notebooks-"))


def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduler with our units (:func:`xdist_group_of`) as the scopes."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return xdist_group_of(nodeid)

    return ByGroup(config, log)


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
