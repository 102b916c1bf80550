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
