"""The GEMV backend registry: which kernel multiplies each decode projection, and why.

=====================  ===========================================================================
backend                what runs a decode GEMV (a few rows of x against one stored matrix)
=====================  ===========================================================================
``lrk_avx512``         our packed AVX-512 kernel (``lowrank_lrk::gemv``, ``lrk.cpp``): each 64-output
                       block one contiguous stream, fp32 FMA or bf16 ``vdpbf16ps``; one call per
                       packed stage-1 matrix and one segmented call for every stage-2 factor of a
                       group. Needs the kernel library, a CPU device, fp32 (AVX512F/BW/VL) or bf16
                       (+ AVX512_BF16). Rows beyond :data:`LRK_MAX_ROWS` (prefill) unpack the matrix
                       into a temporary and run aten (the weights are stored once, packed).
``lrk_avx2``           the same op, layout and accumulation order on a CPU with AVX2 + FMA but not
                       the AVX-512 subset of the dtype (AMD Zen 1-3, Intel client cores): 8-wide
                       FMAs, bf16 widened to fp32 by shifts (the two products of a pair in
                       ``vdpbf16ps``'s order), one row of x per pass over a block.
``inductor_reduce``    portable, inside a ``torch.compile``-d CPU step: a one-row GEMM over an
                       out_major operand traced as a fused multiply-reduce (``packing._mm``)
``aten``               portable: ``torch.mm`` / ``addmm`` on the stored operand (layout by
                       ``packing.pick_layout``), any device and dtype
=====================  ===========================================================================

Why our own kernel: the issue's routes were tried first (prototypes on the shared 2-core AVX512-BF16
machine, 1 thread, streaming from DRAM): aten's bf16 one-row GEMM ran far below copy bandwidth (compute
bound), oneDNN's prepacked linear (inductor freezing) and inductor's CPP GEMM templates under
max-autotune did not reach the kernel, and in fp32 MKL's GEMV and the fused reduction stayed below it.
The end-to-end evidence is the peer benchmark (``python -m lowrank_lib.bench peer``,
``benchmarks/results/peer_cpu_2.json``): the same engine beside llama.cpp, kernel and reason recorded
per row.

``EngineConfig(kernels=...)``: ``"auto"`` (the kernel where it can run, else the portable path, with
the reason), ``"portable"`` (never the kernel) or ``"lrk"`` (the kernel or an error saying why not).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

GEMV_BACKENDS = ("lrk_avx512", "lrk_avx2", "inductor_reduce", "aten")
#: the backends that store every matrix once in the packed layout and call ``lowrank_lrk::gemv``
PACKED_BACKENDS = ("lrk_avx512", "lrk_avx2")
KERNEL_MODES = ("auto", "portable", "lrk")
#: rows of x up to which a GEMM runs the packed kernel (each 4 rows re-stream the matrix); above:
#: unpack + aten (prefill)
LRK_MAX_ROWS = 8


@dataclass(frozen=True)
class GemvChoice:
    """The decode GEMV backend of an engine's projections, and why."""

    name: str
    reason: str

    @property
    def packed(self) -> bool:
        return self.name in PACKED_BACKENDS


#: the AVX-512 features the packed kernels need per dtype (else AVX2 + FMA)
AVX512_NEEDS = {torch.float32: ("avx512f", "avx512bw", "avx512vl"),
                torch.bfloat16: ("avx512f", "avx512bw", "avx512vl", "avx512_bf16")}


def lrk_isa(dtype) -> str | None:
    """Which code of the kernel library runs ``dtype`` on this CPU: ``"avx512"``, ``"avx2"`` or None (the
    library is not loaded, or the CPU has neither). Follows ``build.limit_isa`` / ``$LOWRANK_LIB_ISA``."""
    from .build import load

    lib = load()
    if not lib.available or dtype not in AVX512_NEEDS:
        return None
    if lib.has(*AVX512_NEEDS[dtype]):
        return "avx512"
    return "avx2" if lib.has("avx2", "fma") else None


def lrk_unavailable(device, dtype, avx512: bool = False) -> str | None:
    """Why the packed kernels cannot run here (None: they can). Loads (or builds) the library once.
    ``avx512``: the op has no AVX2 code (a backend declaring ``isa="avx512"``), so the AVX-512 subset is required."""
    if torch.device(device).type != "cpu":
        return f"device {torch.device(device).type}: the packed kernel is CPU-only"
    if dtype not in (torch.float32, torch.bfloat16):
        return f"dtype {dtype}: the packed kernel serves fp32 and bf16"
    from .build import load

    lib = load()
    if not lib.available:
        return lib.reason
    isa = lrk_isa(dtype)
    if isa == "avx512" or (isa == "avx2" and not avx512):
        return None
    missing = [f for f in AVX512_NEEDS[dtype] if not lib.isa.get(f)]
    if avx512:
        return f"this CPU lacks {', '.join(missing)}" + (" (the AVX2 kernels do not cover this op)" if isa else "")
    return f"this CPU lacks {', '.join(missing)} and AVX2 + FMA"


def select_gemv(mode: str, device, dtype, compiled: bool = False, fused_compile: bool = True) -> GemvChoice:
    """The backend for an engine's decode GEMVs. ``compiled``: the decode step is torch.compile-d on CPU."""
    if mode not in KERNEL_MODES:
        raise ValueError(f"kernels={mode!r}: use one of {KERNEL_MODES}")
    portable = "inductor_reduce" if compiled and fused_compile and torch.device(device).type == "cpu" else "aten"
    if mode == "portable":
        return GemvChoice(portable, "requested: kernels='portable'")
    why = lrk_unavailable(device, dtype)
    if why is None:
        if lrk_isa(dtype) == "avx512":
            name, isa = "lrk_avx512", "AVX512_BF16" if dtype == torch.bfloat16 else "AVX512F"
        else:
            name, isa = "lrk_avx2", "AVX2 + FMA (no AVX-512 for this dtype)"
        return GemvChoice(name, f"{'requested' if mode == 'lrk' else 'auto'}: kernel library loaded, "
                                f"{isa} present, {str(dtype).replace('torch.', '')} on CPU")
    if mode == "lrk":
        raise RuntimeError(f"kernels='lrk' cannot run: {why}")
    return GemvChoice(portable, f"auto: portable path ({why})")
