"""The test session's own setup (``xdist_threads.py``): xdist workers share the cores instead of oversubscribing them."""
import os
import subprocess
import sys

import pytest
import torch
import xdist_threads as workers


def test_worker_threads_share_the_cores():
    assert workers.worker_threads(2, 2) == 1
    assert workers.worker_threads(16, 2) == 8
    assert workers.worker_threads(2, 4) == 1          # never zero threads
    assert workers.worker_threads(3, 0) == 3


@pytest.mark.skipif(workers.CHOSEN not in os.environ, reason="not a pytest-xdist worker that sized its threads")
def test_a_worker_and_the_processes_it_starts_run_at_its_share():
    n = int(os.environ[workers.CHOSEN])
    assert n == workers.worker_threads(os.cpu_count() or 1, int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    assert torch.get_num_threads() == n
    assert all(os.environ[k] == str(n) for k in workers.THREAD_ENV)
    import torch._inductor.config as inductor_config

    assert inductor_config.compile_threads == 1 and os.environ[workers.COMPILE_ENV] == "1"   # no compile pool
    child = subprocess.run([sys.executable, "-c", "import torch, torch._inductor.config as c; "
                            "print(torch.get_num_threads(), c.compile_threads)"],
                           capture_output=True, text=True, check=True)
    assert child.stdout.split() == [str(n), "1"]


class _Config:
    def __init__(self, n, worker=False):
        self.option = type("Option", (), {"numprocesses": n})()
        if worker:
            self.workerinput = {}


def test_the_controller_of_several_workers_makes_openmp_wait_passively(monkeypatch):
    monkeypatch.setenv(workers.WAIT_ENV[0], "")                        # records the caller's state: undone after
    monkeypatch.delenv(workers.WAIT_ENV[0])
    for config in (_Config(None), _Config(1), _Config(2, worker=True), _Config("auto")):
        assert not workers.passive_waits(config) and workers.WAIT_ENV[0] not in os.environ
    assert workers.passive_waits(_Config(2)) and os.environ[workers.WAIT_ENV[0]] == "PASSIVE"
    monkeypatch.setenv(workers.WAIT_ENV[0], "ACTIVE")                 # the caller's choice stands
    assert not workers.passive_waits(_Config(4)) and os.environ[workers.WAIT_ENV[0]] == "ACTIVE"


@pytest.mark.skipif(workers.CHOSEN not in os.environ, reason="not a pytest-xdist worker that sized its threads")
def test_a_worker_inherits_the_passive_wait_policy_from_its_controller():
    assert os.environ.get(workers.WAIT_ENV[0]) == workers.WAIT_ENV[1]
