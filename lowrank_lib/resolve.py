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

The tokenizer is the reference's; without a reference (or a reference without one), the one saved beside the
checkpoint (the HF-style families write one into their folder); else None (the notebooks then run on random token
ids).

A checkpoint is read once per content: :func:`load_normalised` keeps the normalised model (our safetensors format,
memory-mapped back) under ``<model cache>/normalised/<sha256 of the source bytes>-<dtype>/``, so the notebooks of
one report run read the native file once. :func:`describe` says what a notebook ran on (its label, the family, the
banner of a run without a tokenizer).
"""
from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path
from typing import NamedTuple

import torch

from . import host

__all__ = ["COPIES", "NO_TOKENIZER", "Resolved", "check_reference", "checkpoint_params", "checkpoint_tokenizer",
           "describe", "load_dtype", "load_normalised", "normalised_path", "resolve_models", "run_dtype", "source_hash"]

#: the banner of a notebook run on a checkpoint without any tokenizer
NO_TOKENIZER = ("No tokenizer: none was saved beside the checkpoint and MODEL is None, so this notebook runs on "
                "random token ids, and every row that needs text (perplexity, readable tokens) is left out.")

#: the config fields a checkpoint and its dense reference share (the notebooks compare them layer by layer)
GEOMETRY = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads")

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


def source_hash(checkpoint: str | Path) -> str | None:
    """sha256 of a checkpoint's bytes: a file's content, or a folder's regular files (each relative name and
    content, in name order); None when the path is neither (the loader then names what it is)."""
    path = Path(checkpoint)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        files = [(path.name, path)]
    elif stat.S_ISDIR(mode):
        files = sorted((str(f.relative_to(path)), f) for f in path.rglob("*") if f.is_file() and not f.is_symlink())
    else:
        return None
    h = hashlib.sha256()
    try:
        for name, f in files:
            h.update(name.encode() + b"\0")
            with open(f, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
            h.update(b"\0")
    except OSError:
        return None
    return h.hexdigest()


#: how many copies of a model's weights a notebook may hold at once (notebook 02: the model its HF runners share, the
#: engine's packed copy, and the working set around them): ``run_dtype("auto")`` picks bf16 when that many fp32
#: copies would not fit in this machine's memory
COPIES = 3


def checkpoint_params(checkpoint: str | Path) -> int:
    """The number of values a checkpoint stores (its tensors' elements, read from the headers: nothing is loaded);
    a checkpoint the loader cannot read raises its :class:`~lowrank_lib.formats.CheckpointError`."""
    from .formats.inspect import stored_values

    return stored_values(checkpoint)


def run_dtype(dtype: str, checkpoint: str | Path | None = None, memory_bytes: int | None = None) -> str:
    """A notebook's ``DTYPE``: ``"fp32"`` / ``"bf16"`` as given; ``"auto"``: ``"fp32"`` unless :data:`COPIES` copies
    of the checkpoint's values in fp32 would exceed ``memory_bytes`` (default: this machine's physical memory), then
    ``"bf16"`` (a LLaMA-7B-shape file at keep 0.8: 5.4 G values, 65 GB in three fp32 copies, 33 GB in bf16, of which
    the model the runners share is memory-mapped from the normalised cache). Without a checkpoint ``"auto"`` is
    ``"fp32"`` (the built-in models are small)."""
    if dtype != "auto":
        return dtype
    if checkpoint is None:
        return "fp32"
    if memory_bytes is None:
        memory_bytes = host.physical_memory()
    return "bf16" if COPIES * 4 * checkpoint_params(checkpoint) > memory_bytes else "fp32"


def normalised_path(digest: str, dtype: torch.dtype | None) -> Path:
    """The cache folder of the normalised model of the source with ``digest`` (:func:`source_hash`) at ``dtype``."""
    from .models import default_cache_dir

    kind = str(dtype).removeprefix("torch.") if dtype is not None else "stored"
    return default_cache_dir() / "normalised" / f"{digest[:40]}-{kind}"


def load_normalised(checkpoint: str | Path, dtype: torch.dtype | None = torch.float32, cache: bool = True):
    """:func:`lowrank_lib.formats.load_checkpoint` of ``checkpoint``, through the normalised-model cache: the
    first read of a content writes our safetensors format under :func:`normalised_path`, every later read of the
    same bytes maps that back instead of the native file (a changed file has another hash: a miss); after a write the
    least recently used entries go until the folder holds at most ``$LOWRANK_LIB_NORMALISED_CACHE_GB`` (default 64:
    two 7B models in fp32). Our own format
    is read directly. ``lowrank_meta["source"]`` stays the checkpoint; ``["normalised_cache"]`` names the entry,
    ``["normalised_cache_hit"]`` says whether it was read from there."""
    from .formats import CheckpointError, detect_format, load_checkpoint, save_checkpoint
    from .models import cache_limit, prune_lru

    if not cache or detect_format(checkpoint) == "lowrank":       # detect: an unreadable layout raises here
        return load_checkpoint(checkpoint, dtype=dtype)
    digest = source_hash(checkpoint)
    if digest is None:
        return load_checkpoint(checkpoint, dtype=dtype)
    entry = normalised_path(digest, dtype)
    model, hit = None, False
    if entry.is_dir():
        try:
            model, hit = load_checkpoint(entry, family="lowrank", dtype=dtype, progress=False), True
            os.utime(entry)                                       # recently used: the last to be pruned
        except CheckpointError:                                   # a damaged entry: made again below
            shutil.rmtree(entry, ignore_errors=True)
    if model is None:
        model = load_checkpoint(checkpoint, dtype=dtype)
        tmp = entry.with_name(f"{entry.name}.tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        save_checkpoint(model, tmp)
        try:
            os.replace(tmp, entry)
        except OSError:                                           # another process wrote it first
            shutil.rmtree(tmp, ignore_errors=True)
        prune_lru(entry.parent, cache_limit("LOWRANK_LIB_NORMALISED_CACHE_GB", 64), keep=entry)
    model.lowrank_meta = {**(getattr(model, "lowrank_meta", None) or {}), "source": str(checkpoint),
                          "normalised_cache": str(entry), "normalised_cache_hit": hit}
    return model


def check_reference(checkpoint, comp_config, model, dense_config) -> None:
    """ValueError unless the reference ``model`` (its ``dense_config``) is the dense model of ``checkpoint``
    (``comp_config``): the same vocabulary and :data:`GEOMETRY`."""
    if dense_config.vocab_size != comp_config.vocab_size:
        raise ValueError(f"the checkpoint {checkpoint} has a vocabulary of {comp_config.vocab_size} tokens, the "
                         f"reference {model} {dense_config.vocab_size}: not its dense model")
    differ = {k: (getattr(comp_config, k, None), getattr(dense_config, k, None)) for k in GEOMETRY
              if getattr(comp_config, k, None) != getattr(dense_config, k, None)}
    if differ:
        raise ValueError(f"the checkpoint {checkpoint} and the reference {model} differ in "
                         + ", ".join(f"{k} ({a} vs {b})" for k, (a, b) in differ.items()) + ": not its dense model")


def describe(model: str | Path | None, checkpoint: str | Path | None, resolved: Resolved) -> dict:
    """What a notebook ran on: ``label`` (for titles and the report index), ``model``, ``checkpoint``, ``family``,
    ``keep``, ``reference`` (a dense model was given), ``random_weights`` (a tiny preset), ``tokenizer``,
    ``cache_hit`` (read from the normalised cache; None: not through it) and
    ``banner`` (:data:`NO_TOKENIZER` for a checkpoint run without one, else None)."""
    meta = getattr(resolved.compressed, "lowrank_meta", None) or {}
    has_tok = resolved.tokenizer is not None
    keep = meta.get("keep")
    if checkpoint is not None:
        keep_s = f", keep {keep:.2f}" if isinstance(keep, (int, float)) else ""
        label = f"{Path(checkpoint).name} ({meta.get('family', '?')}{keep_s})"
    else:
        label = f"{model} (random weights)" if not has_tok else str(model)
    return {"label": label, "model": None if model is None else str(model),
            "checkpoint": None if checkpoint is None else str(checkpoint), "family": meta.get("family"),
            "keep": round(float(keep), 4) if isinstance(keep, (int, float)) else None,
            "reference": resolved.dense is not None,
            "random_weights": checkpoint is None and not has_tok, "tokenizer": has_tok,
            "cache_hit": meta.get("normalised_cache_hit"),
            "banner": NO_TOKENIZER if checkpoint is not None and not has_tok else None}


def load_dtype(checkpoint: str | Path | None) -> torch.dtype:
    """The dtype a notebook loads ``checkpoint`` in when it names none: :func:`run_dtype` ``("auto")``'s."""
    return torch.bfloat16 if run_dtype("auto", checkpoint) == "bf16" else torch.float32


