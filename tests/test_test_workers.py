"""The test session's own setup (``conftest.py``): xdist workers share the cores instead of oversubscribing them."""
import os
import subprocess
import sys

import conftest
import pytest
import torch


def test_worker_threads_share_the_cores():
    assert conftest.worker_threads(2, 2) == 1
    assert conftest.worker_threads(16, 2) == 8
    assert conftest.worker_threads(2, 4) == 1          # never zero threads
    assert conftest.worker_threads(3, 0) == 3


@pytest.mark.skipif(conftest.WORKER_THREADS is None, reason="not a pytest-xdist worker that sized its threads")
def test_a_worker_and_the_processes_it_starts_run_at_its_share():
    n = conftest.WORKER_THREADS
    assert n == conftest.worker_threads(os.cpu_count() or 1, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    assert torch.get_num_threads() == n
    assert all(os.environ[k] == str(n) for k in conftest.THREAD_ENV)
    child = subprocess.run([sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
                           capture_output=True, text=True, check=True)
    assert int(child.stdout) == n
