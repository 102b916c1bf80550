"""The KV-memory frontier figure: KL(dense || cache) per token vs bytes really held, log-log, one panel per
prefill length of a ``python -m lowrank_lib.bench kv-frontier`` result (:func:`~lowrank_lib.eval.kv_sweep.kv_frontier`).

    fig = plot_frontier(json.loads(Path("benchmarks/results/kv_frontier.json").read_text()))

matplotlib is an optional extra (``notebooks``): imported when a figure is drawn, never at import time.
"""
from __future__ import annotations

#: marker / line style per policy kind
STYLE = {"eviction": ":^", "lowrank": "--o", "composed": "-s"}
_ORDER = {"eviction": 0, "lowrank": 1, "composed": 2}


def prefills(res: dict) -> list[int]:
    """The prefill lengths a frontier result holds rows for, ascending."""
    return sorted({r["prefill"] for r in res["rows"]})


def draw_panel(ax, rows: list[dict], title: str, colours: dict) -> None:
    """One prefill's rows: a line per policy (mean KL +- std over its windows) against bytes held."""
    kinds = {r["policy"]: r["kind"] for r in rows}
    for pol in sorted(kinds, key=lambda p: (_ORDER[kinds[p]], p)):
        pts = sorted((r["bytes_ratio"], r["kl_mean"], r["kl_std"]) for r in rows if r["policy"] == pol)
        x, y, e = zip(*pts)
        ax.errorbar(x, y, yerr=e, fmt=STYLE[kinds[pol]], capsize=2, ms=5, color=colours[pol],
                    label=f"{pol} ({kinds[pol]})", lw=2 if kinds[pol] == "composed" else 1)
    ax.set(xscale="log", yscale="log", xlabel="bytes held / dense KV bytes (log)", title=title)
    budgets = sorted({r["budget"] for r in rows})
    ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
    ax.set_xticks([], minor=True)


def plot_frontier(res: dict, which: list[int] | None = None, panel_size=(9.0, 4.0)):
    """A figure with one panel per prefill in ``which`` (default: every prefill of ``res``), stacked, and ONE
    legend under them for every policy of every panel (the same colour in every panel). The width is one
    panel's, so the figure fits a notebook (:mod:`lowrank_lib.figures`). Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    which = which or prefills(res)
    missing = [P for P in which if P not in prefills(res)]
    if missing:
        raise ValueError(f"plot_frontier: no rows for prefill {missing}; the result has {prefills(res)}")
    policies = sorted({r["policy"] for r in res["rows"]})
    colours = {p: plt.cm.tab20(i % 20) for i, p in enumerate(policies)}
    n_leg_rows = -(-len(policies) // 3)
    fig, axes = plt.subplots(len(which), 1, figsize=(panel_size[0], panel_size[1] * len(which) + 0.3 * n_leg_rows + 0.6),
                             squeeze=False)
    for ax, P in zip(axes[:, 0], which):
        rows = [r for r in res["rows"] if r["prefill"] == P]
        n_win = max(r["windows"] for r in rows)
        draw_panel(ax, rows, f"prefill {P}, {n_win} window{'s' if n_win > 1 else ''} (mean ± std)", colours)
        ax.set_ylabel("KL(dense || cache) per token (log)")
    handles: dict = {}                   # one legend for every policy of every panel, under the panels
    for ax in axes[:, 0]:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.suptitle("KV-memory frontier (SmolLM2, WikiText-2 test, seed 0)" if res.get("args", {}).get(
        "model_name") == "smollm2" else "KV-memory frontier")
    fig.tight_layout()
    fig.legend(handles.values(), handles.keys(), fontsize=9, loc="upper center", ncol=3,
               bbox_to_anchor=(0.5, 0.0), frameon=False)
    return fig
