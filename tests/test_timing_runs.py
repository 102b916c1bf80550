"""lowrank_lib.timing's across-run summary (notebooks 02 / 03: medians across repeated runs, with their spread)."""
import pytest

from lowrank_lib.timing import across_runs, repeated_runs, within_noise


def test_across_runs_median_of_run_medians_and_range():
    s = across_runs([40.25, 34.95, 34.30])          # HF static measured three times (issue 27)
    assert s["median_ms"] == 34.95 and s["min_ms"] == 34.30 and s["max_ms"] == 40.25 and s["runs"] == 3
    assert s["min_ms"] <= s["q1_ms"] <= s["median_ms"] <= s["q3_ms"] <= s["max_ms"]
    assert across_runs([2.0, 1.0, 4.0, 3.0])["median_ms"] == 2.5
    one = across_runs([5.0])
    assert one["min_ms"] == one["median_ms"] == one["max_ms"] == one["q1_ms"] == 5.0
    with pytest.raises(ValueError):
        across_runs([])


def test_within_noise_is_range_overlap():
    a, b, c = across_runs([10.0, 11.0, 12.0]), across_runs([11.5, 13.0]), across_runs([12.5, 14.0])
    assert within_noise(a, b) and within_noise(b, a)
    assert not within_noise(a, c) and not within_noise(c, a)
    assert within_noise(a, across_runs([12.0]))       # touching ranges: not separated


def test_repeated_runs_summarise_each_runs_median_across_runs():
    runs = iter([{"a": [0.010, 0.030, 0.020], "b": [0.005]}, {"a": [0.040, 0.050, 0.060], "b": [0.006]},
                 {"a": [0.001, 0.002, 0.003], "b": [0.007]}])
    seen = []
    s = repeated_runs(lambda: next(runs), 3, progress=seen.append)
    assert seen == [0, 1, 2]
    assert s["a"] == across_runs([20.0, 50.0, 2.0]) and s["b"]["median_ms"] == pytest.approx(6.0)
    assert s["a"]["runs"] == 3 and s["a"]["min_ms"] == 2.0 and s["a"]["max_ms"] == 50.0
    with pytest.raises(ValueError):
        repeated_runs(lambda: {}, 0)


def test_speed_verdict_says_within_noise_when_the_ranges_overlap():
    from lowrank_lib.eval.factor_space import speed_verdict

    def row(med, lo, hi):
        return {"ms": med, "ms_min": lo, "ms_max": hi}

    assert speed_verdict(row(5.0, 4.8, 5.2), row(10.0, 9.0, 11.0), "ms") == "2.00× faster than"
    assert speed_verdict(row(10.0, 9.0, 11.0), row(5.0, 4.8, 5.2), "ms") == "2.00× slower than"
    assert speed_verdict(row(5.0, 4.0, 9.5), row(10.0, 9.0, 11.0), "ms").startswith("within noise of (2.00×")
