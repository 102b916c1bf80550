"""Compressors: each method's math, producing ``LowRankLinear`` factors (never touches files)."""
from .svd import compress_svd

__all__ = ["compress_svd"]
