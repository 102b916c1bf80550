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
# pytest-xdist workers (tests/xdist_units.py: one unit per notebook group or test file, handed out longest first);
# PYTEST_WORKERS=0 runs serially
PYTEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(PYTEST_WORKERS)),,-n $(PYTEST_WORKERS))
# The oldest transformers of pyproject.toml's range (its ">=" bound) and the venv that runs it: the main
# venv's packages (a .pth line adds its site-packages after the venv's own), with only transformers (and
# what it needs that differs) installed over them, so no second torch is downloaded.
TRANSFORMERS_OLDEST ?= $(shell sed -n 's/^ *"transformers>=\([0-9.]*\),.*/\1/p' pyproject.toml)
VENV_OLDEST ?= .venv-oldest
#: the extras `make setup` installs
EXTRAS := notebooks,dev,triton,distributed,browser
PY_OLDEST := $(VENV_OLDEST)/bin/python
#: fetch and cache the real model (a cached one: a quick check); run beside the kernels' compile, by `setup` only
#: where that failed ($(VENV)/.fetched missing), and by `make fetch`
FETCH_MODEL = $(PY) -m lowrank_lib.models fetch smollm2

.PHONY: setup test test-oldest test-oldest-run lint bytecode report fetch clean-venv

$(VENV)/.installed: pyproject.toml
	@if $(PYTHON) -c "import torch" 2>/dev/null; then \
	  echo "[setup] keeping the torch that $(PYTHON) already has"; \
	  $(PYTHON) -m venv --system-site-packages $(VENV) && $(PIP) install -q setuptools wheel ninja; \
	else \
	  $(PYTHON) -m venv $(VENV) && $(PIP) install -q --no-compile "$(TORCH_SPEC)" setuptools wheel ninja \
	  && { $(PY) -m compileall -qq -j 0 "$$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
	       >/dev/null 2>&1 || true; }; \
	fi
	@# bytecode at install time: with PYTHONDONTWRITEBYTECODE=1 (this project's hosts) it is the only .pyc there is;
	@# without it every process of the suite compiled its imports afresh (+110 s of `make test`, measured). torch's
	@# is compiled by compileall on every core, not by pip on one (13 + 10 s where pip took 29 s, measured)
	@# the dependencies through uv (PyPI's `uv`, installed here) where the venv holds its own torch: its parallel
	@# download, install and bytecode compile took 24 s where pip took about 100 s of a fresh set-up (measured on the
	@# 2-core VM, the same versions installed); pip stays the route for a venv over the system's torch (uv must not
	@# resolve a second torch from PyPI) and the fallback when uv cannot be had or fails
	@$(PIP) install -q uv >/dev/null 2>&1 || echo "[setup] uv could not be installed: pip installs the dependencies"
	@# our CPU kernels (setup.py, in place) compile on both cores WHILE the dependencies download and install
	@# (one after the other they took 71 + 77 s of a fresh set-up); a failed compile only leaves the just-in-time route.
	@# The real model is fetched (download, dequantise: 14 s) once the dependencies are in, while the compile's last
	@# translation unit still runs on one core (it ended 17 s after uv on the 2-core VM), and so is JupyterLab's setting
	@# (it is the venv's: written into its share/). `setup` and `make test` then start nothing of their own (each
	@# had re-run both, 2 x 1.6 s of importing torch; measured); a model deleted later is fetched on first use.
	@# jsonschema[format-nongpl] (JupyterLab, nbformat, Ray) pulls in rfc3987-syntax, whose import builds a Lark
	@# Earley grammar: 1.2 s in EVERY process importing jsonschema (measured in the suite: both pytest workers, both
	@# JupyterLab servers, 7 Ray processes of tests/test_executor.py; `make report`'s papermill too). It is uninstalled:
	@# jsonschema then skips only its "iri" / "iri-reference" format checks, which nothing here uses
	@( LOWRANK_LIB_BUILD_LOG=$(VENV)/kernels-build.log; \
	   $(PY) setup.py -q build_ext --inplace > $$LOWRANK_LIB_BUILD_LOG 2>&1 \
	     || echo "[setup] building the CPU kernels failed (see $$LOWRANK_LIB_BUILD_LOG): built just in time on first use" ) & \
	 if [ -x $(VENV)/bin/uv ] && grep -q "include-system-site-packages = false" $(VENV)/pyvenv.cfg; then \
	   LOWRANK_LIB_NO_EXT=1 $(VENV)/bin/uv pip install -q --python $(PY) --compile-bytecode --no-build-isolation \
	     -e ".[$(EXTRAS)]" || { echo "[setup] uv failed: pip installs the dependencies"; false; }; \
	 else false; fi \
	 || LOWRANK_LIB_NO_EXT=1 $(PIP) install -q --no-build-isolation -e ".[$(EXTRAS)]"; \
	 rc=$$?; \
	 if [ $$rc = 0 ]; then \
	   { if [ -x $(VENV)/bin/uv ]; then $(VENV)/bin/uv pip uninstall -q --python $(PY) rfc3987-syntax; \
	     else $(PIP) uninstall -y -q rfc3987-syntax; fi; } >/dev/null 2>&1; \
	   { $(FETCH_MODEL) >/dev/null && touch $(VENV)/.fetched; } \
	     || echo "[setup] fetching SmolLM2 beside the kernels' compile failed: \`setup\` fetches it again"; \
	   $(PY) -m lowrank_lib.notebooks lab-settings >/dev/null || rc=$$?; fi; \
	 wait; exit $$rc
	@touch $@

