"""Our compiled CPU kernels for the decode step (``lrk.cpp``: packed GEMV, decode attention) and the
GEMV backend registry that says which kernel multiplies each projection and why.

``build.load()`` finds the library built by ``pip install`` or builds it on first use (see
:mod:`.build`); :func:`select_gemv` picks the decode GEMV backend of an engine
(``EngineConfig.kernels``); the attention registries offer ``lrk_attend`` (``runtime.attention``) and
``lrk_tiers`` (``kv.tiers``) the same way. Everything falls back to the portable path with the reason reported.
"""
from .build import KernelLibrary, load, status
from .gemv import GEMV_BACKENDS, KERNEL_MODES, LRK_MAX_ROWS, GemvChoice, lrk_unavailable, select_gemv

__all__ = ["KernelLibrary", "load", "status", "GEMV_BACKENDS", "KERNEL_MODES", "LRK_MAX_ROWS", "GemvChoice",
           "lrk_unavailable", "select_gemv"]
