"""The frontier figure: one panel per prefill, one line per policy with every budget's point, clear errors."""
import pytest

pytest.importorskip("matplotlib")

from lowrank_lib.eval.frontier_plot import plot_frontier, prefills  # noqa: E402


def _res():
    rows = []
    for P, pols in ((2048, {"kvzip": "eviction", "attsvd-ext": "lowrank", "composed-kvzip-q8": "composed"}),
                    (4096, {"kvzip": "eviction", "composed-kvzip-q8": "composed"})):
        for pol, kind in pols.items():
            for b in (0.5, 0.25, 0.125):
                rows.append(dict(policy=pol, kind=kind, prefill=P, budget=b, bytes_ratio=b, kl_mean=0.1 * b,
                                 kl_std=0.01, windows=8 if P == 2048 else 4))
    return {"rows": rows, "args": {"model_name": "smollm2"}}


def test_one_panel_per_prefill_and_a_line_per_policy():
    import matplotlib

    matplotlib.use("Agg")
    res = _res()
    assert prefills(res) == [2048, 4096]
    fig = plot_frontier(res)
    axes = fig.axes
    assert len(axes) == 2
    assert "prefill 2048, 8 windows" in axes[0].get_title() and "prefill 4096, 4 windows" in axes[1].get_title()
    labels = [t.get_text() for t in fig.legends[0].get_texts()]   # one legend: every policy of every panel
    assert labels == ["kvzip (eviction)", "attsvd-ext (lowrank)", "composed-kvzip-q8 (composed)"]
    assert [t.get_text() for t in axes[0].get_xticklabels()] == ["0.125", "0.25", "0.5"]
    # every budget's point is drawn: the data line of a policy has the three bytes ratios
    xs = [tuple(c.lines[0].get_xdata()) for c in axes[0].containers]
    assert xs == [(0.125, 0.25, 0.5)] * 3
    assert axes[0].get_xscale() == "log" and axes[0].get_yscale() == "log"
    only = plot_frontier(res, [4096])
    assert len(only.axes) == 1


def test_a_missing_prefill_is_refused_by_name():
    with pytest.raises(ValueError, match="8192"):
        plot_frontier(_res(), [8192])
