"""eval.paired: the sentence a notebook may write about two methods measured on the same windows."""
import math

import pytest
from hypothesis import given, settings, strategies as st

from lowrank_lib.eval.paired import compare, pairwise

finite = st.floats(min_value=-1e3, max_value=1e3, allow_nan=False)


def test_a_consistent_gap_is_a_win_and_noise_is_not():
    base = [1.0, 2.0, 0.5, 3.0, 1.5, 2.5, 0.8, 1.2]
    jitter = [0.01, -0.02, 0.015, -0.01, 0.02, -0.015, 0.005, -0.005]
    better = [x - 0.1 + j for x, j in zip(base, jitter)]
    c = compare(better, base, ("new", "old"))
    assert c.verdict == "a better" and c.better == "new" and c.ci[1] < 0 and c.a_lower == 8
    assert "new better" in c.sentence() and "8/8" in c.sentence()
    # the same values in a shuffled pairing: a gap of the same mean but no consistent sign -> within noise
    noisy = [x + s for x, s in zip(base, [0.9, -1.0, 0.8, -0.9, 1.1, -1.2, 0.7, -0.6])]
    c = compare(noisy, base, ("new", "old"))
    assert c.verdict == "within noise" and c.better is None and c.ci[0] < 0 < c.ci[1]


def test_higher_is_better_flips_the_verdict():
    a, b = [0.9, 0.8, 0.85, 0.95], [0.5, 0.4, 0.45, 0.55]
    assert compare(a, b, lower_is_better=False).verdict == "a better"
    assert compare(a, b, lower_is_better=True).verdict == "b better"


def test_log_scale_reports_the_geometric_ratio():
    b = [10.0, 20.0, 40.0, 5.0]
    a = [x * 2 for x in b]
    c = compare(a, b, scale="log")
    assert math.isclose(math.exp(c.mean_diff), 2.0) and c.verdict == "b better"
    assert "2x" in c.sentence()
    with pytest.raises(ValueError, match="positive"):
        compare([1.0, 0.0], [1.0, 1.0], scale="log")


def test_one_window_cannot_be_decided():
    c = compare([1.0], [2.0])
    assert c.verdict == "within noise" and "cannot be decided" in c.sentence()


@pytest.mark.parametrize("a, b, match", [([1.0, 2.0], [1.0], "same windows"), ([], [], "no windows"),
                                         ([1.0, float("nan")], [1.0, 1.0], "finite")])
def test_hostile_inputs_name_the_problem(a, b, match):
    with pytest.raises(ValueError, match=match):
        compare(a, b)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(finite, finite), min_size=2, max_size=12))
def test_properties(pairs):
    a, b = [p[0] for p in pairs], [p[1] for p in pairs]
    c, r = compare(a, b, n_boot=400), compare(b, a, n_boot=400)
    assert c.a_lower + c.b_lower + c.ties == c.n == len(pairs)
    assert (c.a_lower, c.b_lower) == (r.b_lower, r.a_lower)                       # swapping swaps the counts
    assert c.ci[0] <= c.mean_diff + 1e-9 and c.mean_diff - 1e-9 <= c.ci[1] or c.ci[0] == c.ci[1]
    assert math.isclose(c.mean_diff, -r.mean_diff, abs_tol=1e-9)
    flipped = {"a better": "b better", "b better": "a better", "within noise": "within noise"}
    assert r.verdict == flipped[c.verdict]
    assert compare(a, a).verdict == "within noise"                             # a method is never better than itself
    assert compare(a, b, n_boot=400) == c                                        # the same data, the same sentence


def test_pairwise_against_a_reference():
    res = {"dense": [1.0, 1.1, 0.9], "x": [1.5, 1.6, 1.4], "y": [1.0, 1.1, 0.9]}
    out = pairwise(res, "dense")
    assert set(out) == {"x", "y"} and out["x"].verdict == "b better" and out["y"].verdict == "within noise"
    with pytest.raises(KeyError, match="reference"):
        pairwise(res, "nope")
