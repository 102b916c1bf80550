# lowrank_lib: `make test` and `make report` set everything up themselves (venv, torch, package,
# the real model), then run. Needs only python3 (3.10+), git and make. No conda.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/python -m pip --disable-pip-version-check
# A CPU build of torch that pip finds on the project machines; a torch already importable by
# $(PYTHON) is kept instead (the venv then sees the system site-packages).
TORCH_SPEC ?= torch==2.13.0
PYTEST_ARGS ?=

.PHONY: setup test lint report fetch clean-venv

$(VENV)/.installed: pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "[setup] keeping the torch that $(PYTHON) already has"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV); \
	else \
	  $(PYTHON) -m venv $(VENV) && $(PIP) install -q "$(TORCH_SPEC)"; \
	fi
	$(PIP) install -q -e ".[notebooks,dev,browser]"
	@touch $@

setup: $(VENV)/.installed
	$(PY) -m lowrank_lib.models fetch smollm2

fetch: setup

lint: setup
	$(PY) -m ruff check lowrank_lib tests benchmarks

test: setup lint
	$(PY) -m pytest $(PYTEST_ARGS) tests

report: setup
	$(PY) -m lowrank_lib.notebooks run

clean-venv:
	rm -rf $(VENV)
