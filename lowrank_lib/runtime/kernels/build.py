"""The compiled kernels' library: found ahead-of-time built, else built just in time, else absent (with why).

ONE library from the sources beside this module (:data:`SOURCES`: ``lrk.cpp``, packed GEMV and dense decode
attention; ``tiers.cpp``, the fused attention over a tiered KV layer; ``qgemv.cpp``, the packed GEMV of int8 /
int4 quantized matrices (the math of ``lowrank_lib.quant``); ``pool.cpp``, the thread pool they use; the headers
of :data:`HEADERS`; all shipped as package data) and ONE set of flags (:data:`CFLAGS`), two routes:

- **ahead of time**: ``pip install`` (``setup.py``) compiles it when torch is importable in the build
  environment (``make`` installs torch first and the package with ``--no-build-isolation``), as the
  extension ``lowrank_lib.runtime.kernels._lrk_<tag>`` (``<tag>`` = hash of the sources, header and flags, so
  a stale build of an edited source or header is never loaded);
- **just in time**: otherwise, on first use, ``torch.utils.cpp_extension.load`` compiles it into
  :func:`jit_dir` (the model cache's ``kernels/`` when ``$LOWRANK_LIB_CACHE`` is set, else torch's
  extension folder; once per torch version and source; needs a C++ compiler and ninja);
- **absent**: no compiler or a failed build: :func:`load` returns a :class:`KernelLibrary` with
  ``available=False`` and the reason, and the engine runs the portable path. A loaded library on a CPU
  without AVX-512 runs its AVX2 + FMA kernels (GEMV, dense decode attention, certified head, fused tier
  attention); with neither, every kernel refuses and the portable path runs.

Threads: every kernel call splits its rows / heads / tier pieces over the library's own thread pool
(``pool.cpp``; as many threads as ``torch.get_num_threads()``, one below a size threshold); :func:`pool` changes its
settings (tests force splits of tiny shapes with it), :func:`pool_info` reports them and its counters.

Which features the kernels may use: all the CPU has, unless ``$LOWRANK_LIB_ISA=avx2`` (read by :func:`load`)
or :func:`limit_isa` lowers them, so the AVX2 kernels can be tested and measured on an AVX-512 CPU.

This module imports only the standard library at import time (``setup.py`` reads :func:`source_tag`
and :func:`extension_kwargs` from it before the package is installed).
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.machinery
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).parent
#: the translation units of the one library (ops of all in the lowrank_lrk namespace), the longest compile first:
#: both routes hand them to ninja in this order (setup.py undoes distutils' alphabetical sort), so on two cores the
#: 25 s tiers.cpp no longer starts last, after the others (measured alone, -O3: tiers 25.3 s, lrk 17.6, qgemv 15.5,
#: layer 11.9, pool 1.9, arena 0.4; ``setup.py build_ext`` from nothing on the idle 2-core VM: 57 s in name order, 45 s
#: in this one)
SOURCES = [HERE / "tiers.cpp", HERE / "lrk.cpp", HERE / "qgemv.cpp", HERE / "layer.cpp", HERE / "pool.cpp",
           HERE / "arena.cpp"]
#: included by the sources: part of the tag, so an edited header rebuilds (qgemv_512.h: the packed GEMV of quantized
#: matrices' AVX-512 code, included twice)
HEADERS = [HERE / "lrk_simd.h", HERE / "lrk_simd2.h", HERE / "lrk_pool.h", HERE / "tiers_item.h", HERE / "lrk_api.h",
           HERE / "qgemv_512.h", HERE / "lrk_arena.h", HERE / "lrk_arena_tensor.h"]
NAMESPACE = "lowrank_lrk"
#: the compile flags of BOTH routes (no -march: the AVX-512 code is selected by target pragmas and a
#: run-time CPUID check, so the library builds and loads on any x86-64). -g0 overrides the -g of Python's own
#: CFLAGS (setup.py's route): debug info for torch's headers doubled the compile (measured on the 2-core VM: lrk.cpp
#: 34 s with -g, 21.5 s without; the whole build 71 s -> about 40 s of every fresh ``make setup``)
CFLAGS = ["-O3", "-g0", "-std=c++17", "-fopenmp"]
LDFLAGS = ["-fopenmp"]
#: isa_flags() bits
ISA_BITS = {"avx512f": 1, "avx512bw": 2, "avx512vl": 4, "avx512_bf16": 8, "avx512_vnni": 16, "avx2": 32, "fma": 64}
#: the feature levels :func:`limit_isa` and ``$LOWRANK_LIB_ISA`` accept
#: (``"avx512_no_vnni"``: AVX-512 without VNNI, so ``qgemv``'s vpmaddwd code runs on a VNNI CPU)
ISA_LEVELS = {"all": -1, "avx512_no_vnni": -1 & ~ISA_BITS["avx512_vnni"],
              "avx2": ISA_BITS["avx2"] | ISA_BITS["fma"], "none": 0}


def source_tag() -> str:
    """12 hex digits of sha256(sources + headers + flags): names the AOT module and the JIT build folder."""
    h = hashlib.sha256()
    for p in SOURCES + HEADERS:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    h.update(" ".join(CFLAGS + LDFLAGS).encode())
    return h.hexdigest()[:12]


def module_name() -> str:
    return f"_lrk_{source_tag()}"


def define_flags() -> list[str]:
    return [f"-DLRK_SOURCE_TAG={source_tag()}"]


def extension_kwargs() -> dict:
    """What ``setup.py`` passes to ``torch.utils.cpp_extension.CppExtension``."""
    return {"name": f"lowrank_lib.runtime.kernels.{module_name()}", "sources": [str(p) for p in SOURCES],
            "extra_compile_args": CFLAGS + define_flags(), "extra_link_args": LDFLAGS}


@dataclass
class KernelLibrary:
    """What :func:`load` found: whether the ops are callable, which route built them, and why not."""

    available: bool
    reason: str
    route: str | None = None          # "aot" (built by pip install) | "jit" (built on first use) | None
    path: str | None = None           # the shared library loaded
    tag: str = ""
    build_s: float = 0.0              # seconds spent compiling in THIS process (JIT), 0 if none
    isa: dict = field(default_factory=dict)

    def has(self, *features: str) -> bool:
        return self.available and all(self.isa.get(f, False) for f in features)

    def to_dict(self) -> dict:
        return asdict(self)


_LIB: KernelLibrary | None = None


def aot_library() -> Path | None:
    """The ahead-of-time built library of THIS source, if ``pip install`` built it."""
    d = HERE
    for suf in importlib.machinery.EXTENSION_SUFFIXES:
        hits = glob.glob(str(d / f"{module_name()}{suf}"))
        if hits:
            return Path(hits[0])
    return None


def jit_dir() -> Path:
    """Where the JIT build goes: ``$LOWRANK_LIB_CACHE/kernels/<torch version>-<tag>/`` when the model cache
    is set by the environment, else torch's own extension folder (``$TORCH_EXTENSIONS_DIR`` or
    ``~/.cache/torch_extensions/<py/cuda tag>/``), sub-folder ``lowrank_lrk-<torch version>-<tag>``.
    (``runtime/`` may not import ``models``, which resolves the checkout's default cache.)"""
    import torch

    env = os.environ.get("LOWRANK_LIB_CACHE")
    if env:
        return Path(env) / "kernels" / f"{torch.__version__}-{source_tag()}"
    import torch.utils.cpp_extension as ce

    return Path(ce.get_default_build_root()) / f"lowrank_lrk-{torch.__version__}-{source_tag()}"


def _jit_build(log) -> str:
    """Compile with ``torch.utils.cpp_extension.load`` into :func:`jit_dir`; returns the library path."""
    import torch.utils.cpp_extension as ce

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler ({cxx!r} not on PATH)")
    if not ce.is_ninja_available():
        raise RuntimeError("ninja is not installed (torch's JIT build needs it: pip install ninja)")
    d = jit_dir()
    d.mkdir(parents=True, exist_ok=True)
    name = f"lowrank_lrk_{source_tag()}"
    lib = d / f"{name}.so"
    if not lib.exists():
        log(f"[lowrank_lib.kernels] compiling {', '.join(p.name for p in SOURCES)} into {d} (once per torch version "
            "and source; ~1 min)")
    ce.load(name=name, sources=[str(p) for p in SOURCES], extra_cflags=CFLAGS + define_flags(), extra_ldflags=LDFLAGS,
            build_directory=str(d), is_python_module=False, verbose=False)
    return str(lib)


def _register_fakes() -> None:
    """Shape functions for torch.compile's tracing (the ops are pure: new outputs, no aliasing)."""
    import torch

    @torch.library.register_fake(f"{NAMESPACE}::pack")
    def _(W):
        raise RuntimeError("lowrank_lrk::pack runs eagerly (weights are packed when the engine is built)")

    @torch.library.register_fake(f"{NAMESPACE}::unpack")
    def _(P, out, inp):
        return P.new_empty(out, inp)

    @torch.library.register_fake(f"{NAMESPACE}::gemv")
    def _(x, Ps, outs, ins, xoffs):
        return x.new_empty(x.shape[0], sum(outs))

    @torch.library.register_fake(f"{NAMESPACE}::attend")
    def _(q, K, V, length, pad, scale):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2] * q.shape[3])

    @torch.library.register_fake(f"{NAMESPACE}::tier_attend")
    def _(q, k_exact, v_exact, e_off, runs, r_off, a_k, a_v, b_k, b_v, k_scale, v_scale, k_new, v_new, n_new, scale):
        return q.new_empty(q.shape[0], q.shape[1] * q.shape[2] * q.shape[3])

    @torch.library.register_fake(f"{NAMESPACE}::decode_layer")
    def _(x, plan, rope, kv, layer, length, pad):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{NAMESPACE}::decode_stack")
    def _(x, plans, rope, kv, length, pad):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{NAMESPACE}::decode_layer_tiers")
    def _(x, plan, rope, k_new, v_new, k_exact, v_exact, e_off, runs, r_off, a_k, a_v, b_k, b_v, k_scale, v_scale, t0,
          length, pad):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{NAMESPACE}::decode_stack_tiers")
    def _(x, plans, rope, layout, t0, length, pad):
        return torch.empty_like(x)

    @torch.library.register_fake(f"{NAMESPACE}::qpack")
    def _(data, scale, bits, group, out, inp):
        raise RuntimeError("lowrank_lrk::qpack runs eagerly (weights are packed when the engine is built)")

    @torch.library.register_fake(f"{NAMESPACE}::qunpack")
    def _(P, bits, group, out, inp):
        p = -(-inp // group) * group
        return (P.new_empty(out, p if bits == 8 else p // 2, dtype=torch.int8 if bits == 8 else torch.uint8),
                P.new_empty(out, p // group, dtype=torch.float16))

    @torch.library.register_fake(f"{NAMESPACE}::qgemv")
    def _(x, Ps, outs, ins, xoffs, bits, group):
        return x.new_empty(x.shape[0], sum(outs))

    @torch.library.register_fake(f"{NAMESPACE}::certified_head")
    def _(x, Q, meta, P, V, max_fraction, stats):
        return x.new_empty(x.shape[0], V)


def load(jit: bool = True, log=None) -> KernelLibrary:
    """The kernel library of this process (loaded once; a failed attempt is remembered too)."""
    global _LIB
    if _LIB is not None:
        return _LIB
    log = log or (lambda m: print(m, file=sys.stderr, flush=True))
    import torch

    tag = source_tag()
    route, path, t0 = None, None, time.perf_counter()
    try:
        aot = aot_library()
        if aot is not None:
            torch.ops.load_library(str(aot))
            route, path = "aot", str(aot)
        elif jit:
            path = _jit_build(log)
            route = "jit"
        else:
            raise RuntimeError("not built ahead of time and just-in-time building is off")
    except Exception as e:  # noqa: BLE001  (any build/load failure means: portable path, say why)
        _LIB = KernelLibrary(False, f"kernel library unavailable: {type(e).__name__}: {str(e).strip()[:300]}",
                             tag=tag)
        return _LIB
    build_s = time.perf_counter() - t0 if route == "jit" else 0.0
    _register_fakes()
    _LIB = KernelLibrary(True, f"loaded ({route})", route, path, tag, build_s, {})
    level = os.environ.get("LOWRANK_LIB_ISA", "all")
    if level not in ISA_LEVELS:
        raise ValueError(f"LOWRANK_LIB_ISA={level!r}: use one of {sorted(ISA_LEVELS)}")
    _set_level(level)
    mode = os.environ.get("LOWRANK_LIB_POOL") or default_pool_mode()
    if mode not in POOL_MODES:
        raise ValueError(f"LOWRANK_LIB_POOL={mode!r}: use one of {sorted(POOL_MODES)}")
    getattr(torch.ops, NAMESPACE).set_pool(-1, -1, -1, POOL_MODES[mode])
    return _LIB


def _set_level(level: str) -> str:
    """Apply a feature level to the loaded library and refresh ``_LIB.isa``; returns the previous level."""
    import torch

    ops = getattr(torch.ops, NAMESPACE)
    prev = int(ops.set_isa_mask(ISA_LEVELS[level]))
    _LIB.isa = {k: bool(int(ops.isa_flags()) & b) for k, b in ISA_BITS.items()}
    return next((k for k, v in ISA_LEVELS.items() if v == prev), "all")


@contextlib.contextmanager
def limit_isa(level: str):
    """``with limit_isa("avx2"):`` the kernels (and the backend choice of engines built inside) use only AVX2 + FMA,
    as on a CPU without AVX-512; ``"avx512_no_vnni"``: AVX-512 without VNNI (``qgemv``'s vpmaddwd code);
    ``"none"``: no kernel runs. Restores the previous level on exit."""
    if level not in ISA_LEVELS:
        raise ValueError(f"limit_isa({level!r}): use one of {sorted(ISA_LEVELS)}")
    lib = load()
    if not lib.available:
        raise RuntimeError(f"limit_isa: {lib.reason}")
    prev = _set_level(level)
    try:
        yield lib
    finally:
        _set_level(prev)


#: the kernel pool's modes (``set_pool``'s ``mode``; ``$LOWRANK_LIB_POOL`` at load, else :func:`default_pool_mode`)
POOL_MODES = {"own": 0, "omp": 1}


def default_pool_mode() -> str:
    """The pool mode a process starts in: ``"omp"`` where torch's intra-op threads are OpenMP's (its CPU wheels), so
    our kernels' chunks run on the SAME threads as ATen's and inductor's parallel loops; else ``"own"``.

    Why: libgomp's idle threads spin after every parallel region, and ATen / inductor open regions inside a decode step
    (the LM head's norm, ``argmax`` over the vocabulary). Beside them, our own workers were a second set of spinning
    threads on the same cores, and each kernel call waited for a worker the scheduler had parked behind an OpenMP
    spinner. Measured on the 2-core AMD EPYC VM (Llama-3.2-1B geometry, int4 keep-0.5 factors, q8 head, compiled step,
    2 threads, modes alternated in one process, 3 rounds): 25.7 / 20.9 / 22.1 ms per token with our workers, 14.8 /
    15.0 / 15.2 in OpenMP's; 1 thread and SmolLM2 (whose regions are too small for OpenMP to split) unchanged
    (7.52 vs 7.63 ms, within noise). ``OMP_WAIT_POLICY=PASSIVE`` cures it too (20-21 ms), but only when set before
    torch starts."""
    import torch

    return "omp" if "parallel backend: OpenMP" in torch.__config__.parallel_info() else "own"


def _pool_settings() -> dict:
    import torch

    threads, min_bytes, spin_us, mode = getattr(torch.ops, NAMESPACE).set_pool(-1, -1, -1, -1)
    return {"threads": int(threads) or "torch", "min_bytes": int(min_bytes), "spin_us": int(spin_us),
            "mode": next(k for k, v in POOL_MODES.items() if v == mode)}


@contextlib.contextmanager
def pool(threads: int | None = None, min_bytes: int | None = None, spin_us: int | None = None,
         mode: str | None = None):
    """``with pool(min_bytes=1):`` the kernels' thread pool (``pool.cpp``) with other settings, restored on exit.
    threads: the threads a call may use (0: ``torch.get_num_threads()``, the default); min_bytes: streamed bytes per
    thread below which a call runs on one thread (128 KB; 1: split whatever can be split); spin_us: how long an idle
    worker spins before sleeping (50; ``$LOWRANK_LIB_SPIN_US``); mode: ``"own"`` (the library's workers) or ``"omp"``
    (the same chunks in an OpenMP region: torch's intra-op threads; ``$LOWRANK_LIB_POOL``; the default is
    :func:`default_pool_mode`'s)."""
    import torch

    lib = load()
    if not lib.available:
        raise RuntimeError(f"pool: {lib.reason}")
    if mode is not None and mode not in POOL_MODES:
        raise ValueError(f"pool(mode={mode!r}): use one of {sorted(POOL_MODES)}")
    ops = getattr(torch.ops, NAMESPACE)
    new = [-1 if v is None else int(v) for v in (threads, min_bytes, spin_us)] + [POOL_MODES.get(mode, -1)]
    prev = ops.set_pool(*new)
    try:
        yield lib
    finally:
        ops.set_pool(*prev)


def pool_info() -> dict:
    """The pool's settings and counters: threads a call may use now, workers started, parallel calls, chunks run by a
    thread other than the caller, calls run on the caller alone (below the threshold or the workers busy)."""
    import torch

    load()
    now, workers, par, off, alone = getattr(torch.ops, NAMESPACE).pool_info()
    return {**_pool_settings(), "threads_now": now, "workers": workers, "parallel_calls": par,
            "chunks_off_caller": off, "calls_alone": alone}


@contextlib.contextmanager
def arena(on: bool):
    """``with arena(False):`` matrices packed inside (``ops.pack`` / ``ops.qpack``) go to torch's allocator instead of
    the weight arena (``arena.cpp``: mappings advised as 2 MB transparent huge pages; ``$LOWRANK_LIB_HUGEPAGES=0``
    turns it off for a process); restored on exit. Tests compare both; benchmarks measure what huge pages give."""
    import torch

    lib = load()
    if not lib.available:
        raise RuntimeError(f"arena: {lib.reason}")
    prev = getattr(torch.ops, NAMESPACE).set_arena(int(bool(on)))
    try:
        yield lib
    finally:
        getattr(torch.ops, NAMESPACE).set_arena(prev)


def arena_info() -> dict:
    """The weight arena now: on, live allocations, live mappings, bytes mapped and handed out, whether the kernel took
    the huge-page advice (None: nothing mapped yet), and the process's anonymous huge-page bytes
    (``AnonHugePages`` of ``/proc/self/smaps_rollup``, Linux; None elsewhere): what the arena really got."""
    import torch

    load()
    on, live, maps, mapped, handed, advised = getattr(torch.ops, NAMESPACE).arena_info()
    huge = None
    with contextlib.suppress(OSError, ValueError, IndexError):
        text = Path("/proc/self/smaps_rollup").read_text()
        huge = int(text.split("AnonHugePages:")[1].split()[0]) * 1024
    return {"on": bool(on), "live": live, "mappings": maps, "bytes_mapped": mapped, "bytes_live": handed,
            "huge_advice_taken": None if advised < 0 else bool(advised), "anon_huge_bytes": huge}


def status() -> dict:
    """The library as :meth:`Engine.report` shows it (without loading it), with the pool's settings and the weight
    arena's state (:func:`arena_info`: how many bytes of packed weights the kernel backs with huge pages)."""
    if _LIB is None:
        return {"available": None, "reason": "not loaded yet"}
    return {**_LIB.to_dict(), **({"pool": _pool_settings(), "arena": arena_info()} if _LIB.available else {})}
