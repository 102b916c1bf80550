"""Checkpoint formats: every family's native bytes, written and read, all read into ONE representation.

    >>> from lowrank_lib import detect_format, load_checkpoint, save_checkpoint
    >>> detect_format("ckpt/jeffwan_llama_7b_hf_whitening_only_0.8.pt")   # -> "svdllm"
    >>> model = load_checkpoint("ckpt/share_llama2-7b_20")                # LlamaForCausalLM + LowRankLinear
    >>> save_checkpoint(model, "ckpt/mine")                               # safetensors + manifest, mmap-able

Formats: "svdllm" (v1 and v2), "dobi", "dobi-remap", "basis_sharing", "asvd", "palu", "lowrank" (ours);
names and aliases come from the one registry :mod:`lowrank_lib.families`.

What the readers trust and refuse (the README's "Reliability" section says why): pickled families
are read with :mod:`.safe_pickle` (per-family allow-list; nothing unpickled is executed), torch
files are seen as ``torch.load`` sees them (:mod:`.torchfile`), safetensors headers are validated
(:mod:`.safetensors_file`), files are opened only if regular and capped (:mod:`.files`), and the
model is built only after every size was checked (:mod:`.build`), streaming each tensor once from
a mapping of the file (:mod:`.lazy`: CRC, cast, NaN/Inf scan, per chunk; peak memory = the model). Every failure is a
:class:`CheckpointError` naming the file (and the tensor).
"""
from __future__ import annotations

import os
import stat
from pathlib import Path

import torch

from .. import families
from ..factorized import quantize_factors
from ..quant import DEFAULT_GROUP
from . import lowrank
from .build import check_factor_bits
from .errors import CheckpointError, UnclassifiedCheckpointError, UnsafePickleError, guarded
from .common import single_pt
from .files import read_json, regular_file
from .safe_pickle import FAMILY_MARKERS, pickle_globals

#: The checkpoint formats (names a reader returns from ``detect_format``), from the registry.
FAMILIES = tuple(f.name for f in families.formats())


def _format(name: str, source) -> families.Family:
    try:
        return families.get_format(name)
    except families.UnknownFamily as e:
        raise CheckpointError(f"{source}: {e}", path=source) from None


def _detect_pickle(path: Path) -> str:
    names = pickle_globals(path)
    found = [fam for fam, markers in FAMILY_MARKERS.items() if any(n.startswith(markers) for n in names)]
    if len(found) == 1:
        return found[0]
    if found:
        raise CheckpointError(f"{path}: the pickle names classes of several families {found}; refusing to guess",
                              path=path)
    shown = sorted(names)[:8]
    raise CheckpointError(f"{path}: a torch pickle without SVD-LLM (component.svd_*) or Dobi "
                          f"(modules.module.SVDTransformLayer) classes; found {shown}", path=path)


