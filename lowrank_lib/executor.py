"""The ONE sweep executor: named tasks run serially (default) or on a Ray cluster, results as they finish.

A sweep is a list of :class:`Task` (a name, a module-level function and its picklable arguments).
:func:`run_sweep` runs them on an executor, reports progress per task, hands each finished result to
``on_result`` at once (so the caller writes it as it completes: a crash later loses nothing), retries a
failed task once, and at the end raises :class:`SweepError` naming every task that failed twice; the
finished ones were already handed over. Results come back in task order, so a Ray run returns (and
writes) exactly what the serial run does.

    from lowrank_lib.executor import Task, make_executor, run_sweep
    tasks = [Task(f"keep{k}", measure, (k,)) for k in (0.8, 0.6)]
    out = run_sweep(tasks, make_executor("ray", address="auto"), on_result=lambda name, value: save(value))

Executors:

- :class:`SerialExecutor`: in this process, in task order (no extra dependency).
- :class:`RayExecutor`: Ray tasks (``pip install -e .[distributed]``); ``address=None`` starts a local
  cluster on this machine (``num_cpus`` of it), ``"auto"`` joins the one ``ray start --head`` runs here,
  ``"HOST:6379"`` a remote head from one of its nodes, ``"ray://HOST:10001"`` a cluster through Ray
  Client (``ray[client]``). Each task asks for ``cpus_per_task`` CPUs; every node needs lowrank_lib installed (the same
  checkout) and, for the real model, its cache (``LOWRANK_LIB_CACHE``).

Retries are done here, not by Ray (``max_retries=0``), so both executors retry exactly once, for an
exception in the task and for a lost worker alike, and the report counts attempts.

Commands take ``--executor {serial,ray} [--address ADDR] [--ray-cpus N]`` through :func:`add_arguments`
and :func:`from_args`. A leaf module: nothing of lowrank_lib is imported; ``ray`` only by RayExecutor.
"""
from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

__all__ = ["add_arguments", "Event", "EXECUTORS", "from_args", "make_executor", "RayExecutor", "run_sweep",
           "SerialExecutor", "SweepError", "Task"]

EXECUTORS = ("serial", "ray")


@dataclass(frozen=True)
class Task:
    """``fn(*args, **kwargs)`` under a unique ``name``; ``fn`` must be importable (module level) for Ray."""

    name: str
    fn: Callable
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)


@dataclass
class Event:
    """What an executor reports about one attempt: ``"done"`` (``value``), ``"retry"`` or ``"failed"`` (``error``)."""

    name: str
    status: str
    attempt: int
    seconds: float
    value: Any = None
    error: str | None = None


class SweepError(RuntimeError):
    """Tasks that failed on every attempt; ``results`` holds the finished ones (already handed over)."""

    def __init__(self, failed: dict[str, str], results: dict[str, Any]):
        self.failed, self.results = failed, results
        summary = "\n".join(f"  {name}: {_last_line(err)}" for name, err in failed.items())
        detail = "\n".join(f"--- {name} (last attempt):\n" + "\n".join(err.strip().splitlines()[-40:])
                           for name, err in failed.items())
        super().__init__(f"{len(failed)} of {len(failed) + len(results)} tasks failed after a retry "
                         f"({len(results)} finished and kept):\n{summary}\n{detail}")


def _error(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))


def _timed_call(fn, args, kwargs, threads: int | None = None):
    if threads:                 # in a Ray worker: the driver's intra-op thread count (same reduction order)
        import torch

        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    value = fn(*args, **kwargs)
    return value, time.perf_counter() - t0


class SerialExecutor:
    """Every task in this process, in order; a failure is retried once at once."""

    name = "serial"

    def __init__(self, retries: int = 1):
        self.retries = retries

    def map(self, tasks: Iterable[Task]) -> Iterator[Event]:
        for t in tasks:
            for attempt in range(1, self.retries + 2):
                t0 = time.perf_counter()
                try:
                    value, dt = _timed_call(t.fn, t.args, t.kwargs)
                except Exception as e:  # noqa: BLE001 - reported by name, the sweep goes on
                    status = "retry" if attempt <= self.retries else "failed"
                    yield Event(t.name, status, attempt, time.perf_counter() - t0, error=_error(e))
                    continue
                yield Event(t.name, "done", attempt, dt, value=value)
                break


