"""The ISA levels of our compiled kernels a test runs under, and the GEMV backend each level reports.

A kernel test decorated with :func:`needs_lrk` runs once per level this CPU has: ``"all"`` (its AVX-512 kernels,
where the CPU has AVX512F/BW/VL) and ``"avx2"`` (the AVX2 + FMA kernels, forced with ``build.limit_isa`` on an
AVX-512 CPU), so both code paths are checked wherever AVX-512 exists, and the AVX2 one on every AVX2 CPU. The
fused tier attention has both too. :data:`THREADS` / :func:`num_threads`: the thread counts the pool is checked at.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from lowrank_lib.runtime.kernels import build
from lowrank_lib.runtime.kernels.gemv import lrk_isa

LIB = build.load()
AVX512 = ("avx512f", "avx512bw", "avx512vl")
LEVELS = [lvl for lvl, ok in (("all", LIB.has(*AVX512)), ("avx2", LIB.has("avx2", "fma"))) if ok]
#: a mark for a parameter: the kernels run here at the CPU's own level
lrk_runs = pytest.mark.skipif(not LEVELS, reason=f"the kernel library cannot run here: {LIB.reason}, isa={LIB.isa}")
#: the thread counts the kernels' split is checked at (3 > this machine's cores: uneven splits, late workers)
THREADS = (1, 2, 3)


@contextlib.contextmanager
def num_threads(n: int):
    """``torch.set_num_threads(n)`` inside (the kernels' pool follows it), the previous count restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.fixture(params=LEVELS or ["none"])
def kernel_isa(request):
    """Every kernel call of the test under one ISA level (``"all"``: whatever the CPU has)."""
    if request.param == "none":
        pytest.skip(f"the kernel library cannot run here: {LIB.reason}, isa={LIB.isa}")
    with build.limit_isa(request.param):
        yield request.param


def needs_lrk(f):
    """Skip without any kernel ISA; otherwise run the test under each level of :data:`LEVELS` (the ops' tests)."""
    f = pytest.mark.usefixtures("kernel_isa")(f)
    return pytest.mark.skipif(not LEVELS, reason=f"the kernel library cannot run here: {LIB.reason}, isa={LIB.isa}")(f)


def needs_lrk_native(f):
    """Skip without any kernel ISA; otherwise run the test once, at the CPU's own level (whole engines: the code that
    differs between levels is the ops', which :func:`needs_lrk` tests at every level)."""
    return pytest.mark.skipif(not LEVELS, reason=f"the kernel library cannot run here: {LIB.reason}, isa={LIB.isa}")(f)


def gemv_backend(dtype: torch.dtype) -> str:
    """The packed GEMV backend an engine built now reports for ``dtype``."""
    return {"avx512": "lrk_avx512", "avx2": "lrk_avx2"}[lrk_isa(dtype)]
