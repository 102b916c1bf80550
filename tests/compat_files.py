"""`make test-oldest` collects only the files that spell the compat marker (the Makefile's ``COMPAT_FILES``, a grep);
``check`` (called by ``tests/conftest.py`` at collection) stops a run whose compat tests lie elsewhere."""
from __future__ import annotations

import pytest

#: the text the Makefile's grep looks for
MARK = "pytest.mark.compat"


def check(items) -> None:
    """A ``compat`` test in a file that does not spell :data:`MARK` (a marker applied some other way) would never
    run on the oldest transformers: collection stops and names the file."""
    paths = {it.path for it in items if it.get_closest_marker("compat")}       # each file read once
    strays = sorted(str(p) for p in paths if MARK not in p.read_text())
    if strays:
        raise pytest.UsageError(f"compat tests in {strays}, whose text lacks {MARK!r}: `make test-oldest` collects "
                                "only the files containing it (COMPAT_FILES in the Makefile)")
