"""lowrank_lib.notebooks.kernel: papermill's kernel client never waits on a socket wake-up alone."""
from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from queue import Empty

import nbformat
import pytest
from jupyter_client.channels import AsyncZMQSocketChannel

from lowrank_lib import notebooks
from lowrank_lib.notebooks import kernel


def _run(coro):
    """The coroutine on a fresh loop in its own thread (a test before may leave this thread's loop running)."""
    with ThreadPoolExecutor(1) as ex:
        return ex.submit(asyncio.run, coro).result()


def test_a_wait_without_timeout_becomes_repeated_level_checks(monkeypatch):
    """get_msg(None) waits POLL_S at a time until a message comes (a reply stranded behind a lost wake-up is found
    by the next check); a finite timeout goes through unchanged, Empty included."""
    seen, replies = [], [Empty, Empty, {"msg": 1}]

    async def base(self, timeout=None):
        seen.append(timeout)
        r = replies.pop(0)
        if r is Empty:
            raise Empty
        return r

    monkeypatch.setattr(AsyncZMQSocketChannel, "get_msg", base)
    ch = kernel.PollingChannel.__new__(kernel.PollingChannel)
    assert _run(ch.get_msg()) == {"msg": 1} and seen == [kernel.POLL_S] * 3
    replies[:] = [Empty]
    with pytest.raises(Empty):
        _run(ch.get_msg(0.5))
    assert seen[-1] == 0.5


def test_the_manager_makes_polling_clients():
    km = kernel.PollingKernelManager()
    kc = km.client()
    assert isinstance(kc, kernel.PollingKernelClient)
    assert kc.shell_channel_class is kc.iopub_channel_class is kc.control_channel_class is kernel.PollingChannel


def test_papermill_runs_notebooks_with_the_polling_manager(tmp_path, monkeypatch):
    """The one papermill call of the notebook runner passes the manager; a real kernel runs a notebook through it."""
    import papermill as pm

    got = {}
    real = pm.execute_notebook

    def spy(*a, **k):
        got.update(k)
        return real(*a, **k)

    monkeypatch.setattr(pm, "execute_notebook", spy)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from pathlib import Path\nimport json, time\ntime.sleep(1.5)\n"
        "Path(OUT_DIR).mkdir(parents=True, exist_ok=True)\n(Path(OUT_DIR) / 'metrics.json').write_text(json.dumps({'ok': 1}))")])
    nb.cells.insert(0, nbformat.v4.new_code_cell("OUT_DIR = ''", metadata={"tags": ["parameters"]}))
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    monkeypatch.setattr(notebooks, "notebooks_dir", lambda: tmp_path)
    monkeypatch.setattr(notebooks, "root", lambda: tmp_path)
    nbformat.write(nb, tmp_path / "k.ipynb")
    metrics = notebooks.papermill_run("k", tmp_path / "out" / "k.ipynb", {"OUT_DIR": str(tmp_path / "o")},
                                      progress=False, tracked=False)
    assert metrics == {"ok": 1} and got["kernel_manager_class"] is kernel.PollingKernelManager
