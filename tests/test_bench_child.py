"""bench/child.py, the one child-process worker protocol: the child's own peak memory comes back with its result,
and a child that fails (raises, or is killed) is a clear error in the parent."""
from __future__ import annotations

import os

import pytest

from lowrank_lib.bench.child import ChildError, run_child

MB = 1 << 20
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="needs Linux /proc")


def test_the_childs_own_peak_rss_is_reported():
    """A copy of 2 x 256 MB in the child: its peak RSS (VmHWM) holds them; a child copying 2 x 1 MB peaks 500 MB
    lower, even while the parent holds 600 MB (the kernel's ru_maxrss of a child keeps what it inherited at fork:
    the figure must be the child's own, not the parent's)."""
    ballast = b"\x01" * (600 * MB)                  # written pages: the parent's RSS grows by 600 MB
    big = run_child("lowrank_lib.host:copy_bandwidth", device="cpu", nbytes=256 * MB, repeats=1)
    small = run_child("lowrank_lib.host:copy_bandwidth", device="cpu", nbytes=1 * MB, repeats=1)
    assert big["result"] > 0 and small["result"] > 0 and big["wall_s"] > 0
    assert big["peak_rss"] >= 512 * MB and big["peak_rss"] - small["peak_rss"] >= 480 * MB, (
        big["peak_rss"] / MB, small["peak_rss"] / MB)
    assert small["peak_rss"] < 400 * MB < len(ballast)
    assert small["peak_anon"] > 0 and small["peak_file"] > 0


def test_a_failing_child_is_a_clear_error():
    with pytest.raises(ChildError, match=r"(?s)timing:summary exited with code 1.*ValueError: summary of no samples"):
        run_child("lowrank_lib.timing:summary", seconds=[])
    with pytest.raises(ChildError, match="host:copy_bandwidth was killed by SIGKILL after the 1 s timeout"):
        run_child("lowrank_lib.host:copy_bandwidth", timeout=1, device="cpu", nbytes=64 * MB, repeats=10 ** 6)
    with pytest.raises(ValueError, match="lowrank_lib"):
        run_child("os:system", command="true")