def resolve_models(model: str | Path | None = "smollm2", checkpoint: str | Path | None = None, *,
                   method: str = "svd", keep: float = 0.5, device: str = "cpu", dtype: torch.dtype | None = None,
                   calib_samples: int = 8, calib_seq_len: int = 256, cache: bool = True) -> Resolved:
    """-> :class:`Resolved` (dense or None, compressed, tokenizer or None) on ``device``; ``dtype`` for both
    (``llama7b-random``: bf16 random weights and random factors at ``keep``); None: :func:`load_dtype` (fp32, or
    bf16 for a checkpoint whose fp32 copies would not fit in memory). ``cache``: read the checkpoint through
    the normalised-model cache (:func:`load_normalised`)."""
    from . import models

    if model is None and checkpoint is None:
        raise ValueError("resolve_models needs a model, a checkpoint, or both")
    if dtype is None and str(model) != "llama7b-random":
        dtype = load_dtype(checkpoint)
    if str(model) == "llama7b-random":
        if checkpoint is not None:
            raise ValueError("llama7b-random is random weights: it takes no checkpoint")
        import copy

        dense = models.random_llama(models.LLAMA7B, torch.bfloat16, device)
        return Resolved(dense, models.random_lowrank(copy.deepcopy(dense), keep), None)
    comp = None
    if checkpoint is not None:               # first: an unreadable file stops here, before the reference loads
        comp = load_normalised(checkpoint, dtype=dtype, cache=cache).to(device).eval()
    dense, tok = models.load(model, dtype=dtype, device=device) if model is not None else (None, None)
    if comp is not None:
        if dense is not None:
            check_reference(checkpoint, comp.config, model, dense.config)
        return Resolved(dense, comp, tok if tok is not None else checkpoint_tokenizer(checkpoint))
    if method == "svd":
        from .compress import compress_svd

        return Resolved(dense, compress_svd(dense, keep), tok)
    from .compress import COMPRESSORS, collect_stats
    from .compress.calib import calibration_data

    if method not in COMPRESSORS:
        raise ValueError(f"unknown method {method!r}: use 'svd' or one of {sorted(COMPRESSORS)}")
    ids = calibration_data(tok, calib_samples, calib_seq_len, vocab_size=dense.config.vocab_size)
    return Resolved(dense, COMPRESSORS[method](dense, collect_stats(dense, ids), keep), tok)