class RayExecutor:
    """Ray tasks, ``cpus_per_task`` CPUs each, yielded as they complete; a failure is resubmitted once.

    Joins the cluster at ``address`` (or starts a local one with ``num_cpus`` when ``address`` is None);
    a Ray already initialised in this process is used as it is and left running. Each task runs torch
    with ``threads`` intra-op threads, default the driver's ``torch.get_num_threads()``: a CPU reduction's
    order depends on it, so the same count is what makes the results bit-identical to the serial run
    (Ray itself would give a 1-CPU task one thread). Pass ``threads=cpus_per_task`` to trade that for no
    oversubscription.
    """

    name = "ray"

    def __init__(self, address: str | None = None, num_cpus: int | None = None, cpus_per_task: float = 1,
                 retries: int = 1, runtime_env: dict | None = None, threads: int | None = None):
        self.address, self.num_cpus, self.cpus_per_task = address, num_cpus, cpus_per_task
        self.retries, self.runtime_env, self.threads = retries, runtime_env, threads

    def _start(self):
        try:
            import ray
        except ImportError as e:
            raise ImportError("--executor ray needs Ray: pip install -e '.[distributed]'") from e
        if ray.is_initialized():
            return ray, False
        # no address: always a NEW local instance ("local"); Ray's own default would join whatever cluster
        # /tmp/ray/ray_current_cluster names (possibly a dead head), and then refuses num_cpus
        kw = {"address": self.address or "local", "runtime_env": self.runtime_env, "log_to_driver": True}
        if self.address is None:
            kw |= {"num_cpus": self.num_cpus, "include_dashboard": False}
        ray.init(**{k: v for k, v in kw.items() if v is not None})
        return ray, True

    def map(self, tasks: Iterable[Task]) -> Iterator[Event]:
        ray, started = self._start()
        call = ray.remote(_timed_call).options(num_cpus=self.cpus_per_task, max_retries=0)
        pending: dict = {}
        submitted: dict[str, float] = {}
        threads = self.threads
        if threads is None and "torch" in sys.modules:
            threads = sys.modules["torch"].get_num_threads()

        def submit(t: Task, attempt: int):
            submitted[t.name] = time.perf_counter()
            pending[call.remote(t.fn, t.args, t.kwargs, threads)] = (t, attempt)

        try:
            for t in tasks:
                submit(t, 1)
            while pending:
                (ref,), _ = ray.wait(list(pending), num_returns=1)
                t, attempt = pending.pop(ref)
                try:
                    value, dt = ray.get(ref)
                except Exception as e:  # noqa: BLE001 - RayTaskError (the task's exception) or a lost worker
                    cause = getattr(e, "cause", None) or e
                    err = _error(cause) if cause is not e else str(e)
                    wall = time.perf_counter() - submitted[t.name]
                    if attempt <= self.retries:
                        yield Event(t.name, "retry", attempt, wall, error=err)
                        submit(t, attempt + 1)
                    else:
                        yield Event(t.name, "failed", attempt, wall, error=err)
                    continue
                yield Event(t.name, "done", attempt, dt, value=value)
        finally:
            for ref in pending:
                ray.cancel(ref, force=True)
            if started:
                ray.shutdown()


def make_executor(name: str = "serial", address: str | None = None, num_cpus: int | None = None,
                  retries: int = 1):
    """``"serial"`` or ``"ray"`` (``address``/``num_cpus`` as in :class:`RayExecutor`)."""
    if name == "serial":
        if address is not None:
            raise ValueError("--address needs --executor ray")
        return SerialExecutor(retries=retries)
    if name == "ray":
        return RayExecutor(address=address, num_cpus=num_cpus, retries=retries)
    raise ValueError(f"unknown executor {name!r}; choose from {EXECUTORS}")


def run_sweep(tasks: list[Task], executor=None, on_result: Callable[[str, Any], None] | None = None,
              progress: bool = True, desc: str = "sweep") -> dict[str, Any]:
    """Run ``tasks``; ``{name: value}`` in task order. ``on_result(name, value)`` as each one finishes.

    Progress: one line per finished, retried or failed task (stderr) and a bar over the tasks. Raises
    :class:`SweepError` after the last task when any failed twice (the finished ones were handed over).
    """
    from tqdm.auto import tqdm

    names = [t.name for t in tasks]
    if len(set(names)) != len(names):
        raise ValueError(f"task names must be unique: {names}")
    executor = executor or SerialExecutor()
    done: dict[str, Any] = {}
    failed: dict[str, str] = {}
    bar = tqdm(total=len(tasks), desc=f"{desc} ({executor.name})", disable=not progress, file=sys.stderr)

    def say(msg: str):
        if progress:
            bar.write(f"[{desc}] {msg}", file=sys.stderr)

    try:
        for ev in executor.map(tasks):
            if ev.status == "done":
                done[ev.name] = ev.value
                if on_result is not None:
                    on_result(ev.name, ev.value)
                bar.update(1)
                say(f"{ev.name}: done in {ev.seconds:.1f}s" + (f" (attempt {ev.attempt})" if ev.attempt > 1 else "")
                    + f" [{len(done)}/{len(tasks)}]")
            elif ev.status == "retry":
                say(f"{ev.name}: failed ({_last_line(ev.error)}), retrying")
            else:
                failed[ev.name] = ev.error or ""
                bar.update(1)
                say(f"{ev.name}: FAILED after {ev.attempt} attempts: {_last_line(ev.error)}")
    finally:
        bar.close()
    ordered = {n: done[n] for n in names if n in done}
    if failed:
        raise SweepError({n: failed[n] for n in names if n in failed}, ordered)
    return ordered


def _last_line(err: str | None) -> str:
    lines = (err or "").strip().splitlines()
    return lines[-1] if lines else "?"


def add_arguments(p) -> None:
    """``--executor``, ``--address``, ``--ray-cpus`` on an argparse parser."""
    p.add_argument("--executor", choices=EXECUTORS, default="serial",
                   help="run the sweep's tasks here, one after the other (serial), or as Ray tasks (ray)")
    p.add_argument("--address", default=None,
                   help="Ray cluster to join: 'auto' (the `ray start --head` of this machine), HOST:6379, or "
                        "ray://HOST:10001 (Ray Client); default: a local cluster of --ray-cpus CPUs")
    p.add_argument("--ray-cpus", type=int, default=None, help="CPUs of the local Ray cluster (default: all)")


def from_args(a):
    """The executor the parsed ``--executor/--address/--ray-cpus`` name."""
    return make_executor(a.executor, address=a.address, num_cpus=a.ray_cpus)
