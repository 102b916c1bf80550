"""THE host facts every measurement records beside its timings: CPU name, core count, copy and read bandwidth, the
load average, the process's resident memory, and :class:`CpuClocked` (the calling thread's CPU time of every decode
step).

A leaf: it imports nothing of lowrank_lib but the timing helper (:mod:`lowrank_lib.timing`, itself a leaf),
so the library's measurements, every benchmark, the child-process worker and the notebooks can use it.
"""
from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import torch

from .timing import summary, timed

__all__ = ["CpuClocked", "available_memory", "cache_flusher", "copy_bandwidth", "cores", "cpu_flags", "cpu_name",
           "last_level_cache_bytes", "load_average", "machine", "others_busy_cores", "physical_memory", "read_bandwidth",
           "release_memory", "status_bytes"]


def _cpuinfo(key: str, path: str | Path = "/proc/cpuinfo") -> str | None:
    """The value of the first ``key`` line of ``/proc/cpuinfo`` (``model name``, ``flags``), or None where there is
    no such file or line."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    return _cpuinfo("model name") or platform.processor() or platform.machine()


def cpu_flags(cpuinfo: str | Path = "/proc/cpuinfo") -> set[str]:
    """The CPU's feature flags as Linux names them (``avx2``, ``avx512f``, ``avx512_bf16``, ...: the ``flags`` line
    of ``/proc/cpuinfo``); empty where there is no such file."""
    return set((_cpuinfo("flags", cpuinfo) or "").split())


def cores() -> int:
    return os.cpu_count() or 0


def machine(**extra) -> dict:
    """The machine of a result: CPU, cores, torch and Python versions (and ``extra``, e.g. a peer's version)."""
    return {"cpu": cpu_name(), "cores": cores(), "torch": torch.__version__, "python": platform.python_version(),
            **extra}


def _bandwidth(device, nbytes: int, repeats: int, copy: bool) -> float:
    device = torch.device(device)
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src) if copy else None
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    ts = timed((lambda: dst.copy_(src)) if copy else src.sum, repeats + 1, sync)[1:]
    return (2 if copy else 1) * src.numel() * 4 / (summary(ts)["median_ms"] / 1e3) / 1e9


