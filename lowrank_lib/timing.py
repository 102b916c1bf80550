"""THE timing helper of every measurement (the benchmarks, the library's profiling and ablation, the notebooks):
interleaved repeats, medians with their spread. A leaf: the standard library only.

Ratios mean something only when both sides are measured side by side in one run, on the same load: so every
system is timed in rounds, in a rotated order per round (a slow spell of a shared machine hits every system), and
summarised by the median with the inter-quartile range.

    >>> t = interleaved({"dense": step_dense, "composed": step_composed}, rounds=3, calls=32)
    >>> summary(t["dense"])            # {'median_ms': ..., 'q1_ms': ..., 'q3_ms': ..., 'p10_ms': ..., 'p90_ms': ..., 'n': 96}

On CUDA pass ``sync=torch.cuda.synchronize`` (each sample is bracketed by it) and ``inner`` > 1 to amortise the
host sync over back-to-back calls. A function that measures its own samples (the shared decode loop
``run_generation`` times every step itself) is scheduled the same way with :func:`interleaved_samples`.
A single wall time of a one-off phase (a load, a prefill, a compile) is a plain ``perf_counter`` pair, not this.

Across runs: the spread inside one run (its IQR) hides a slow or fast spell that shifts a whole run. A timing that
is repeated as R runs (each reduced to its own median) is summarised by :func:`across_runs` (the median of the run
medians, their min-max and quartiles), and two such timings differ only when their min-max ranges do not overlap
(:func:`within_noise`).
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable, Iterable, Iterator

__all__ = ["across_runs", "interleaved", "interleaved_samples", "repeated_runs", "rotations", "summary", "timed",
           "within_noise"]


def _cuts(ms: list[float], n: int) -> list[float]:
    """The n-1 cut points dividing sorted ``ms`` into n groups (inclusive method: within the sample's range; one
    value: itself n-1 times). The one quantile rule of :func:`summary` and :func:`across_runs`."""
    return statistics.quantiles(ms, n=n, method="inclusive") if len(ms) > 1 else [ms[0]] * (n - 1)


def summary(seconds: list[float]) -> dict:
    """Median, quartiles and 10th / 90th percentiles of ``seconds`` in milliseconds (inclusive method: every
    value lies within the sample's range), and the sample count. THE place medians and quantiles are taken."""
    if not seconds:
        raise ValueError("summary of no samples")
    ms = sorted(1e3 * s for s in seconds)
    q, d = _cuts(ms, 4), _cuts(ms, 10)
    return {"median_ms": statistics.median(ms), "q1_ms": q[0], "q3_ms": q[2], "p10_ms": d[0], "p90_ms": d[8],
            "n": len(ms)}


def timed(fn: Callable[[], object], calls: int = 1, sync: Callable[[], object] | None = None,
          inner: int = 1, before: Callable[[], object] | None = None) -> list[float]:
    """Seconds of each of ``calls`` samples of ``fn``: a sample is ``inner`` back-to-back calls (divided out),
    bracketed by ``sync()`` when given (e.g. ``torch.cuda.synchronize``). ``before()``, when given, runs before
    each sample, untimed (e.g. :func:`lowrank_lib.host.cache_flusher`'s flush: every sample starts from memory)."""
    if inner < 1:
        raise ValueError(f"inner must be >= 1, got {inner}")
    out = []
    for _ in range(calls):
        if before is not None:
            before()
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        if sync is not None:
            sync()
        out.append((time.perf_counter() - t0) / inner)
    return out


def rotations(keys: Iterable[Hashable], rounds: int) -> Iterator[tuple[int, list]]:
    """(round, order) for every round: the keys rotated left by the round number."""
    keys = list(keys)
    for r in range(rounds):
        s = r % len(keys) if keys else 0
        yield r, keys[s:] + keys[:s]


def interleaved(fns: dict[Hashable, Callable[[], object]], rounds: int, calls: int = 1,
                before_round: Callable[[int], None] | None = None,
                progress: Callable[[int], None] | None = None, warmup: int = 0,
                sync: Callable[[], object] | None = None, inner: int = 1,
                before: Callable[[], object] | None = None) -> dict[Hashable, list[float]]:
    """Time every function ``calls`` times per round for ``rounds`` rounds, the order rotated by one each round.

    before_round(r) runs before round r (e.g. set the thread count); progress(r) after it. ``warmup`` untimed
    calls of every function come first; ``sync`` / ``inner`` / ``before`` (untimed, before every sample) as in
    :func:`timed`. Returns per key the seconds of every call of every round."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    if sync is not None and warmup:
        sync()
    return interleaved_samples({k: (lambda f=f: timed(f, calls, sync, inner, before)) for k, f in fns.items()}, rounds,
                               before_round, progress)


def interleaved_samples(fns: dict[Hashable, Callable[[], list[float]]], rounds: int,
                        before_round: Callable[[int], None] | None = None,
                        progress: Callable[[int], None] | None = None) -> dict[Hashable, list[float]]:
    """The schedule of :func:`interleaved` for functions that return their own samples (seconds): every function
    once per round, in the rotated order; returns per key the concatenated samples of every round."""
    out: dict = {k: [] for k in fns}
    for r, order in rotations(fns, rounds):
        if before_round is not None:
            before_round(r)
        for k in order:
            out[k].extend(fns[k]())
        if progress is not None:
            progress(r)
    return out


def across_runs(run_medians_ms: list[float]) -> dict:
    """R runs of one timing, each given as its own median (ms): the median of the run medians, their min, max and
    quartiles (inclusive method), and R. ``min_ms <= q1_ms <= median_ms <= q3_ms <= max_ms`` always."""
    if not run_medians_ms:
        raise ValueError("across_runs of no runs")
    ms = sorted(float(v) for v in run_medians_ms)
    q = _cuts(ms, 4)
    return {"median_ms": statistics.median(ms), "min_ms": ms[0], "max_ms": ms[-1], "q1_ms": q[0], "q3_ms": q[2],
            "runs": len(ms)}


def repeated_runs(run: Callable[[], dict[Hashable, list[float]]], runs: int,
                  progress: Callable[[int], None] | None = None) -> dict[Hashable, dict]:
    """``run()`` (one interleaved measurement: key -> seconds, e.g. a call of :func:`interleaved`) ``runs`` times;
    per key, :func:`across_runs` of each run's median (ms)."""
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    medians: dict[Hashable, list[float]] = {}
    for i in range(runs):
        for k, seconds in run().items():
            medians.setdefault(k, []).append(summary(seconds)["median_ms"])
        if progress is not None:
            progress(i)
    return {k: across_runs(v) for k, v in medians.items()}


def within_noise(a: dict, b: dict) -> bool:
    """Whether two :func:`across_runs` summaries overlap (``[min_ms, max_ms]`` ranges intersect): then neither is
    faster by this measurement, and a sentence says "within noise"."""
    return not (a["max_ms"] < b["min_ms"] or b["max_ms"] < a["min_ms"])
