"""Whether a tensor's bytes are a memory mapping of a given file (Linux: ``/proc/self/maps``), for the tests of the
caches that hand back memory-mapped tensors."""
from __future__ import annotations

from pathlib import Path

import torch


def mapping_name(t: torch.Tensor) -> str | None:
    """The pathname of the mapping holding ``t``'s first byte (`` (deleted)`` appended for an unlinked file), None for
    an anonymous mapping or none."""
    addr = t.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            if lo <= addr < hi:
                return parts[5].strip() if len(parts) == 6 else None
    return None


def mapped_from(t: torch.Tensor, path: str | Path) -> bool:
    """True when ``t``'s first byte lies in a mapping of the file now at ``path`` (named in the mapping as it is)."""
    return mapping_name(t) == str(Path(path).resolve())
