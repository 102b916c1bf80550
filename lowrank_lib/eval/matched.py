"""Compare checkpoint families at the size they really hold, not at their nominal keep (notebook 01, issue 27).

A family's "keep 0.6" can hold almost the dense model (Palu compresses k/v only) or more than it (Dobi-SVD's
remap keeps dense-size factors); ranking rows by the nominal keep then compares models of different sizes.
These functions read the rows of :func:`lowrank_lib.eval.quality.run` (``family``, ``keep``, ``ppl`` and a real
size such as ``total_params`` or ``disk_bytes``) and say which rows are comparable and what is anomalous.

    >>> groups = matched_groups(rows, "total_params", tol=0.03)    # rows within 3 % of each other's size
    >>> size_facts(rows, dense_size, "total_params")               # rows at/above dense, perplexity rising with size
"""
from __future__ import annotations

__all__ = ["matched_groups", "size_facts"]


def matched_groups(rows: list[dict], size: str = "total_params", tol: float = 0.03) -> list[list[dict]]:
    """Rows grouped by real size (sorted; a group holds the rows within ``(1 + tol)`` of its smallest), each group
    sorted by perplexity (best first). Only groups of at least two DIFFERENT families are returned: those are
    the comparisons at matched size."""
    out, group = [], []
    for r in sorted(rows, key=lambda r: r[size]):
        if group and r[size] > (1 + tol) * group[0][size]:
            out.append(group)
            group = []
        group.append(r)
    if group:
        out.append(group)
    return [sorted(g, key=lambda r: r["ppl"]) for g in out if len({r["family"] for r in g}) >= 2]


def size_facts(rows: list[dict], dense_size: float, size: str = "total_params", near: float = 0.95) -> dict:
    """What the nominal keep hides: ``at_dense`` the rows holding at least ``near`` x the dense size (their keep
    saves little or nothing), and ``rising`` the families whose perplexity FALLS as they hold fewer parameters
    (``(family, larger row, smaller row)``: a smaller model that is better, which needs a remark)."""
    at_dense = [r for r in rows if r[size] >= near * dense_size]
    rising = []
    for fam in sorted({r["family"] for r in rows}):
        pts = sorted((r for r in rows if r["family"] == fam), key=lambda r: r[size], reverse=True)
        rising += [(fam, a, b) for a, b in zip(pts, pts[1:]) if b[size] < a[size] and b["ppl"] < a["ppl"]]
    return {"at_dense": at_dense, "rising": rising}
