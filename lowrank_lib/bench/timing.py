"""THE timing helper of every benchmark: interleaved repeats, medians with their spread.

Ratios mean something only when both sides are measured side by side in one run, on the same load: so every
system is timed in rounds, in a rotated order per round (a slow spell of a shared machine hits every system), and
summarised by the median with the inter-quartile range.

    >>> t = interleaved({"dense": step_dense, "composed": step_composed}, rounds=3, calls=32)
    >>> summary(t["dense"])            # {'median_ms': ..., 'q1_ms': ..., 'q3_ms': ..., 'n': 96}
"""
from __future__ import annotations

import statistics
import time
from typing import Callable, Hashable


def summary(seconds: list[float]) -> dict:
    """Median and quartiles of ``seconds`` in milliseconds (and the sample count)."""
    if not seconds:
        raise ValueError("summary of no samples")
    ms = sorted(1e3 * s for s in seconds)
    q = statistics.quantiles(ms, n=4, method="inclusive") if len(ms) > 1 else [ms[0]] * 3
    return {"median_ms": statistics.median(ms), "q1_ms": q[0], "q3_ms": q[2], "n": len(ms)}


def timed(fn: Callable[[], object], calls: int = 1) -> list[float]:
    """Seconds of each of ``calls`` calls of ``fn``."""
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def interleaved(fns: dict[Hashable, Callable[[], object]], rounds: int, calls: int = 1,
                before_round: Callable[[int], None] | None = None,
                progress: Callable[[int], None] | None = None) -> dict[Hashable, list[float]]:
    """Time every function ``calls`` times per round for ``rounds`` rounds, the order rotated by one each round.

    before_round(r) runs before round r (e.g. set the thread count); progress(r) after it. Returns per key the
    seconds of every call of every round."""
    keys = list(fns)
    out: dict = {k: [] for k in keys}
    for r in range(rounds):
        if before_round is not None:
            before_round(r)
        for k in keys[r % len(keys):] + keys[:r % len(keys)]:
            out[k].extend(timed(fns[k], calls))
        if progress is not None:
            progress(r)
    return out
