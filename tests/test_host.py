"""Host facts the notebooks and benchmarks rely on: who keeps the machine busy, and freeing memory."""
import subprocess
import sys
import time

import pytest

from lowrank_lib.host import cache_flusher, last_level_cache_bytes, others_busy_cores, release_memory, status_bytes


def test_others_busy_cores_subtracts_this_process_and_idle_time(tmp_path, monkeypatch):
    """The arithmetic on a fake /proc: over a 2 s window the machine's busy jiffies grow by 300 (idle and iowait
    grow too and do not count), this process's own utime + stime by 120: other processes kept (300 - 120) / 100 /
    2 = 0.9 cores busy."""
    import os

    from lowrank_lib import host

    (tmp_path / "self").mkdir()

    def write(user, system, idle, iowait, utime, stime):
        (tmp_path / "stat").write_text(f"cpu  {user} 0 {system} {idle} {iowait} 0 0 0 0 0\ncpu0 1 2 3 4\n")
        own = ["S"] + ["0"] * 10 + [str(utime), str(stime)] + ["0"] * 30
        (tmp_path / "self" / "stat").write_text("4242 (python (kernel)) " + " ".join(own))

    write(1000, 500, 9000, 100, 40, 10)
    clock = iter([10.0, 12.0])
    monkeypatch.setattr(host.time, "perf_counter", lambda: next(clock))
    monkeypatch.setattr(host.time, "sleep", lambda s: write(1200, 600, 9500, 400, 140, 30))
    monkeypatch.setattr(os, "sysconf", lambda name: 100)
    assert host.others_busy_cores(2.0, proc=tmp_path) == pytest.approx(0.9)
    assert host.others_busy_cores(2.0, proc=tmp_path / "missing") is None


def test_a_busy_child_process_counts():
    """On the real /proc: a child spinning for the whole window keeps at least about half a core busy (more with
    other work on the machine: the test only asks for a lower bound, which holds under parallel test workers)."""
    stop = time.time() + 2.5
    child = subprocess.Popen([sys.executable, "-c", f"import time\nwhile time.time() < {stop}: pass"])
    try:
        time.sleep(0.3)
        assert others_busy_cores(1.0) > 0.4
    finally:
        child.kill()
        child.wait()


def test_release_memory_hands_freed_pages_back():
    """Heap blocks freed around survivors (a fragmented heap, as runners built and dropped in turn leave it) stay
    resident after a garbage collection; release_memory gives them back."""
    import ctypes
    import gc

    release_memory()              # a clean start: free heap an earlier test of this worker left resident would be reused
    before = status_bytes("VmRSS")
    blocks = [ctypes.create_string_buffer(64 * 1024) for _ in range(8000)]       # ~0.5 GB of small heap blocks
    grown = status_bytes("VmRSS") - before
    assert grown > 300e6
    survivors = blocks[::8]                                                      # 1 in 8 stays: holes everywhere
    del blocks
    gc.collect()
    assert status_bytes("VmRSS") - before > 0.8 * grown                         # freed, still resident
    release_memory()
    assert status_bytes("VmRSS") - before < 0.3 * grown
    del survivors


def _cache_dir(root, caches):
    for i, (level, size) in enumerate(caches):
        d = root / f"index{i}"
        d.mkdir(parents=True)
        (d / "level").write_text(f"{level}\n")
        (d / "size").write_text(f"{size}\n")
    return root


def test_last_level_cache_is_the_highest_level_reported(tmp_path):
    root = _cache_dir(tmp_path / "a", [(1, "32K"), (1, "32K"), (2, "1024K"), (3, "32768K")])
    assert last_level_cache_bytes(root) == 32 << 20
    assert last_level_cache_bytes(_cache_dir(tmp_path / "b", [(2, "2M"), (1, "48K")])) == 2 << 20
    assert last_level_cache_bytes(tmp_path / "none") is None
    bad = _cache_dir(tmp_path / "c", [(1, "32K"), (3, "lots")])          # an unreadable size is skipped
    assert last_level_cache_bytes(bad) == 32 << 10


def test_cache_flusher_writes_four_last_level_caches_at_least_64_mib(tmp_path):
    big = cache_flusher(sys_cpu=_cache_dir(tmp_path / "big", [(3, "48M")]))
    assert big.nbytes == 4 * (48 << 20)
    assert cache_flusher(sys_cpu=tmp_path / "none").nbytes == 64 << 20     # nothing reported: the floor
    small = cache_flusher(1 << 20)
    assert small.nbytes == 1 << 20
    small()
    small()
    assert int(small.buffer.min()) == int(small.buffer.max()) == 2        # every byte written, each call


def test_cpu_flags_read_the_flags_line(tmp_path):
    from lowrank_lib.host import cpu_flags

    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n\n"
                    "processor\t: 1\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n")
    assert cpu_flags(info) == {"fpu", "sse2", "avx2", "avx512f", "avx512_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()
