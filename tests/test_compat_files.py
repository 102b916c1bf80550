"""`make test-oldest` collects only the files that spell the compat marker; conftest stops a run that hides one."""
from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace

import pytest

import compat_files

ROOT = Path(__file__).resolve().parents[1]


def test_the_makefile_greps_for_the_marker_conftest_checks():
    line = next(ln for ln in (ROOT / "Makefile").read_text().splitlines() if ln.startswith("COMPAT_FILES"))
    assert re.search(r'grep -l "([^"]+)"', line).group(1) == compat_files.MARK, line
    assert "$(COMPAT_FILES)" in (ROOT / "Makefile").read_text()


def _item(path: Path, compat: bool):
    return SimpleNamespace(path=path, get_closest_marker=lambda name: object() if compat and name == "compat" else None)


def test_a_compat_test_in_a_file_without_the_marker_stops_collection(tmp_path):
    spelled, hidden = tmp_path / "test_a.py", tmp_path / "test_b.py"
    spelled.write_text("import pytest\npytestmark = pytest.mark.compat\n")
    hidden.write_text("import pytest\nCOMPAT = getattr(pytest.mark, \"compat\")\n")     # the marker, not spelled
    compat_files.check([_item(spelled, True), _item(hidden, False)])
    with pytest.raises(pytest.UsageError, match=r"test_b\.py"):
        compat_files.check([_item(spelled, True), _item(hidden, True)])
