"""lowrank_lib/timing.py, the one timing helper: the rotated schedule, warm-up, per-sample sync and inner calls, and the
summary arithmetic (a fake clock that ticks a known amount: no speed assertions)."""
import statistics

import pytest

from lowrank_lib import timing


class _Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_interleaved_rotates_warms_up_and_times_each_call(monkeypatch):
    clock, calls = _Clock(), []
    monkeypatch.setattr(timing.time, "perf_counter", clock)

    def work(name, dt):
        def fn():
            calls.append(name)
            clock.t += dt
        return fn

    syncs = []
    out = timing.interleaved({"a": work("a", 1e-3), "b": work("b", 2e-3), "c": work("c", 4e-3)}, rounds=3, calls=2,
                             warmup=1, sync=lambda: syncs.append(1), inner=2)
    assert calls[:3] == ["a", "b", "c"]                                  # one warm-up call each, untimed
    per_round = [calls[3 + 12 * r: 3 + 12 * (r + 1)] for r in range(3)]
    assert [r[::4] for r in per_round] == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert out == {"a": pytest.approx([1e-3] * 6), "b": pytest.approx([2e-3] * 6), "c": pytest.approx([4e-3] * 6)}
    assert len(syncs) == 1 + 2 * 3 * 3 * 2                              # after warm-up, around every sample
    with pytest.raises(ValueError, match="inner"):
        timing.timed(lambda: None, inner=0)


def test_before_runs_untimed_before_every_sample(monkeypatch):
    """``before`` (a cache flush) runs once before each sample, outside the clock, after any warm-up."""
    clock, calls = _Clock(), []
    monkeypatch.setattr(timing.time, "perf_counter", clock)

    def fn():
        calls.append("f")
        clock.t += 1e-3

    def flush():
        calls.append("flush")
        clock.t += 5.0                       # slow, and never in a sample

    out = timing.interleaved({"a": fn}, rounds=2, calls=2, warmup=1, inner=3, before=flush)
    assert calls == ["f"] + ["flush", "f", "f", "f"] * 4
    assert out == {"a": pytest.approx([1e-3] * 4)}
    assert timing.timed(fn, calls=1, before=flush) == pytest.approx([1e-3])


def test_interleaved_samples_keeps_each_functions_own_samples():
    order = []
    out = timing.interleaved_samples({k: (lambda k=k: order.append(k) or [float(len(order))]) for k in "xy"}, 2)
    assert order == ["x", "y", "y", "x"] and out == {"x": [1.0, 4.0], "y": [2.0, 3.0]}
    assert list(timing.rotations([], 2)) == [(0, []), (1, [])]


def test_summary_is_median_and_inclusive_quartiles():
    s = [0.004, 0.001, 0.003, 0.002, 0.010]
    q = statistics.quantiles([1e3 * x for x in s], n=4, method="inclusive")
    assert timing.summary(s) == pytest.approx({"median_ms": 3.0, "q1_ms": q[0], "q3_ms": q[2], "p10_ms": 1.4,
                                               "p90_ms": 7.6, "n": 5})    # 1 + 0.4 * (2 - 1); 4 + 0.6 * (10 - 4)
    assert timing.summary([0.5]) == {"median_ms": 500.0, "q1_ms": 500.0, "q3_ms": 500.0, "p10_ms": 500.0,
                                     "p90_ms": 500.0, "n": 1}
    with pytest.raises(ValueError, match="no samples"):
        timing.summary([])
