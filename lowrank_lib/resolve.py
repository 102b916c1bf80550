"""ONE way to point the library at a model: (dense reference, compressed model, tokenizer) from ``MODEL`` and
``CHECKPOINT``, for every notebook and for ``bench``.

    >>> dense, comp, tok = resolve_models("smollm2", keep=0.6)                     # compress SmolLM2 (plain SVD)
    >>> dense, comp, tok = resolve_models("smollm2", "ckpt/jeffwan_llama_7b_hf_whitening_only_0.8.pt")
    >>> _, comp, tok = resolve_models(None, "ckpt/share_llama2-7b_20")            # the compressed file alone

``model``: the dense reference (``smollm2``, a tiny preset, a local HF directory, ``llama7b-random``) or None.
``checkpoint``: any family's native checkpoint or our normalised safetensors, read by
:func:`lowrank_lib.formats.load_checkpoint` (a file it cannot read raises its :class:`~lowrank_lib.formats.CheckpointError`,
naming the file and tensor, before the reference is loaded); None compresses the reference with ``method`` at
``keep`` (``svd``: plain truncated SVD; else a name in :data:`lowrank_lib.compress.COMPRESSORS`, calibrated on
``calib_samples`` windows of ``calib_seq_len`` tokens).

The tokenizer is the reference's; without a reference, the one saved beside the checkpoint (the HF-style families
write one into their folder); else None (the notebooks then run on random token ids).
"""
from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import torch

__all__ = ["Resolved", "checkpoint_tokenizer", "resolve_models"]

#: files that make a folder hold a tokenizer (``save_pretrained``)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class Resolved(NamedTuple):
    """What :func:`resolve_models` hands over; unpacks as ``dense, compressed, tokenizer``."""

    dense: torch.nn.Module | None
    compressed: torch.nn.Module
    tokenizer: object | None


def checkpoint_tokenizer(checkpoint: str | Path):
    """The tokenizer saved in a checkpoint's folder (or beside a checkpoint file), or None."""
    folder = Path(checkpoint)
    folder = folder if folder.is_dir() else folder.parent
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def resolve_models(model: str | Path | None = "smollm2", checkpoint: str | Path | None = None, *,
                   method: str = "svd", keep: float = 0.5, device: str = "cpu", dtype: torch.dtype = torch.float32,
                   calib_samples: int = 8, calib_seq_len: int = 256) -> Resolved:
    """-> :class:`Resolved` (dense or None, compressed, tokenizer or None) on ``device``; ``dtype`` for both
    (``llama7b-random``: bf16 random weights and random factors at ``keep``)."""
    from . import models

    if model is None and checkpoint is None:
        raise ValueError("resolve_models needs a model, a checkpoint, or both")
    if str(model) == "llama7b-random":
        if checkpoint is not None:
            raise ValueError("llama7b-random is random weights: it takes no checkpoint")
        import copy

        dense = models.random_llama(models.LLAMA7B, torch.bfloat16, device)
        return Resolved(dense, models.random_lowrank(copy.deepcopy(dense), keep), None)
    comp = None
    if checkpoint is not None:               # first: an unreadable file stops here, before the reference loads
        from .formats import load_checkpoint

        comp = load_checkpoint(checkpoint, dtype=dtype).to(device).eval()
    dense, tok = models.load(model, dtype=dtype, device=device) if model is not None else (None, None)
    if comp is not None:
        if dense is not None and dense.config.vocab_size != comp.config.vocab_size:
            raise ValueError(f"the checkpoint {checkpoint} has a vocabulary of {comp.config.vocab_size} tokens, the "
                             f"reference {model} {dense.config.vocab_size}: not its dense model")
        return Resolved(dense, comp, tok if dense is not None else checkpoint_tokenizer(checkpoint))
    if method == "svd":
        from .compress import compress_svd

        return Resolved(dense, compress_svd(dense, keep), tok)
    from .compress import COMPRESSORS, collect_stats
    from .compress.calib import calibration_data

    if method not in COMPRESSORS:
        raise ValueError(f"unknown method {method!r}: use 'svd' or one of {sorted(COMPRESSORS)}")
    ids = calibration_data(tok, calib_samples, calib_seq_len, vocab_size=dense.config.vocab_size)
    return Resolved(dense, COMPRESSORS[method](dense, collect_stats(dense, ids), keep), tok)
