"""Compressors: each method's math, producing ``LowRankLinear`` factors (never touches files).

Which compressor belongs to which family, and how its native knob maps to the canonical keep, is
in the one registry :mod:`lowrank_lib.families`; :data:`COMPRESSORS` is a view of it.
"""
from .. import families as _families
from .asvd import compress_asvd
from .basis_sharing import compress_basis_sharing
from .calib import CalibStats, cholesky_lower, collect_stats
from .dobi import compress_dobi, compress_dobi_remap
from .palu import compress_palu
from .svd import FactorSpectra, SVDSpectra, compress_svd
from .svdllm import compress_svdllm, compress_svdllm_v2

#: family name -> compressor(model, stats, keep, **kw), for every family that calibrates ("svd" does not:
#: use ``lowrank_lib.families.get("svd").compress(model, None, keep)`` or :func:`compress_svd`).
COMPRESSORS = {f.name: f.compressor_fn for f in _families.methods() if f.needs_stats}

__all__ = ["COMPRESSORS", "CalibStats", "FactorSpectra", "SVDSpectra", "cholesky_lower", "collect_stats",
           "compress_asvd",
           "compress_basis_sharing", "compress_dobi", "compress_dobi_remap", "compress_palu", "compress_svd",
           "compress_svdllm", "compress_svdllm_v2"]
