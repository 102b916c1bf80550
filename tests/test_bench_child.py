"""bench/child.py, the one child-process worker protocol: the child's own peak memory comes back with its result,
and a child that fails (raises, or is killed) is a clear error in the parent."""
from __future__ import annotations

import os

import pytest

from lowrank_lib.bench.child import ChildError, run_child

MB = 1 << 20
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")


def test_the_childs_own_peak_rss_is_reported():
    """A copy of 2 x 256 MB in the child: its peak RSS (VmHWM and the kernel's ru_maxrss of that child) holds
    them; a child copying 2 x 1 MB peaks 500 MB lower, so the figure is the child's, not the parent's."""
    big = run_child("lowrank_lib.bench.host:copy_bandwidth", device="cpu", nbytes=256 * MB, repeats=1)
    small = run_child("lowrank_lib.bench.host:copy_bandwidth", device="cpu", nbytes=1 * MB, repeats=1)
    assert big["result"] > 0 and small["result"] > 0 and big["wall_s"] > 0
    for key in ("peak_rss", "child_maxrss"):
        assert big[key] >= 512 * MB and big[key] - small[key] >= 480 * MB, (key, big[key] / MB, small[key] / MB)
    assert small["peak_anon"] > 0 and small["peak_file"] > 0


def test_a_failing_child_is_a_clear_error():
    with pytest.raises(ChildError, match=r"(?s)timing:summary exited with code 1.*ValueError: summary of no samples"):
        run_child("lowrank_lib.bench.timing:summary", seconds=[])
    with pytest.raises(ChildError, match="host:copy_bandwidth was killed by SIGKILL after the 1 s timeout"):
        run_child("lowrank_lib.bench.host:copy_bandwidth", timeout=1, device="cpu", nbytes=64 * MB, repeats=10 ** 6)
    with pytest.raises(ValueError, match="lowrank_lib"):
        run_child("os:system", command="true")
