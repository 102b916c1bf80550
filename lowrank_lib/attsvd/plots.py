"""Matplotlib views of the interpretability quantities (used by notebook 04).

matplotlib is an optional extra (``notebooks``): it is imported when a function draws, never when this
module or the package is imported.
"""
from __future__ import annotations

from .interpret import HeadView, attention_rows, error_curves


def _plt():
    try:
        import matplotlib.pyplot as plt
    except ImportError as e:  # pragma: no cover - depends on the installed extras
        raise ImportError("lowrank_lib.attsvd.plots draws with matplotlib: pip install 'lowrank_lib[notebooks]'") from e
    return plt


def head_panel(h: HeadView, rank: int, ranks: list[int], axes=None, curves: dict | None = None):
    """Two panels for one head at rank r: (a) logit / output error vs rank, aware vs raw, with r marked;
    (b) the last query's attention distribution with dense, aware and raw rank-r keys."""
    if axes is None:
        _, axes = _plt().subplots(1, 2, figsize=(12, 3.6))
    c = curves or error_curves(h, ranks)
    ax = axes[0]
    ax.semilogy(c["rank"], c["logit_aware"], "b-o", ms=3, label="logit err, attention-aware K")
    ax.semilogy(c["rank"], c["logit_raw"], "r-o", ms=3, label="logit err, raw-SVD K")
    ax.semilogy(c["rank"], c["output_aware"], "b--s", ms=3, label="output err, mass-weighted V")
    ax.semilogy(c["rank"], c["output_raw"], "r--s", ms=3, label="output err, raw-SVD V")
    ax.axvline(rank, color="k", lw=0.8)
    ax.set(xlabel="rank r", ylabel="relative error", title=f"layer {h.layer}, KV head {h.head}")
    ax.legend(fontsize=7)
    rows = attention_rows(h, rank)
    ax = axes[1]
    ax.plot(rows["dense"].numpy(), "k-", lw=1.2, label="dense")
    ax.plot(rows["aware"].numpy(), "b-", lw=0.8, alpha=0.8, label=f"attention-aware r={rank}")
    ax.plot(rows["raw"].numpy(), "r-", lw=0.8, alpha=0.8, label=f"raw SVD r={rank}")
    ax.set(xlabel="key position", ylabel="attention (last query)", yscale="log")
    ax.legend(fontsize=7)
    return axes
