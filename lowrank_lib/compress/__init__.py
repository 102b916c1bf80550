"""Compressors: each method's math, producing ``LowRankLinear`` factors (never touches files)."""
from .asvd import compress_asvd
from .basis_sharing import compress_basis_sharing
from .calib import CalibStats, cholesky_lower, collect_stats
from .dobi import compress_dobi
from .palu import compress_palu
from .svd import SVDSpectra, compress_svd
from .svdllm import compress_svdllm, compress_svdllm_v2

#: family name -> compressor(model, stats, keep, **kw). "svd" ignores stats.
COMPRESSORS = {
    "asvd": compress_asvd,
    "svdllm": compress_svdllm,
    "svdllm_v2": compress_svdllm_v2,
    "basis_sharing": compress_basis_sharing,
    "dobi": compress_dobi,
    "dobi-remap": lambda model, stats, keep, **kw: compress_dobi(model, stats, keep, remap=True, **kw),
    "palu": compress_palu,
}

__all__ = ["COMPRESSORS", "CalibStats", "SVDSpectra", "cholesky_lower", "collect_stats", "compress_asvd", "compress_basis_sharing",
           "compress_dobi", "compress_palu", "compress_svd", "compress_svdllm", "compress_svdllm_v2"]
