"""Shared fixtures: tiny models, the real SmolLM2 (cached once by `make test`), executed notebooks."""
from __future__ import annotations


import pytest
import torch

import deprecations


def pytest_configure(config):
    """Deprecations triggered by our calls are attributed to our frames (see ``deprecations.py``); the
    ``filterwarnings`` of pyproject.toml make those errors."""
    deprecations.install()


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
