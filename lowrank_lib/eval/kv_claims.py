"""What notebook 05 may say about KV caches, computed from per-window results (:mod:`lowrank_lib.eval.paired`).

Every function reads results keyed ``"<method>@<point>"`` (``point``: a budget written ``f"{b:g}"``, or ``"exact"``)
as :func:`lowrank_lib.eval.kvquality.continuation_quality` returns them (``to_dict()``: ``kl``, ``window_kl``,
``memory_ratio``), and returns :class:`~lowrank_lib.eval.paired.Paired` comparisons or plain facts, never a
sentence decided in advance: "A beats B" only where the interval of the paired KL ratio excludes 1.

    >>> exact_method("h2o", geometry(model), torch.float32, 1024, window=32, chunk=128)   # every prompt row held
    >>> kl_compare(res, "composed-kvzip-q8@0.25", "kvzip-int8@0.25").sentence()
"""
from __future__ import annotations

import torch

from ..eviction.budget import token_bytes
from ..kv import make_method, method_kind
from ..kv.tiers import descriptor_nbytes
from .paired import Paired, compare

__all__ = ["budget_claims", "energy_claims", "exact_method", "failed_targets", "frontier_pairs", "kl_compare"]


def exact_method(name: str, geom, dtype: torch.dtype, prompt_len: int, window: int, chunk: int):
    """``name`` configured to hold every prompt token exactly: a low-rank method at rank = head_dim, an eviction
    policy at the budget of every row (key, value, position) and its layer descriptors, no more."""
    kind = method_kind(name)
    d = geom.head_dim
    if kind == "lowrank":
        return make_method(name, rank=d, window=window, chunk=chunk)
    if kind != "eviction":
        raise ValueError(f"exact_method: {name!r} is a {kind} method (only low-rank and eviction methods)")
    elt = torch.empty(0, dtype=dtype).element_size()
    L, H = geom.n_layers, geom.n_kv_heads
    held = L * H * prompt_len * token_bytes(d, elt, prompt_len) + L * descriptor_nbytes(H, 0)
    dense = 2 * L * H * prompt_len * d * elt
    return make_method(name, (held + 0.5) / dense, window=window)


def kl_compare(res: dict, a: str, b: str) -> Paired:
    """Per-window KL of ``a`` against ``b`` (the same windows): the geometric-mean ratio when every window's KL
    is positive, else the plain difference."""
    ka, kb = res[a]["window_kl"], res[b]["window_kl"]
    scale = "log" if min(ka + kb) > 0 else "linear"
    return compare(ka, kb, (a, b), scale=scale)


def budget_claims(res: dict, point: str, lowrank: list[str], eviction: list[str]) -> dict:
    """At one point: the lowest mean KL, the best low-rank and the best eviction cache and their paired
    comparison, and every eviction policy compared with plain ``attsvd`` (when both ran)."""
    key = lambda m: f"{m}@{point}"
    have = lambda ms: [m for m in ms if key(m) in res]
    lr, ev = have(lowrank), have(eviction)
    everyone = lr + ev
    out = {"point": point, "best": min(everyone, key=lambda m: res[key(m)]["kl"]) if everyone else None}
    if lr and ev:
        bl = min(lr, key=lambda m: res[key(m)]["kl"])
        be = min(ev, key=lambda m: res[key(m)]["kl"])
        out |= {"best_lowrank": bl, "best_eviction": be, "lowrank_vs_eviction": kl_compare(res, key(bl), key(be))}
    if "attsvd" in lr:
        out["vs_attsvd"] = {m: kl_compare(res, key(m), key("attsvd")) for m in ev}
    return out


def energy_claims(res: dict, energy: str, fixed: list[str]) -> dict:
    """The energy-rule cache ``energy`` against every fixed-rank cache of ``fixed`` holding at most its bytes
    (1 % slack): ``dominated_by`` lists those with a lower KL whose interval excludes zero."""
    m = res[energy]["memory_ratio"]
    cmp = {f: kl_compare(res, f, energy) for f in fixed if res[f]["memory_ratio"] <= 1.01 * m}
    return {"memory_ratio": m, "comparisons": cmp, "dominated_by": [f for f, c in cmp.items() if c.verdict == "a better"]}


def failed_targets(targets: dict) -> list[str]:
    """The acceptance checks (``pass_*``) that failed."""
    return [k for k, v in targets.items() if k.startswith("pass_") and not v]


def frontier_pairs(frontier: dict, prefills: list[int]) -> list[dict]:
    """Per (prefill, budget) of a kv-frontier file's ``best``: its best cache of ours against its best eviction
    policy, paired over the windows both ran (``window_ids``)."""
    rows = {(r["prefill"], r["budget"], r["policy"]): r for r in frontier["rows"]}
    out = []
    for b in frontier["best"]:
        if b["prefill"] not in prefills:
            continue
        o = rows[(b["prefill"], b["budget"], b["best_ours"])]
        e = rows[(b["prefill"], b["budget"], b["best_eviction"])]
        common = sorted(set(o["window_ids"]) & set(e["window_ids"]))
        ko = [o["window_kl"][o["window_ids"].index(w)] for w in common]
        ke = [e["window_kl"][e["window_ids"].index(w)] for w in common]
        c = compare(ko, ke, (b["best_ours"], b["best_eviction"]), scale="log" if min(ko + ke) > 0 else "linear")
        out.append(b | {"paired": c})
    return out
