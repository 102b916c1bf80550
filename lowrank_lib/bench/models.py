"""Models for benchmarks: a named / local model compressed by a family, read from a checkpoint, or LLaMA-7B-shaped
random weights (:func:`lowrank_lib.models.random_llama`)."""
from __future__ import annotations

import torch


def load_bench_models(model: str, method: str = "svd", keep: float = 0.5, checkpoint: str | None = None,
                      device: str = "cpu", calib_samples: int = 8, calib_seq_len: int = 256):
    """-> (dense_model, compressed_model, tokenizer or None), both fp32 unless 7B-shaped (bf16).

    ``model``: ``smollm2``, a tiny preset, a local HF dir, or ``llama7b-random``.
    ``method``: ``svd`` (plain truncated SVD, default) or a name in ``lowrank_lib.compress.COMPRESSORS``
    (calibrated on ``calib_samples`` windows). ``checkpoint``: read factors with
    ``lowrank_lib.formats.load_checkpoint`` instead (imported only then).
    """
    import copy

    from .. import models
    from ..compress import compress_svd

    if model == "llama7b-random":
        dense = models.random_llama(models.LLAMA7B, torch.bfloat16, device)
        comp = models.random_lowrank(copy.deepcopy(dense), keep)
        return dense, comp, None
    dense, tok = models.load(model, device=device)
    if checkpoint:
        from ..formats import load_checkpoint

        return dense, load_checkpoint(checkpoint, dtype=dense.dtype).to(device).eval(), tok
    if method == "svd":
        return dense, compress_svd(dense, keep), tok
    from ..compress import COMPRESSORS, collect_stats
    from ..compress.calib import calibration_data

    if method not in COMPRESSORS:
        raise ValueError(f"unknown method {method!r}: use 'svd' or one of {sorted(COMPRESSORS)}")
    ids = calibration_data(tok, calib_samples, calib_seq_len, vocab_size=dense.config.vocab_size)
    stats = collect_stats(dense, ids)
    return dense, COMPRESSORS[method](dense, stats, keep), tok
