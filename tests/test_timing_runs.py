"""lowrank_lib.timing's across-run summary (notebooks 02 / 03: medians across repeated runs, with their spread)."""
import pytest

from lowrank_lib.timing import across_runs, within_noise


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
