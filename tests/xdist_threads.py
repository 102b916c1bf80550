"""pytest-xdist workers share the cores instead of oversubscribing them (``conftest.pytest_configure`` calls
:func:`share_cores`).

Every worker (and the notebook kernel or child process it starts) at torch's default of one thread per core
oversubscribes the machine, and OpenMP's spinning threads then lose far more than the cores they wait for. Measured
on the 2-core VM: 20 fp32 SVDs of 576x1536 take 1.9 s alone at 2 threads, 8.3 s beside one busy 2-thread process,
3.4 s at 1 thread; a fresh-clone ``make test`` ran pytest in 31 min before (browser Run All of notebook 05: 906 s) and
7 min 20 s after (05: 77 s). Tests that measure thread scaling set their thread counts explicitly.
"""
from __future__ import annotations

import os

import torch

#: the environment variables that size the BLAS / OpenMP pools of torch and of every process a test starts
THREAD_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
#: torch.compile's (inductor's) compile workers: one means it compiles in the worker's own process, not in a pool
#: of ``compile_threads`` subprocesses started per worker (more processes than the worker's share of cores, and
#: one more kind of child that can outlive or wedge a worker)
COMPILE_ENV = "TORCHINDUCTOR_COMPILE_THREADS"
#: where :func:`share_cores` records what it chose (unset: not a worker, or the caller chose the threads)
CHOSEN = "LOWRANK_LIB_TEST_WORKER_THREADS"
#: OpenMP's idle threads: PASSIVE sleeps at once instead of spinning. Read by libgomp when torch loads it, so the
#: controller sets it before it starts the workers (:func:`passive_waits`); they and every process they start inherit it
WAIT_ENV = ("OMP_WAIT_POLICY", "PASSIVE")


def worker_threads(cores: int, workers: int) -> int:
    """Intra-op threads per worker: the cores shared out, at least one."""
    return max(1, cores // max(1, workers))


def share_cores() -> int | None:
    """In a pytest-xdist worker of a run with several workers, and unless the caller set ``OMP_NUM_THREADS``:
    torch and every process started from here get :func:`worker_threads`. Returns the count chosen, or None."""
    n_workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if n_workers < 2 or "OMP_NUM_THREADS" in os.environ:
        return None
    n = worker_threads(os.cpu_count() or 1, n_workers)
    os.environ.update({k: str(n) for k in THREAD_ENV} | {CHOSEN: str(n), COMPILE_ENV: "1"})
    torch.set_num_threads(n)
    import torch._inductor.config as inductor_config     # read the variable at import; set it if already imported

    inductor_config.compile_threads = 1
    return n


def passive_waits(config) -> bool:
    """In the controller of a run with several xdist workers, unless the caller set ``OMP_WAIT_POLICY``: the workers
    (started after ``pytest_configure``) and what they start wait passively. A test that runs two threads on purpose
    (thread-count equalities, the kernels' pool) shares the cores with the other worker, and a spinning OpenMP thread
    then burns the slice its partner needs: measured on the 2-core VM, two test files in two workers took 66 s where
    they took 55 s with PASSIVE (and 58.5 against 51.7 s for three others). Returns whether it set the variable."""
    n = getattr(config.option, "numprocesses", None) or 0
    if hasattr(config, "workerinput") or not isinstance(n, int) or n < 2 or WAIT_ENV[0] in os.environ:
        return False
    os.environ[WAIT_ENV[0]] = WAIT_ENV[1]
    return True