def copy_bandwidth(device, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Copy bandwidth in GB/s: 2 * nbytes (read + write) / median time of ``dst.copy_(src)`` (one warm-up copy
    first; on CUDA every copy is bracketed by a device sync). ``device``: a ``torch.device`` or its name."""
    return _bandwidth(device, nbytes, repeats, copy=True)


def read_bandwidth(device, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Read-only stream bandwidth in GB/s: nbytes / median time of ``src.sum()`` over fp32 (one warm-up first): what a
    decode GEMV, which only reads its weights, can reach. On some hosts it sits well below :func:`copy_bandwidth`
    (one AMD EPYC VM: 9.5 vs 12 GB/s), so a copy roofline of 1.0 is out of reach there."""
    return _bandwidth(device, nbytes, repeats, copy=False)


def last_level_cache_bytes(sys_cpu: str | Path = "/sys/devices/system/cpu/cpu0/cache") -> int | None:
    """The size of the CPU's last-level cache in bytes (the highest ``level`` under ``sys_cpu``'s ``index*/``, as
    Linux reports it: ``32768K``), or None where it is not reported."""
    best = None
    for d in sorted(Path(sys_cpu).glob("index*")):
        try:
            level, size = int((d / "level").read_text()), (d / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(size[-1:].upper(), 1)
        digits = size[:-1] if size[-1:].upper() in "KMG" else size
        if digits.isdigit() and (best is None or level > best[0]):
            best = (level, int(digits) * mult)
    return None if best is None else best[1]


def cache_flusher(nbytes: int | None = None, sys_cpu: str | Path = "/sys/devices/system/cpu/cpu0/cache"):
    """A function that pushes the CPU caches' contents out to memory: it writes a buffer of ``nbytes`` (default 4x
    the last-level cache, at least 64 MiB), so what a timed call reads next comes from memory, as it does inside a
    decode step whose weights stream through the caches between two attentions. Timing a function back to back
    instead (its data still cached from the call before) flatters whatever fits in the cache: measured on the AMD EPYC
    VM (32 MiB L3), SmolLM2's composed cache at budget 0.125 of an 8k context (23 MB over 30 layers) attended in 2.08
    ms back to back and 3.18 after a flush at 2 threads, the dense cache's 184 MB in 8.62 and 8.96. Pass it as
    ``before`` of :func:`lowrank_lib.timing.timed` / ``interleaved`` (untimed). The function's ``nbytes`` says what
    it writes."""
    n = nbytes if nbytes is not None else max(64 << 20, 4 * (last_level_cache_bytes(sys_cpu) or 0))
    buf = torch.zeros(n // 4, dtype=torch.int32)

    def flush() -> None:
        buf.add_(1)
    flush.nbytes = buf.numel() * 4
    flush.buffer = buf
    return flush


def load_average() -> list[float] | None:
    """The machine's 1/5/15-minute load averages (rounded), recorded beside timings: what else was running
    shows there. ``None`` where the platform has none."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def status_bytes(key: str) -> int | None:
    """A field of this process's ``/proc/self/status`` in bytes (``VmRSS``, ``VmHWM`` = peak RSS, ``RssAnon``,
    ``RssFile``); ``None`` where there is no such file."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def others_busy_cores(window_s: float = 2.0, proc: str | Path = "/proc") -> float | None:
    """Cores kept busy by OTHER processes over the next ``window_s`` seconds: the machine's busy CPU time
    (``/proc/stat``) minus this process's own (``/proc/self/stat``), per second of wall time. Unlike the load
    average it does not count what this process itself just did (a notebook that loaded a 4 GB model is not a
    busy machine). None where /proc is missing."""
    proc = Path(proc)

    def machine_busy() -> int:
        f = [int(x) for x in (proc / "stat").read_text().split("\n", 1)[0].split()[1:]]
        return sum(f) - f[3] - (f[4] if len(f) > 4 else 0)            # all but idle and iowait

    def own() -> int:
        f = (proc / "self" / "stat").read_text().rsplit(")", 1)[1].split()
        return int(f[11]) + int(f[12])                                  # utime + stime (this process's threads)

    try:
        hz = os.sysconf("SC_CLK_TCK")
        m0, o0, t0 = machine_busy(), own(), time.perf_counter()
        time.sleep(window_s)
        m1, o1, t1 = machine_busy(), own(), time.perf_counter()
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, ((m1 - m0) - (o1 - o0)) / hz / (t1 - t0))


def physical_memory() -> int:
    """This machine's physical memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def available_memory() -> int:
    """The memory available to a new allocation now (``MemAvailable`` of /proc/meminfo: free memory plus the page
    cache the kernel can drop), in bytes; the physical memory where there is no such file."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return physical_memory()


def release_memory() -> None:
    """Collect garbage, then hand freed heap pages back to the OS (glibc's ``malloc_trim(0)``; nothing elsewhere):
    between runners of a multi-GB model, what one freed would otherwise stay resident under the next (measured on a
    Llama-3.2-1B-shape checkpoint: five engines built and timed in turn peaked at 15 GB RSS without it)."""
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).malloc_trim(0)
        except (OSError, AttributeError):       # not glibc
            pass


class CpuClocked:
    """A runner (:class:`lowrank_lib.runtime.Runner`) that also records the calling thread's CPU seconds of every
    ``step`` (``cpu_s``); every other member is the wrapped runner's (``runner``).

    At 1 thread every runner computes on the calling thread, so this is the wall time an idle core would give:
    robust to other processes taking turns on a shared machine (not to their memory traffic)."""

    def __init__(self, runner):
        self.runner, self.cpu_s = runner, []
        self.device, self.lm_head_mode = runner.device, runner.lm_head_mode

    @property
    def capture_s(self) -> float:
        return self.runner.capture_s

    @property
    def compiled(self) -> bool:
        return self.runner.compiled

    def prefill(self, input_ids, attention_mask=None):
        return self.runner.prefill(input_ids, attention_mask)

    def step(self, tokens):
        c0 = time.thread_time()
        y = self.runner.step(tokens)
        self.cpu_s.append(time.thread_time() - c0)
        return y

    def prepare(self, B: int) -> float:
        return self.runner.prepare(B)

    def invalidate(self) -> None:
        self.runner.invalidate()

    def counters(self) -> dict:
        return self.runner.counters()

    def layer_sections(self, mark):
        return self.runner.layer_sections(mark)

    def reset_counters(self) -> None:
        """Zero the runner's counters and this wrapper's CPU times (count the timed generations only)."""
        self.runner.reset_counters()
        self.cpu_s.clear()
