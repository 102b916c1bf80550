"""The on-disk cache of full-rank spectra (:class:`~lowrank_lib.compress.common.FullRankFactors`): a keep slider
reopened on the same weights reads its decomposition back instead of computing it again.

One safetensors file per key (``u.<name>``, ``v.<name>``, ``bias.<name>``; metadata: the format, the kind of
spectra, the targets, the names), written atomically, memory-mapped back, the folder pruned least recently used
first to a byte limit (:func:`lowrank_lib.models.prune_lru`). Users: :meth:`WhitenedSpectra.cached` (SVD-LLM's
whitened SVDs of a dense model, keyed by its weights and calibration tokens) and :meth:`FactorSpectra.cached` (a
checkpoint's factors re-decomposed, keyed by its weights).
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, TypeVar

import torch

__all__ = ["weights_digest", "write_spectra", "read_spectra", "cached", "prune_cache"]

S = TypeVar("S")


def weights_digest(model, h: "hashlib._Hash | None" = None) -> "hashlib._Hash":
    """``h`` (a new sha256 by default) updated with every state-dict entry of ``model``: name, dtype, shape, bytes."""
    h = h if h is not None else hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + str(t.dtype).encode() + str(tuple(t.shape)).encode())
        if t.numel():                                # the bytes in place (no copy of each tensor to hash)
            h.update(t.detach().contiguous().view(torch.uint8).reshape(-1).numpy())
    return h


def write_spectra(spectra, path: str | Path, fmt: int, kind: str | None = None) -> Path:
    """Write ``spectra``' factors (``u`` / ``v`` / ``bias`` dicts, ``targets``) as one safetensors file; ``kind``
    (a class name) is checked on reading when given."""
    from safetensors.torch import save_file

    tensors = {f"u.{n}": t.contiguous() for n, t in spectra.u.items()}
    tensors.update({f"v.{n}": t.contiguous() for n, t in spectra.v.items()})
    tensors.update({f"bias.{n}": b.contiguous() for n, b in spectra.bias.items() if b is not None})
    meta = {"format": str(fmt), "targets": json.dumps(list(spectra.targets)), "names": json.dumps(list(spectra.u))}
    if kind is not None:
        meta["kind"] = kind
    path = Path(path)
    save_file(tensors, str(path), metadata=meta)
    return path


def read_spectra(path: str | Path, fmt: int, kind: str | None = None) -> tuple[dict, dict, dict, tuple[str, ...]]:
    """``(u, v, bias, targets)`` of a file :func:`write_spectra` wrote, memory-mapped (ValueError for another format,
    another kind or a missing tensor)."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata() or {}
        if meta.get("format") != str(fmt):
            raise ValueError(f"{path}: spectra of format {meta.get('format')!r}, expected {fmt}")
        if kind is not None and meta.get("kind") != kind:
            raise ValueError(f"{path}: {meta.get('kind')!r} spectra, expected {kind!r}")
        names, keys = json.loads(meta["names"]), set(f.keys())
        missing = [k for n in names for k in (f"u.{n}", f"v.{n}") if k not in keys]
        if missing:
            raise ValueError(f"{path}: missing {missing[:3]}")
        u = {n: f.get_tensor(f"u.{n}") for n in names}
        v = {n: f.get_tensor(f"v.{n}") for n in names}
        bias = {n: f.get_tensor(f"bias.{n}") if f"bias.{n}" in keys else None for n in names}
    return u, v, bias, tuple(json.loads(meta["targets"]))


def cached(folder: str | Path, key: str, load: Callable[[Path], S], make: Callable[[], tuple[S, dict]],
           save: Callable[[S, Path], object], max_bytes: int, misses: dict | None = None,
           started: float | None = None) -> tuple[S, dict]:
    """``(spectra, info)``: ``load(path)`` of ``<folder>/<key>.safetensors`` when it is there and reads back, else
    ``make()`` (spectra and the info of the work done) written there atomically by ``save`` and the folder pruned to
    ``max_bytes`` (a file larger than that alone is not kept: its temporary is deleted). Once written, the spectra
    returned are the file's, memory-mapped (``load``), and the ones ``make`` computed are dropped: a 7B file's factors
    (~7 GB) then sit in pages the kernel may evict and read again, not in anonymous memory next to the model.
    ``info``: ``key``, ``path``, ``hit``, ``written``,
    ``seconds`` (from ``started``, a ``time.perf_counter()`` the caller took before hashing the key; default now),
    and ``misses`` (the keys a hit reports as 0) or ``make``'s info."""
    t0 = time.perf_counter() if started is None else started
    folder = Path(folder)
    path = folder / f"{key}.safetensors"
    info = {"key": key, "path": str(path), "hit": False, "written": False, **(misses or {})}
    if path.is_file():
        try:
            spectra = load(path)
            os.utime(path)                                  # recently used: the last to be pruned
            return spectra, {**info, "hit": True, "seconds": time.perf_counter() - t0}
        except Exception:            # noqa: BLE001  damaged (safetensors' own error type), foreign: made again
            path.unlink(missing_ok=True)
    spectra, made = make()
    folder.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    save(spectra, tmp)
    if tmp.stat().st_size > max_bytes:              # would push everything else out and still overflow: not kept
        tmp.unlink()
    else:
        os.replace(tmp, path)
        prune_cache(folder, max_bytes, keep=path)
        info["written"] = True
        try:
            mapped = load(path)
        except Exception:            # noqa: BLE001  replaced or pruned by another process meanwhile: keep ours
            mapped = None
        if mapped is not None:
            spectra = mapped
    return spectra, {**info, **made, "seconds": time.perf_counter() - t0}


def prune_cache(folder: str | Path, max_bytes: int, keep: str | Path | None = None) -> list[Path]:
    """The least recently used spectra files of ``folder`` deleted until the rest hold at most ``max_bytes``
    (:func:`lowrank_lib.models.prune_lru`); ``keep`` never. Returns what was deleted."""
    from ..models import prune_lru

    return prune_lru(folder, max_bytes, keep, "*.safetensors")
