"""How ``make test`` shares the suite between its workers (``xdist_units.py``)."""
from __future__ import annotations

from pathlib import Path

import pytest
import xdist_units as xu

TESTS = Path(__file__).parent


def test_a_notebook_and_every_test_reading_it_share_a_unit():
    assert xu.unit_of("tests/browser/test_lab.py::test_run_all_then_every_slider[03_graph_replay_ablation]") \
        == xu.unit_of("tests/test_nb_03.py::test_dispatch_counts_agree_with_notebook_02") \
        == xu.unit_of("tests/test_nb_02.py::test_launch_count_notebook") == "notebooks-a"
    assert xu.unit_of("tests/test_notebooks.py::test_executed_outputs_are_clean[05_attsvd_quality_memory]") \
        == "notebooks-b"
    assert xu.unit_of("tests/test_notebooks.py::test_quickstart_metrics") == "notebooks-a"     # names none: 00's
    assert xu.unit_of("tests/test_fused_layer.py::test_x[fp32]") == "test_fused_layer.py"
    with pytest.raises(AssertionError, match="no unit"):
        xu.unit_of("tests/test_nb_42.py::test_x")


def test_units_go_longest_first_and_keep_their_tests_in_order():
    ids = ["tests/test_a.py::t1", "tests/test_b.py::t1", "tests/test_a.py::t2", "tests/test_c.py::t1",
           "tests/test_d.py::t1", "tests/test_b.py::t2"]
    got = xu.longest_first(ids, {"test_a.py": 5.0, "test_b.py": 50.0, "test_c.py": 1.0})
    # b (50 s), then a (5 s) and the unmeasured d at the median (5 s) in their order of appearance, then c
    assert got == ["tests/test_b.py::t1", "tests/test_b.py::t2", "tests/test_a.py::t1", "tests/test_a.py::t2",
                   "tests/test_d.py::t1", "tests/test_c.py::t1"]
    assert xu.longest_first(ids, {}) == sorted(ids, key=lambda i: ["a", "b", "c", "d"].index(i[11]))
    assert sorted(got) == sorted(ids)


def test_the_committed_seconds_name_units_that_exist():
    """A renamed or deleted test file leaves a stale entry: its unit would be scheduled by a guess."""
    seconds = xu.measured_seconds()
    assert seconds, f"{xu.SECONDS_FILE} is missing or empty"
    stale = [u for u in seconds if u not in xu.NOTEBOOK_UNITS and not (TESTS / u).is_file()]
    assert not stale, f"{xu.SECONDS_FILE.name} names units that no longer exist: {stale} (see xdist_units.py)"
    assert set(xu.NOTEBOOK_UNITS) <= set(seconds) and all(s >= 0 for s in seconds.values())


def test_the_recorder_sums_every_phase_per_unit(tmp_path):
    class Report:
        def __init__(self, nodeid, duration):
            self.nodeid, self.duration = nodeid, duration

    rec = xu.SecondsRecorder(str(tmp_path / "s.json"))
    for nid, d in [("tests/test_a.py::t", 1.0), ("tests/test_a.py::t", 2.5), ("tests/test_nb_04.py::t", 4.0),
                   ("tests/browser/test_lab.py::test_run_all_then_every_slider[05_x]", 10.0)]:
        rec.pytest_runtest_logreport(Report(nid, d))
    rec.pytest_sessionfinish(None)
    assert xu.measured_seconds(tmp_path / "s.json") == {"notebooks-b": 14.0, "test_a.py": 3.5}
