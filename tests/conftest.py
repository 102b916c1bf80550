"""Shared fixtures: tiny models, the real SmolLM2 (cached once by `make test`), executed notebooks."""
from __future__ import annotations


import pytest
import torch

import deprecations


def pytest_configure(config):
    """Deprecations triggered by our calls are attributed to our frames (see ``deprecations.py``); the
    ``filterwarnings`` of pyproject.toml make those errors."""
    deprecations.install()


#: files whose tests share the session's notebook runs (``tests/nbruns.py``: the browser's Run All, reused by the
#: metrics tests), so they must run in ONE process
NOTEBOOK_GROUP = ("browser/", "test_nb_", "test_notebooks.py")


def xdist_group_of(nodeid: str) -> str:
    """The unit of work a pytest-xdist worker takes whole (``make test`` runs ``pytest -n 2``): the notebook group,
    else the test's file, so module-scoped fixtures are built once, as in a serial run."""
    path = nodeid.split("::")[0].removeprefix("tests/")
    return "notebooks" if path.startswith(NOTEBOOK_GROUP) else path


def pytest_collection_modifyitems(config, items):
    """The notebook group first (the longest unit: a worker starts it at once); order kept within each group."""
    items.sort(key=lambda it: xdist_group_of(it.nodeid) != "notebooks")


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
