"""The sweep executor: serial and Ray give the same results, a failure is retried once then reported by
name, finished results are handed over (written) as they complete and kept when another task fails."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from lowrank_lib.executor import SerialExecutor, SweepError, Task, make_executor, run_sweep


# --- task functions (module level: Ray pickles them by value, see the fixture) ---------------------------
def square_sum(n: int, seed: int) -> dict:
    import torch

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, n, generator=g, dtype=torch.float64)
    return {"n": n, "trace": float((x @ x.T).trace()), "pid": os.getpid()}


def flaky(marker: str, value: int) -> int:
    """Fails on the first call (creates ``marker``), succeeds on the second."""
    p = Path(marker)
    if not p.exists():
        p.write_text("failed once")
        raise RuntimeError(f"first attempt of {value} fails")
    return value


def always_fails(what: str) -> None:
    raise ValueError(f"broken task {what}")


def _tasks():
    return [Task(f"n{n}", square_sum, (n, n)) for n in (3, 8, 5, 13)]


def _strip_pid(results):
    return {k: {kk: vv for kk, vv in v.items() if kk != "pid"} for k, v in results.items()}


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install -e '.[distributed]')")
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])     # workers cannot import tests/ modules
    for attempt in (1, 2):      # Ray gives its raylet 30 s to register: a loaded shared CPU can miss that once
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
            break
        except Exception:
            ray.shutdown()
            if attempt == 2:
                raise
    yield ray
    ray.shutdown()


def test_serial_runs_in_order_and_hands_each_result_over():
    seen = []
    out = run_sweep(_tasks(), on_result=lambda name, v: seen.append(name), progress=False)
    assert list(out) == seen == ["n3", "n8", "n5", "n13"]
    assert out["n8"]["n"] == 8 and len({v["pid"] for v in out.values()}) == 1


def test_retry_once_then_report_by_name_keeping_finished(tmp_path):
    written = {}
    tasks = [Task("ok", square_sum, (4, 0)), Task("flaky", flaky, (str(tmp_path / "m"), 7)),
             Task("broken", always_fails, ("B",)), Task("last", square_sum, (2, 1))]
    with pytest.raises(SweepError) as ei:
        run_sweep(tasks, SerialExecutor(), on_result=lambda n, v: written.setdefault(n, v), progress=False)
    err = ei.value
    assert list(err.failed) == ["broken"] and "broken task B" in err.failed["broken"]
    assert "broken: ValueError: broken task B" in str(err) and "3 finished" in str(err)
    assert list(err.results) == ["ok", "flaky", "last"] and err.results["flaky"] == 7
    assert written.keys() == err.results.keys()         # handed over (written) as they completed


def test_progress_names_each_task(capsys, tmp_path):
    with pytest.raises(SweepError):
        run_sweep([Task("a", square_sum, (2, 0)), Task("bad", always_fails, ("x",))], desc="demo")
    err = capsys.readouterr().err
    assert "[demo] a: done in" in err and "[demo] bad: failed (ValueError: broken task x), retrying" in err
    assert "[demo] bad: FAILED after 2 attempts" in err


def test_bad_arguments():
    with pytest.raises(ValueError, match="unique"):
        run_sweep([Task("a", square_sum, (2, 0))] * 2, progress=False)
    with pytest.raises(ValueError, match="--address needs --executor ray"):
        make_executor("serial", address="auto")
    with pytest.raises(ValueError, match="unknown executor"):
        make_executor("dask")


def test_ray_identical_to_serial_on_two_cpus(ray_cluster):
    serial = run_sweep(_tasks(), progress=False)
    order = []
    par = run_sweep(_tasks(), make_executor("ray"), on_result=lambda n, v: order.append(n), progress=False)
    assert list(par) == list(serial) and sorted(order) == sorted(serial)      # task order, whatever finished first
    assert _strip_pid(par) == _strip_pid(serial)
    assert os.getpid() not in {v["pid"] for v in par.values()}               # really ran in Ray workers


def test_ray_retry_once_and_failure_by_name(ray_cluster, tmp_path):
    written = {}
    tasks = [Task("ok", square_sum, (4, 0)), Task("flaky", flaky, (str(tmp_path / "m"), 7)),
             Task("broken", always_fails, ("B",))]
    with pytest.raises(SweepError) as ei:
        run_sweep(tasks, make_executor("ray"), on_result=lambda n, v: written.setdefault(n, v), progress=False)
    assert list(ei.value.failed) == ["broken"] and "broken task B" in ei.value.failed["broken"]
    assert ei.value.results == {"ok": square_sum(4, 0) | {"pid": ei.value.results["ok"]["pid"]}, "flaky": 7}
    assert written.keys() == {"ok", "flaky"}
    assert ray_cluster.is_initialized()          # a cluster the caller started is left running


# --- the wirings ----------------------------------------------------------------------------------------
def _quality_cfg():
    from lowrank_lib.eval.quality import QualityConfig

    return QualityConfig(model="tiny-smol", keeps=(0.8,), families=("svd", "asvd"), max_windows=1, seq_len=64,
                         calib_samples=2, calib_seq_len=32, progress=False)


def _rows(res):
    return [{k: v for k, v in r.items() if k != "compress_s"} for r in res["rows"]]


def test_quality_table_ray_equals_serial_and_grows_as_tasks_finish(ray_cluster):
    from lowrank_lib.eval.quality import run

    partial = []
    serial = run(_quality_cfg(), on_partial=lambda res: partial.append([r["family"] for r in res["rows"]]))
    assert [r["family"] for r in serial["rows"]] == ["dense", "svd", "asvd"]
    assert partial == [["dense"], ["dense", "svd"], ["dense", "svd", "asvd"]]
    par = run(_quality_cfg(), executor=make_executor("ray"))
    assert _rows(par) == _rows(serial) and par["config"]["executor"] == "ray"
    with pytest.raises(ValueError, match="serial"):
        run(_quality_cfg(), model=object(), executor=make_executor("ray"))


@pytest.mark.smollm2
def test_attsvd_sweep_split_into_tasks_equals_one_budget_sweep(smollm2, tmp_path):
    """bench attsvd's tasks (one per prefill length) merge into what one budget_sweep call returns."""
    import json

    from lowrank_lib.bench.cli import main
    from lowrank_lib.eval.kv_sweep import SweepConfig, budget_sweep

    argv = ["attsvd", "--out", str(tmp_path), "--prompt-len", "32", "48", "--windows", "1", "--gen-len", "8",
            "--budget", "0.5", "--methods", "attsvd", "streamingllm", "--tasks"]
    assert main(argv) == 0
    (path,) = tmp_path.glob("attsvd_*.json")
    got = json.loads(path.read_text())
    ref = budget_sweep(SweepConfig("smollm2", prompt_len=[32, 48], windows=1, cont=8, budgets=[0.5],
                                   methods=["attsvd", "streamingllm"], window=32, chunk=128, lengths=[], n_per=1,
                                   tasks=[], step=32, seed=0, longctx_budgets=[0.5]), progress=False)
    assert list(got["quality"]) == ["32", "48"]
    assert got["quality"] == json.loads(json.dumps(ref["quality"])) and got["targets"] == ref["targets"]
