"""Reading pickled ``{'model', 'tokenizer'}`` checkpoints (SVD-LLM, Dobi no-remap) without running them.

The restricted unpickler (with the family's allow-list) turns every module into a
:class:`~.safe_pickle.Stub` that holds its ``__dict__``; here the stub tree is flattened to
lazy tensors (each module once, see :func:`~.safe_pickle.module_tree`; no tensor byte read yet) and
the config VALUES are read;
then the family module maps keys to factors and :func:`~.build.build_model` constructs a fresh
transformers model.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Callable

from .errors import brief, fail
from .safe_pickle import ModuleTree, Stub, load_lazy, module_tree, plain_data


def read_pickled_model(path: Path, family: str) -> tuple[ModuleTree, dict]:
    """-> (the model's module tree, its config as plain values)."""
    obj = load_lazy(path, family)
    if not (isinstance(obj, dict) and isinstance(obj.get("model"), Stub)):
        found = [brief(k) for k in list(obj)[:5]] if isinstance(obj, dict) else brief(obj)
        fail(path, f"expected a pickled {{'model': nn.Module, 'tokenizer': ...}}, found {found}")
    root = obj["model"]
    tree = module_tree(root, path)
    cfg = plain_data(root.__dict__.get("config"), path, "the model's config")
    if not isinstance(cfg, dict):
        fail(path, "the pickled model carries no config")
    return tree, cfg


def pair_factors(state: dict, pattern: re.Pattern, module: Callable[[dict], str], key: Callable[[dict, str, str], str],
                 u_side: str, v_side: str, path, why_no_v_bias: str) -> tuple[dict, dict]:
    """Split a pickled state into ``(dense, factors)`` by the family's factor naming.

    ``pattern`` matches a factor tensor key with groups ``side`` and ``kind`` (weight|bias) plus what
    ``module(groups)`` needs for the canonical module name; ``key(groups, side, kind)`` spells a key
    back. Every factor needs both sides; a bias is accepted on the U side (applied last) only.
    """
    dense, parts = {}, {}
    for k, v in state.items():
        mt = pattern.match(k)
        if mt is None:
            dense[k] = v
            continue
        g = mt.groupdict()
        parts.setdefault(module(g), (g, {}))[1][(g["side"], g["kind"])] = k
    factors = {}
    for name, (g, keys) in parts.items():
        uk, vk, bk = keys.get((u_side, "weight")), keys.get((v_side, "weight")), keys.get((u_side, "bias"))
        if uk is None or vk is None:
            have = uk or vk or next(iter(keys.values()))
            fail(path, f"'{have}' has no partner '{key(g, v_side if uk else u_side, 'weight')}'", key=have)
        if (v_side, "bias") in keys:
            fail(path, f"'{keys[(v_side, 'bias')]}': {why_no_v_bias}", key=keys[(v_side, "bias")])
        factors[name] = (state[uk], state[vk], state[bk] if bk else None,
                         {"U": uk, "V": vk, "bias": bk or key(g, u_side, "bias")})
    return dense, factors
