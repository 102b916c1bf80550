"""Checkpoint formats: every family's native bytes, written and read, all read into ONE representation.

    >>> from lowrank_lib import detect_format, load_checkpoint, save_checkpoint
    >>> detect_format("ckpt/jeffwan_llama_7b_hf_whitening_only_0.8.pt")   # -> "svdllm"
    >>> model = load_checkpoint("ckpt/share_llama2-7b_20")                # LlamaForCausalLM + LowRankLinear
    >>> save_checkpoint(model, "ckpt/mine")                               # safetensors + manifest, mmap-able

Families: "svdllm" (v1 and v2), "dobi", "dobi-remap", "basis_sharing", "asvd", "palu", "lowrank" (ours).
Pickled families are read with :mod:`.safe_pickle` (allow-list; nothing unpickled is executed).
"""
from __future__ import annotations

import zipfile
from pathlib import Path

import torch

from . import asvd, basis_sharing, dobi, lowrank, palu, svdllm
from .build import CheckpointError
from .safe_pickle import UnsafePickleError, pickle_globals

FAMILIES = ("svdllm", "dobi", "dobi-remap", "basis_sharing", "asvd", "palu", "lowrank")

_READERS = {"svdllm": svdllm.read, "dobi": dobi.read, "dobi-remap": dobi.read_remap,
            "basis_sharing": basis_sharing.read, "asvd": asvd.read, "palu": palu.read, "lowrank": lowrank.read}
_WRITERS = {"svdllm": svdllm.write, "dobi": dobi.write, "dobi-remap": dobi.write_remap,
            "basis_sharing": basis_sharing.write, "asvd": asvd.write, "palu": palu.write,
            "lowrank": lambda model, path, tokenizer=None: lowrank.save(model, path)}


def _detect_pickle(path: Path) -> str:
    try:
        names = pickle_globals(path)
    except (zipfile.BadZipFile, OSError, IndexError, ValueError) as e:
        raise CheckpointError(f"{path}: not a torch.save zip archive ({type(e).__name__}: {e})") from e
    if any(n.startswith(("component.svd_llama.", "component.svd_mistral.", "component.svd_opt.")) for n in names):
        return "svdllm"
    if "modules.module.SVDTransformLayer" in names:
        return "dobi"
    raise CheckpointError(f"{path}: a torch pickle without SVD-LLM (component.svd_*) or Dobi "
                          f"(modules.module.SVDTransformLayer) classes; found {sorted(names)[:8]}")


def detect_format(path: str | Path) -> str:
    """The checkpoint family at ``path`` (file or folder), read from names and headers only (no unpickling)."""
    import json

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_file():
        return _detect_pickle(path)
    if (path / lowrank.MANIFEST).exists():
        return "lowrank"
    if (path / "remapping_weight.pt").exists():
        return "dobi-remap"
    if (path / "DobiSVD_Model.pt").exists():
        return "dobi"
    cfg_path = path / "config.json"
    if cfg_path.exists():
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: invalid JSON ({e})") from e
        arch = " ".join(cfg.get("architectures") or []).lower()
        if "num_basis_q" in cfg or "sharellama" in arch:
            return "basis_sharing"
        if "truncation_ranks" in cfg or "asvd" in arch:
            return "asvd"
        if "head_wise_ranks" in cfg or str(cfg.get("model_type", "")).startswith("palu"):
            return "palu"
    pts = sorted(path.glob("*.pt"))
    if len(pts) == 1:
        return _detect_pickle(pts[0])
    raise CheckpointError(f"{path}: unknown layout (files: {sorted(p.name for p in path.iterdir())[:10]}); "
                          f"expected one of {FAMILIES}")


def load_checkpoint(path: str | Path, family: str | None = None, dtype: torch.dtype | None = torch.float32):
    """Read any supported checkpoint into a ``LlamaForCausalLM`` with ``LowRankLinear`` projections.

    ``family``: skip detection. ``dtype``: cast every tensor (default float32; None keeps the stored
    dtypes, which may be mixed). ``model.lowrank_meta`` says family, keep, ranks, shared groups, source.
    """
    path = Path(path)
    fam = family or detect_format(path)
    if fam not in _READERS:
        raise ValueError(f"unknown family {fam!r}; one of {FAMILIES}")
    if fam == "svdllm" and path.is_dir():
        path = sorted(path.glob("*.pt"))[0]
    return _READERS[fam](path, dtype=dtype)


def save_checkpoint(model, path: str | Path) -> Path:
    """Our own format (the recommended way to keep factors): safetensors + JSON manifest, mmap-loadable."""
    return lowrank.save(model, path)


def write_native(model, family: str, path: str | Path, tokenizer=None, **kw) -> Path:
    """Write ``model`` in ``family``'s native layout at ``path`` (file or folder as the family uses)."""
    if family not in _WRITERS:
        raise ValueError(f"unknown family {family!r}; one of {FAMILIES}")
    return _WRITERS[family](model, path, tokenizer=tokenizer, **kw)


__all__ = ["FAMILIES", "CheckpointError", "UnsafePickleError", "detect_format", "load_checkpoint",
           "save_checkpoint", "write_native"]
