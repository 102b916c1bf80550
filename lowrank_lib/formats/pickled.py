"""Reading pickled ``{'model', 'tokenizer'}`` checkpoints (SVD-LLM, Dobi no-remap) without running them.

The restricted unpickler turns every module into a :class:`~.safe_pickle.Stub` that holds its
``__dict__``; here we flatten the stub tree to tensors and read the config VALUES, then the family
module maps keys to factors and :func:`~.build.build_model` constructs a fresh transformers model.
"""
from __future__ import annotations

from pathlib import Path

from .build import CheckpointError
from .safe_pickle import Stub, module_state, safe_torch_load, stub_plain


def read_pickled_model(path: Path):
    """-> (state dict of tensors, config dict, set of module class paths in the tree)."""
    obj = safe_torch_load(path)
    if not (isinstance(obj, dict) and isinstance(obj.get("model"), Stub)):
        found = sorted(obj)[:5] if isinstance(obj, dict) else type(obj).__name__
        raise CheckpointError(f"{path}: expected a pickled {{'model': nn.Module, 'tokenizer': ...}}, found {found}")
    root = obj["model"]
    cfg = stub_plain(root.__dict__.get("config"))
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: the pickled model carries no config")
    return module_state(root), cfg, _class_paths(root)


def _class_paths(obj, out=None) -> set[str]:
    out = set() if out is None else out
    if isinstance(obj, Stub):
        out.add(obj.stub_path)
        for sub in (obj.__dict__.get("_modules") or {}).values():
            _class_paths(sub, out)
    return out