# JupyterLab of this venv saves widget state with a notebook (sliders survive a reopen): `lab-settings` above
setup: $(VENV)/.installed $(VENV)/.fetched

$(VENV)/.fetched: | $(VENV)/.installed
	$(FETCH_MODEL)
	@touch $@

fetch: setup
	$(FETCH_MODEL)

# Our package's bytecode: with PYTHONDONTWRITEBYTECODE=1 (this project's hosts) nothing writes it, so every process
# importing lowrank_lib compiled the modules it imports afresh (up to 0.4 s each time, 90 modules; measured: 50
# processes of the suite import it: pytest workers, notebook kernels, benchmark children). compileall writes what is
# missing or out of date (0.3 s from none, 0.1 s when current); an edited module is recompiled per process until the
# next `make test` or `make report`.
bytecode: setup
	@$(PY) -m compileall -q -j 0 lowrank_lib >/dev/null

lint: setup
	$(PY) -m ruff check lowrank_lib tests benchmarks notebooks

# The oldest-transformers subset runs beside the main suite, not after it: its venv is made (pip: mostly download and
# unpack, ~20 s), then `test-oldest-run` at the lowest CPU priority (nice 19), so it takes only cores the suite
# leaves idle (the suite's last minute runs on one worker) and never slows it; its own --basetemp keeps the two
# pytest sessions' temporary folders apart. Its output is printed after the suite's; either failing fails `make test`.
# Beside the suite it runs as a worker does (tests/xdist_threads.py): one intra-op thread, OpenMP's idle threads
# sleeping, inductor compiling in its own process. With torch's defaults (two spinning OpenMP threads, a pool of
# compile workers) it took 62 CPU-s of a fresh-clone `make test` (process accounting, 2026-12-08) for a subset that
# needs 14 CPU-s alone on one thread (21 at the defaults, measured alone).
OLDEST_BESIDE_ENV := OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE \
	TORCHINDUCTOR_COMPILE_THREADS=1
test: setup lint bytecode
	@( $(MAKE) --no-print-directory $(VENV_OLDEST)/.installed > $(VENV)/oldest-setup.log 2>&1 \
	     || { echo "[test] making $(VENV_OLDEST) failed:" > $(VENV)/oldest-test.log; \
	          cat $(VENV)/oldest-setup.log >> $(VENV)/oldest-test.log; exit 1; }; \
	   nice -n 19 env $(OLDEST_BESIDE_ENV) $(MAKE) --no-print-directory test-oldest-run > $(VENV)/oldest-test.log 2>&1 ) & \
	 $(PY) -m pytest $(XDIST) $(PYTEST_ARGS) tests; rc=$$?; \
	 wait $$! || rc=1; \
	 echo "[test] the oldest-transformers subset (make test-oldest), run beside the suite:"; \
	 cat $(VENV)/oldest-test.log; exit $$rc

$(VENV_OLDEST)/.installed: $(VENV)/.installed pyproject.toml
	rm -rf $(VENV_OLDEST)
	@# no pip of its own (ensurepip: 3.4 CPU-s at full priority beside the suite's start, measured): the main venv's pip
	@# runs in it through the .pth below and installs into it
	nice -n 19 $(PY) -m venv --without-pip $(VENV_OLDEST)
	$(PY) -c "import site, sys; print('import site; ' + '; '.join(f'site.addsitedir({p!r})' for p in sys.path if p.endswith('-packages')))" > "$$($(PY_OLDEST) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/_main_venv.pth"
	@# no bytecode: the subset imports a few dozen of transformers' ~3,000 modules (pip's compile was 5 of its 12 CPU-s)
	@# at the lowest CPU priority, like the subset's run: `make test` makes this venv beside the main suite
	nice -n 19 $(PY_OLDEST) -m pip --disable-pip-version-check install -q --no-compile "transformers==$(TRANSFORMERS_OLDEST)"
	@touch $@

# The transformers-API subset (tests marked `compat`: the cache keyword, HF cache / AttSVD / eviction
# equivalences, engine vs hf_dynamic tokens, Dobi layouts) on the oldest supported transformers.
test-oldest: setup $(VENV_OLDEST)/.installed
	@$(MAKE) --no-print-directory test-oldest-run

# Only the files holding compat tests are collected (a collection of all of tests/ cost each process ~13 CPU-s, more
# than the subset's own tests; tests/compat_files.py stops a run whose compat tests lie elsewhere), in one process: the
# subset runs at the lowest priority beside the suite and is done long before it.
COMPAT_FILES = $(filter-out %conftest.py,$(shell grep -l "pytest.mark.compat" tests/*.py tests/*/*.py 2>/dev/null))

test-oldest-run:
	@$(PY_OLDEST) -c "import transformers; print('[test-oldest] transformers', transformers.__version__)"
	$(PY_OLDEST) -m pytest -q -p no:cacheprovider --basetemp=$(VENV_OLDEST)/pytest-tmp -m compat $(COMPAT_FILES)

# Every notebook at its own parameters -> reports/<nb>.ipynb, figures/, then reports/<nb>.html (offline: no
# script from the network) and reports/index.html with each notebook's headline numbers.
report: setup bytecode
	$(PY) -m lowrank_lib.notebooks run

clean-venv:
	rm -rf $(VENV) $(VENV_OLDEST)
