"""The notebooks' figure check: it catches what a reader could not read, and passes a clean figure."""
import struct

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from lowrank_lib import figures  # noqa: E402


@pytest.fixture(autouse=True)
def _close():
    yield
    plt.close("all")


def _clean():
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([1, 2, 3], [3, 1, 2], label="a line")
    ax.set(xlabel="x", ylabel="y", title="a readable figure")
    ax.legend(fontsize=9)
    ax.annotate("peak", (1, 3), fontsize=9)
    ax.annotate("dip", (2, 1), fontsize=9)
    fig.tight_layout()
    return fig


def test_a_clean_figure_passes_and_is_shown_at_its_true_size():
    fig = _clean()
    r = figures.render(fig)
    assert figures.check(fig, r) == []
    w, h = struct.unpack(">II", r.png[16:24])
    assert (w, h) == (r.width_px, r.height_px)
    # 6 in at 144 dpi (tight bbox trims a little) is shown at about 6 * 96 CSS px
    assert abs(r.display_width - 6 * 96) < 40 and r.scale == 1.0


def test_too_wide_is_flagged_and_shrinks_every_text():
    fig, ax = plt.subplots(figsize=(24, 3))
    ax.plot([0, 1])
    problems = figures.check(fig)
    assert any("px wide as displayed" in p for p in problems), problems
    # 10-pt ticks shrunk to about 1000 / 1900: below 8 pt as displayed
    assert any("pt as displayed" in p for p in problems), problems


def test_small_text_is_flagged():
    fig = _clean()
    fig.axes[0].set_xlabel("tiny", fontsize=6)
    problems = figures.check(fig)
    assert any("at 6 pt" in p and "tiny" in p for p in problems), problems


def test_overlapping_tick_labels_are_flagged():
    fig, ax = plt.subplots(figsize=(3, 2.5))
    ax.bar(range(20), range(20))
    ax.set_xticks(range(20), [f"label number {i}" for i in range(20)])
    problems = figures.check(fig)
    assert any("x tick labels" in p and "overlap" in p for p in problems), problems


def test_overlapping_annotations_are_flagged():
    import numpy as np

    fig, ax = plt.subplots(figsize=(3, 3))
    m = np.arange(30 * 4).reshape(30, 4)
    ax.imshow(m, aspect="auto")
    for i in range(30):
        for j in range(4):
            ax.text(j, i, f"{m[i, j]}", ha="center", va="center", fontsize=9)
    problems = figures.check(fig)
    assert any("annotations overlap" in p for p in problems), problems


def test_overlapping_titles_are_flagged():
    fig, axes = plt.subplots(1, 2, figsize=(6, 3))
    axes[0].set_title("a very long title that runs into the neighbouring panel's title")
    axes[1].set_title("the second panel's title")
    problems = figures.check(fig)
    assert any(p.startswith("titles") for p in problems), problems


def test_save_raises_in_error_mode_warns_in_warn_mode(tmp_path, monkeypatch):
    fig = _clean()
    fig.axes[0].set_title("tiny title", fontsize=5)
    monkeypatch.setenv(figures.CHECK_ENV, "error")
    with pytest.raises(figures.FigureCheckError, match=r"'x'.*\n.*tiny title"):
        figures.save(fig, tmp_path / "x.png", name="x")
    assert not (tmp_path / "x.png").exists()
    monkeypatch.setenv(figures.CHECK_ENV, "warn")
    with pytest.warns(UserWarning, match="tiny title"):
        figures.save(fig, tmp_path / "x.png")
    assert (tmp_path / "x.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    monkeypatch.setenv(figures.CHECK_ENV, "off")
    figures.save(fig, tmp_path / "y.png")
    monkeypatch.setenv(figures.CHECK_ENV, "loud")
    with pytest.raises(ValueError, match="error, warn or off"):
        figures.mode()


def test_rotated_labels_are_tested_as_rotated_rectangles():
    """Slanted tick labels whose extents overlap but whose strips are apart pass; crowded ones still fail."""
    fig, ax = plt.subplots(figsize=(6.5, 3.4))
    types = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    ax.bar(types, range(7))
    plt.setp(ax.get_xticklabels(), rotation=30, ha="right")
    fig.tight_layout()
    assert figures.check(fig) == []
    fig2, ax2 = plt.subplots(figsize=(2.5, 3))
    ax2.bar(range(12), range(12))
    ax2.set_xticks(range(12), [f"a long label {i}" for i in range(12)], rotation=30, ha="right")
    assert any("x tick labels" in p for p in figures.check(fig2))


def test_plain_log_ticks_keep_a_narrow_log_range_readable():
    """A log axis over 0.65-0.72 (ratios near 1 on a user's model): matplotlib's default minor labels
    ("7×10⁻¹" for each of 0.66, 0.67, ...) overlap and repeat; plain_log_ticks labels them 0.66, 0.67, ... once each,
    and the check passes."""
    import matplotlib.pyplot as plt
    import numpy as np

    from lowrank_lib.figures import check, plain_log_ticks

    def draw(fix):
        fig, axes = plt.subplots(1, 2, figsize=(10, 4))
        for ax in axes:
            x = np.linspace(0.65, 0.72, 40)
            ax.scatter(x, x[::-1], s=5)
            ax.set(xscale="log", yscale="log", title="output error at r = 32, every head (colour = layer)")
            if fix:
                plain_log_ticks(ax)
        fig.tight_layout()
        return fig, axes

    fig, _ = draw(False)
    assert check(fig), "matplotlib's default labels no longer overlap here: the test lost its point"
    plt.close(fig)
    fig, axes = draw(True)
    fig.canvas.draw()
    labels = [t.get_text() for t in axes[0].get_xticklabels(minor=True) if t.get_text()]
    assert check(fig) == [] and "0.7" in labels and len(labels) == len(set(labels))
    plt.close(fig)
