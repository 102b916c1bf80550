"""THE registry of KV methods: name -> the method class and its options. Adding a method is one file in
``kv/methods/`` (or a new option set of an existing class) and one line here; nothing in ``runtime/``, ``hf/`` or
``eval/`` changes (both adapters serve any :class:`~lowrank_lib.kv.method.KVMethod`).

    >>> m = make_method("composed-kvzip-q8", budget=0.25)      # budget: fraction of the dense KV bytes held
    >>> m.kind, m.scope, m.needs_queries, m.capturable
    ('composed', 'model', False, True)
"""
from __future__ import annotations

from functools import partial
from typing import Callable

from ..eviction import SCORERS
from .method import KVMethod
from .methods.attsvd import AttSVD
from .methods.composed import Composed, Eviction
from .methods.dense import Dense
from .methods.int8_rows import Int8Eviction

#: the AttSVD extension's observation window (picked on seed-0 WikiText-2 windows at a 2k prefill: KL
#: 0.048 / 0.045 / 0.054 for 256 / 512 / 1024 queries, 0.069 with every query; validated on other seeds)
EXT_OBS_WINDOW = 512
#: allocation of each eviction scorer, as the scorer declares it (``Scorer.allocation``: KVzip ranks every layer
#: and head together, the others per head): a new ``SCORERS`` entry is a new eviction method with nothing to add here
EVICTION_MODES = {name: cls.allocation for name, cls in SCORERS.items()}

METHODS: dict[str, Callable[..., KVMethod]] = {
    "dense": Dense,
    # AttSVD: the paper's algorithm, its stream mode, raw-K/V SVD (its baseline), our extensions
    "attsvd": AttSVD,
    "attsvd-stream": partial(AttSVD, mode="stream"),
    "svd": partial(AttSVD, attention_aware=False),
    "attsvd-km": partial(AttSVD, key_mass=True),
    "attsvd-ext": partial(AttSVD, key_mass=True, obs_window=EXT_OBS_WINDOW),
    # eviction: ragged per-head storage at the byte budget (kept rows + positions)
    **{name: partial(Eviction, scorer=name, mode=mode) for name, mode in EVICTION_MODES.items()},
    # the composed cache: KVzip-ranked exact tier + AttSVD low-rank tier (rank 8) + dropped
    "composed-kvzip": partial(Composed, scorer="kvzip", mode="global", mid_share=0.25, rank=8),
    "composed-kvzip-q8": partial(Composed, scorer="kvzip", mode="global", mid_share=0.25, rank=8, quant8=True),
    "composed-kvzip-q8-m50": partial(Composed, scorer="kvzip", mode="global", mid_share=0.5, rank=8, quant8=True),
    "composed-h2o_norm-q8": partial(Composed, scorer="h2o_norm", mode="global", mid_share=0.25, rank=8, quant8=True),
    # the low-rank tier's control: composed-kvzip-q8's ranking and allocation, every kept row in int8, no low-rank tier
    "kvzip-int8": partial(Int8Eviction, scorer="kvzip", mode="global"),
}


def make_method(name: str, budget: float | None = None, **options) -> KVMethod:
    """A fresh method ``name`` at ``budget`` (None: the method's default; Dense ignores it), ``options`` overriding
    the registry's (any field of the method's dataclass)."""
    if name not in METHODS:
        raise ValueError(f"unknown KV method {name!r}; choose from {sorted(METHODS)}")
    kw = dict(options)
    if budget is not None:
        kw["budget"] = budget
    m = METHODS[name](**kw)
    m.name = name
    return m


def method_kind(name: str) -> str:
    """The kind of a registered method ("dense" | "lowrank" | "eviction" | "composed") without building it."""
    f = METHODS[name]
    return (f.func if isinstance(f, partial) else f).kind
