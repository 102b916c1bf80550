"""Describe a checkpoint's layout without building a model (for notebooks and debugging).

:func:`describe` lists the files, and the tensors of one decoder layer (key, shape, dtype) as
stored, reading pickles through the restricted unpickler. :data:`FAMILY_NOTES` says, per format,
which tensor is U / V in our convention, where Sigma lives and what the family's "ratio" means
(a view of :mod:`lowrank_lib.families`, where the notes live).
"""
from __future__ import annotations

import re
from pathlib import Path

from .. import families
from .errors import guarded
from .lazy import LazyTensor

FAMILY_NOTES = {f.name: f.notes for f in families.formats()}


def _tensors(path: Path, family: str) -> dict[str, LazyTensor]:
    """The stored tensors (lazy: shapes and dtypes only, nothing read)."""
    from .common import read_safetensors_dir, read_torch_bin_dir, single_pt
    from .pickled import read_pickled_model
    from .safe_pickle import load_lazy

    if family in ("svdllm", "dobi"):
        if path.is_file():
            f = path
        elif family == "dobi":
            f = path / "DobiSVD_Model.pt"
        else:
            f = single_pt(path)
        return read_pickled_model(f, family)[0].state()
    if family == "dobi-remap":
        from .dobi import check_remap_entry
        from .errors import fail

        out = dict(read_torch_bin_dir(path))
        rw = path / "remapping_weight.pt"
        entries = load_lazy(rw, "state_dict")
        if not isinstance(entries, dict):
            fail(rw, "expected {module: entry}")
        for name, e in entries.items():
            for k, v in check_remap_entry(e, str(name), rw).items():
                if isinstance(v, LazyTensor):
                    out[f"{name}[{k}]"] = v
                elif isinstance(v, tuple):
                    out[f"{name}[{k}:{v[0]}]"] = v[1]
        return out
    if family == "basis_sharing":
        return read_torch_bin_dir(path)
    return read_safetensors_dir(path)


@guarded
def stored_values(path: str | Path) -> int:
    """The number of values a checkpoint stores: its tensors' elements, from the headers (nothing is read)."""
    from . import detect_format

    path = Path(path)
    return sum(t.numel() for t in _tensors(path, detect_format(path)).values())


def describe(path: str | Path, layer: int = 0) -> dict:
    """``{"family", "files": [(name, bytes)], "tensors": [(key, shape, dtype)] of one layer, "notes"}``."""
    from . import detect_format

    path = Path(path)
    fam = detect_format(path)
    files = [(path.name, path.stat().st_size)] if path.is_file() else \
        sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*") if p.is_file())
    pat = re.compile(rf"(^|\.)layers\.{layer}\.|_basis\.{layer}\.")
    rows = [(k, list(v.shape), str(v.dtype).replace("torch.", "")) for k, v in _tensors(path, fam).items()
            if pat.search(k) and "norm" not in k]
    return {"family": fam, "files": files, "tensors": rows, "notes": FAMILY_NOTES[fam]}
