"""Cost model of one decode step of attention, per KV head: dense KV, AttSVD rebuild, factor space.

FLOPs and bytes for ``route`` in ``ROUTES``; the factor-space benchmark (``lowrank_lib.eval.factor_space``, ``bench
factor-space``) reports these next to the measured times and notebook 06 plots them. The formulas follow
:mod:`lowrank_lib.attsvd.factor_space` (scores ``G (r_K d + n r_K)``, output ``G (n r_V + r_V d)``
MACs per factored run) and the paper's rebuild (``n r d`` per run, then dense attention).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ROUTES", "StepCost", "cost_table", "step_cost"]

ROUTES = ("dense", "rebuild", "factor")


@dataclass(frozen=True)
class StepCost:
    """Work of one decode step for one KV head (all G query heads of its group).

    flops : multiply-adds x 2 of the matmuls (softmax and masking are O(G N), counted in ``flops``
        as 5 per score).
    bytes_read : cache bytes the step must read (factors or K/V) + the intermediate K/V a rebuild
        writes and reads back + the scores/probabilities (fp32) written and read once.
    bytes_stored : persistent cache bytes of this head (the memory the route needs between steps).
    """

    route: str
    flops: int
    bytes_read: int
    bytes_stored: int

    def to_dict(self) -> dict:
        return {"route": self.route, "flops": self.flops, "bytes_read": self.bytes_read,
                "bytes_stored": self.bytes_stored}


def step_cost(route: str, context: int, head_dim: int, rank_k: int, rank_v: int | None = None,
              window: int = 0, group: int = 1, q_len: int = 1, dtype_bytes: int = 4,
              segments: list[tuple[int, int, int]] | None = None) -> StepCost:
    """FLOPs and bytes of one decode step per KV head for ``route`` in ("dense", "rebuild", "factor").

    Parameters
    ----------
    context : N, total attended positions (bulk + blocks + window).
    rank_k, rank_v : ranks of the bulk (rank_v defaults to rank_k).
    window : w, exact positions (the rest, N - w, is factored as ONE bulk unless ``segments`` is given).
    group : G query heads per KV head; ``q_len`` query rows each.
    segments : optional explicit factored runs ``[(n_i, r_K_i, r_V_i), ...]`` (stream blocks);
        their lengths plus ``window`` must equal ``context``.

    The dense route stores the full K/V (2 N d values); rebuild and factor store the same factors.
    """
    if route not in ROUTES:
        raise ValueError(f"route must be one of {ROUTES}, got {route!r}")
    rank_v = rank_k if rank_v is None else rank_v
    if segments is None:
        segments = [(context - window, rank_k, rank_v)] if context > window else []
    if sum(n for n, _, _ in segments) + window != context:
        raise ValueError(f"segments {segments} + window {window} do not add up to context {context}")
    d, rows, e = head_dim, group * q_len, dtype_bytes
    softmax_flops = 5 * rows * context
    score_bytes = 2 * 4 * rows * context  # fp32 scores written + read, probabilities likewise once
    dense_mm = 2 * 2 * rows * context * d  # q K^T and p V
    if route == "dense":
        stored = 2 * context * d * e
        return StepCost(route, dense_mm + softmax_flops, stored + score_bytes, stored)
    factor_vals = sum(n * (rk + rv) + d * (rk + rv) for n, rk, rv in segments)
    stored = (factor_vals + 2 * window * d) * e
    if route == "rebuild":
        rebuild = sum(2 * n * d * (rk + rv) for n, rk, rv in segments)
        rebuilt_kv = 2 * sum(n for n, _, _ in segments) * d * e  # written once, read back by attention
        return StepCost(route, rebuild + dense_mm + softmax_flops,
                        stored + 2 * rebuilt_kv + score_bytes, stored)
    fac = sum(2 * rows * (d * rk + n * rk + n * rv + rv * d) for n, rk, rv in segments)
    win = 2 * 2 * rows * window * d
    return StepCost(route, fac + win + softmax_flops, stored + score_bytes, stored)


def cost_table(contexts: list[int], head_dim: int, ranks: list[int], window: int = 0, group: int = 1,
               dtype_bytes: int = 4) -> list[dict]:
    """Rows {context, rank, route, flops, bytes_read, bytes_stored} for every combination.

    The dense route is rank-independent and appears once per context (``rank`` = head_dim).
    """
    rows = []
    for n in contexts:
        c = step_cost("dense", n, head_dim, head_dim, window=0, group=group, dtype_bytes=dtype_bytes)
        rows.append({"context": n, "rank": head_dim, **c.to_dict()})
        for r in ranks:
            for route in ("rebuild", "factor"):
                c = step_cost(route, n, head_dim, r, window=window, group=group, dtype_bytes=dtype_bytes)
                rows.append({"context": n, "rank": r, **c.to_dict()})
    return rows