@guarded
def detect_format(path: str | Path) -> str:
    """The checkpoint format at ``path`` (file or folder), read from names and headers only (no unpickling)."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file or folder", path=path) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot stat ({e})", path=path) from None
    if stat.S_ISREG(st.st_mode):
        return _detect_pickle(path)
    if not stat.S_ISDIR(st.st_mode):
        regular_file(path, "checkpoint")      # raises, naming what it is (FIFO, device, ...)
    if (path / lowrank.MANIFEST).exists():
        return "lowrank"
    if (path / "remapping_weight.pt").exists():
        return "dobi-remap"
    if (path / "DobiSVD_Model.pt").exists():
        return "dobi"
    cfg_path = path / "config.json"
    if cfg_path.exists():
        cfg = read_json(cfg_path, "config.json")
        archs = cfg.get("architectures") or []
        arch = " ".join(a for a in archs if isinstance(a, str)).lower() if isinstance(archs, list) else ""
        if "num_basis_q" in cfg or "sharellama" in arch:
            return "basis_sharing"
        if "truncation_ranks" in cfg or "asvd" in arch:
            return "asvd"
        if "head_wise_ranks" in cfg or str(cfg.get("model_type", "")).startswith("palu"):
            return "palu"
    pts = sorted(p for p in path.glob("*.pt") if p.is_file())
    if len(pts) == 1:
        return _detect_pickle(pts[0])
    try:
        files = sorted(p.name for p in path.iterdir())[:10]
    except OSError as e:
        raise CheckpointError(f"{path}: cannot list the folder ({e.strerror or e})", path=path) from None
    raise CheckpointError(f"{path}: unknown layout (files: {files}); expected one of {FAMILIES}", path=path)


@guarded
def load_checkpoint(path: str | Path, family: str | None = None, dtype: torch.dtype | None = None,
                    allow_nonfinite: bool = False, progress: bool = True, factor_bits: int | None = None,
                    factor_group: int = DEFAULT_GROUP):
    """Read any supported checkpoint into a ``LlamaForCausalLM`` with ``LowRankLinear`` projections.

    ``family``: skip detection (a format or family name; aliases accepted). ``dtype``: None (default)
    keeps the dtypes the file stores (SVD-LLM: fp32 factors, fp16 embeddings / norms / lm_head), a
    floating dtype casts each tensor while it is streamed (``torch.float32`` for the engine and the
    evaluations, ``torch.bfloat16`` to halve an fp32 file). ``allow_nonfinite``: load tensors holding
    NaN/Inf (refused by default) for inspection; they are listed in ``model.lowrank_meta["nonfinite"]``.
    ``progress``: a tqdm bar on stderr (bytes and tensors) when the load takes more than ~2 s.
    ``factor_bits`` (8 or 4; None keeps the factors as stored): every factor served quantized (QUANT_SPEC, fp16
    scales per ``factor_group`` columns; :func:`lowrank_lib.quantize_factors`'s math). A family whose file holds
    quantized codes of its own (Dobi-SVD remap) is requantized from them one factor at a time while streaming, so the
    model is never widened; every other family is read, then quantized.

    Memory and speed: the file is mapped, checked and streamed one tensor (one chunk) at a time; tensors
    kept in their stored dtype view the mapping, cast ones are converted chunk by chunk. Peak RSS is
    the loaded model plus a few chunks (the README's reliability section gives the measured contract).
    ``model.lowrank_meta`` says family, keep, ranks, shared groups, source, and the bytes per dtype as
    stored and as loaded (``"dtypes"``). Every failure is a :class:`CheckpointError` naming the file
    (and tensor).
    """
    path = Path(path)
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise CheckpointError(f"{path}: dtype {dtype!r} is not a floating torch.dtype (or None)", path=path)
    fmt = _format(family, path) if family is not None else families.get(detect_format(path))
    if fmt.name == "svdllm" and path.is_dir():
        path = single_pt(path)
    if factor_bits is not None:
        check_factor_bits(path, factor_bits, factor_group)
    served = factor_bits is not None and fmt.reads_codes
    kw = {"factor_bits": factor_bits, "factor_group": factor_group} if served else {}
    model = fmt.read(path, dtype=dtype, allow_nonfinite=allow_nonfinite, progress=progress, **kw)
    if factor_bits is not None and not kw:
        try:
            quantize_factors(model, factor_bits, factor_group)
        except ValueError as e:
            raise CheckpointError(f"{path}: cannot serve the factors at {factor_bits} bits: {e}", path=path) from None
    return model


def save_checkpoint(model, path: str | Path) -> Path:
    """Our own format (the recommended way to keep factors): safetensors + JSON manifest, mmap-loadable."""
    return lowrank.save(model, path)


def write_native(model, family: str, path: str | Path, tokenizer=None, **kw) -> Path:
    """Write ``model`` in ``family``'s native layout at ``path`` (file or folder as the family uses)."""
    fmt = families.get_format(family)          # UnknownFamily (a ValueError) for an unknown name
    return fmt.writer_fn(model, path, tokenizer=tokenizer, **kw)


__all__ = ["FAMILIES", "CheckpointError", "UnclassifiedCheckpointError", "UnsafePickleError", "detect_format",
           "load_checkpoint", "save_checkpoint", "write_native"]
