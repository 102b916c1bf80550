"""lowrank_lib: fast, small, inspectable low-rank (SVD-compressed) language models."""
from .factorized import (LLAMA_PROJ, MIXED_4_8, Accounting, LowRankLinear, account, factorize, lowrank_modules,
                         quantize_factors, replace_with_factors, shared_groups, svd_factors)
from .quant import QuantizedTensor
from .ranks import keep_rank, native_to_keep, rank_keep

__version__ = "0.1.0"

__all__ = ["LLAMA_PROJ", "MIXED_4_8", "Accounting", "LowRankLinear", "QuantizedTensor", "account", "factorize", "keep_rank",
           "lowrank_modules", "native_to_keep", "quantize_factors", "rank_keep", "replace_with_factors",
           "shared_groups", "svd_factors"]


def __getattr__(name):  # lazy: formats are heavy and optional for most users
    if name in ("detect_format", "load_checkpoint", "save_checkpoint"):
        from . import formats

        return getattr(formats, name)
    raise AttributeError(f"module 'lowrank_lib' has no attribute {name!r}")
