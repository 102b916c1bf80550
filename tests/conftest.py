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
    """The xdist group of a test (``make test`` runs ``pytest -n 2 --dist loadgroup``): the notebook group, else
    its file, so module-scoped fixtures are built once, as in a serial run."""
    path = nodeid.split("::")[0].removeprefix("tests/")
    return "notebooks" if path.startswith(NOTEBOOK_GROUP) else path


def pytest_collection_modifyitems(config, items):
    """Every test gets an ``xdist_group`` (used by ``--dist loadgroup``; inert without xdist); the notebook
    group goes first, being the longest."""
    for item in items:
        item.add_marker(pytest.mark.xdist_group(xdist_group_of(item.nodeid)))
    items.sort(key=lambda it: xdist_group_of(it.nodeid) != "notebooks")       # stable: order kept within each


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
