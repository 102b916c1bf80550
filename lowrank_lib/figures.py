"""Figures the notebooks show: saved once, displayed at a known size, and checked for readability.

A figure is rendered ONCE to PNG at :data:`DPI`; that file is what ``figures/`` holds and what the notebook
shows, at ``96 / DPI`` of its pixel size (one CSS pixel per 1/96 inch, so a text of ``f`` pt in matplotlib is
``f`` pt on the screen). :func:`check` then asks what a reader would see:

* **width**: the displayed width must fit the notebook's output area, :data:`NOTEBOOK_WIDTH_PX` CSS pixels
  (JupyterLab's output area in a 1500-px window with the file browser open is 1068 px wide; a wider image is
  scaled down, and everything in it shrinks);
* **text size**: every visible text (ticks, labels, legends, annotations, titles) at least :data:`MIN_PT` pt
  as displayed (its size times the down-scaling of a too-wide figure);
* **overlaps**: neighbouring tick labels of one axis, the annotations of one axes (``ax.texts``: heatmap
  cells, labels drawn with ``annotate``), and the titles of all panels and the figure must not overlap.

``check`` returns the problems as sentences naming the axes and the texts; :func:`save` raises
:class:`FigureCheckError` with all of them when :func:`mode` is ``"error"`` (the report runner and the tests
set it: a figure nobody can read fails the run), warns under ``"warn"`` (the default in an interactive
kernel) and skips the check under ``"off"``. matplotlib is imported by the functions that draw, never by
this module (it is the ``notebooks`` extra).
"""
from __future__ import annotations

import io
import os
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path

#: resolution of every saved and shown PNG (1.5 device pixels per CSS pixel: sharp on most screens)
DPI = 144
#: CSS pixels a notebook shows a figure in without scaling it down (JupyterLab, 1500-px window, file browser open)
NOTEBOOK_WIDTH_PX = 1000
#: the smallest text size a reader must be able to read, in points as displayed
MIN_PT = 8.0
#: environment variable choosing what a failed check does: error | warn | off
CHECK_ENV = "LOWRANK_LIB_FIGURE_CHECK"


def wrapped(text: str, width: int = 44) -> str:
    """``text`` in lines of at most ``width`` characters, broken at spaces, and a word longer than a line (a
    checkpoint's file name) after a ``_``, ``-`` or ``.`` where it can be: a title that names the user's model stays
    inside its panel. A text that fits is returned as it is."""
    import re

    pieces = []                                   # (piece, glued to the previous one)
    for w in text.split():
        glued = False
        while len(w) > width:
            cut = max((m.end() for m in re.finditer(r"[_\-.]", w[:width])), default=width)
            pieces.append((w[:cut], glued))
            w, glued = w[cut:], True
        pieces.append((w, glued))
    lines = [""]
    for piece, glued in pieces:
        joined = lines[-1] + ("" if glued or not lines[-1] else " ") + piece
        if len(joined) <= width or not lines[-1]:
            lines[-1] = joined
        else:
            lines.append(piece)
    return "\n".join(lines)


def plain_log_ticks(ax, axis: str = "both") -> None:
    """Tick labels of a log axis as plain numbers ("0.7", not "7×10⁻¹"), the minor ones labelled only where the
    axis spans less than about two decades: a narrow log range (a ratio near 1 on a user's model) otherwise gets
    long overlapping minor labels, which :func:`check` refuses."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x, vmin, vmax):
            return f"{x:.3g}"

    for a in ([ax.xaxis, ax.yaxis] if axis == "both" else [ax.xaxis] if axis == "x" else [ax.yaxis]):
        a.set_major_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))
        a.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(2, 0.5)))


class FigureCheckError(ValueError):
    """A figure fails :func:`check`; ``problems`` lists why."""

    def __init__(self, name: str, problems: list[str]):
        self.problems = problems
        super().__init__(f"figure {name!r} is not readable as displayed:\n  " + "\n  ".join(problems)
                         + f"\n(set {CHECK_ENV}=warn to draw it anyway)")


def mode() -> str:
    """``error`` / ``warn`` / ``off`` from :data:`CHECK_ENV` (default ``warn``)."""
    m = os.environ.get(CHECK_ENV, "warn").strip().lower()
    if m not in ("error", "warn", "off"):
        raise ValueError(f"{CHECK_ENV}={m!r}: expected error, warn or off")
    return m


@dataclass
class Rendered:
    """One figure as PNG bytes, its size in device pixels and the size a notebook displays it at."""

    png: bytes
    width_px: int
    height_px: int

    @property
    def display_width(self) -> int:
        """CSS pixels (1/96 in) at the figure's true size."""
        return round(self.width_px * 96 / DPI)

    @property
    def scale(self) -> float:
        """How much a notebook shrinks it (1 when it fits the output area)."""
        return min(1.0, NOTEBOOK_WIDTH_PX / max(1, self.display_width))


def render(fig) -> Rendered:
    """The figure as PNG at :data:`DPI` (tight bounding box, the layout the notebook shows)."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI, bbox_inches="tight")
    png = buf.getvalue()
    w, h = struct.unpack(">II", png[16:24])        # the IHDR chunk: width, height
    return Rendered(png, w, h)


def _texts(fig):
    from matplotlib.text import Text

    for t in fig.findobj(Text):
        if t.get_visible() and t.get_text().strip() and t.get_alpha() != 0:
            yield t


def _box(t, renderer):
    """The text's ORIENTED box in display pixels: (centre x, centre y, width, height, angle in radians).

    The axis-aligned extent of a rotated text is far larger than its glyphs (two tick labels rotated by 30
    degrees have overlapping extents while their slanted strips are apart), so overlaps are tested on the
    rotated rectangle: its centre is the centre of the rotated extent, its size the unrotated extent's."""
    import math

    rot = t.get_rotation()
    ext = t.get_window_extent(renderer)
    if rot % 90 == 0:
        return ((ext.x0 + ext.x1) / 2, (ext.y0 + ext.y1) / 2, ext.width, ext.height, 0.0)
    t.set_rotation(0)
    flat = t.get_window_extent(renderer)
    t.set_rotation(rot)
    return ((ext.x0 + ext.x1) / 2, (ext.y0 + ext.y1) / 2, flat.width, flat.height, math.radians(rot))


def _overlap(a, b, tol: float = 1.0) -> bool:
    """Whether two oriented boxes (:func:`_box`) overlap by more than ``tol`` pixels along every separating
    axis (the separating-axis test for two rectangles)."""
    import math

    def corners(bx):
        cx, cy, w, h, th = bx
        c, s = math.cos(th), math.sin(th)
        return [(cx + dx * c - dy * s, cy + dx * s + dy * c) for dx, dy in
                ((-w / 2, -h / 2), (w / 2, -h / 2), (w / 2, h / 2), (-w / 2, h / 2))]

    pa, pb = corners(a), corners(b)
    for th in (a[4], a[4] + math.pi / 2, b[4], b[4] + math.pi / 2):
        ax, ay = math.cos(th), math.sin(th)
        ra = [x * ax + y * ay for x, y in pa]
        rb = [x * ax + y * ay for x, y in pb]
        if min(max(ra), max(rb)) - max(min(ra), min(rb)) <= tol:
            return False
    return True


def _ax_name(fig, ax) -> str:
    i = fig.axes.index(ax)
    title = ax.get_title() or ax.get_label()
    return f"axes {i}" + (f" ({title[:40]!r})" if title and not title.startswith("<") else "")


def _tick_labels(ax, axis, renderer):
    """Visible, non-empty tick labels of ``axis`` inside the view, with their display boxes, in axis order."""
    lo, hi = sorted(axis.get_view_interval())
    out = []
    for tick in [*axis.get_major_ticks(), *axis.get_minor_ticks()]:
        for lab in (tick.label1, tick.label2):
            if not (lab.get_visible() and lab.get_text().strip()):
                continue
            loc = tick.get_loc()
            if loc is None or not (lo - 1e-9 * abs(hi - lo) <= loc <= hi + 1e-9 * abs(hi - lo)):
                continue
            out.append((loc, lab, _box(lab, renderer)))
    return sorted(out, key=lambda t: t[0])


def check(fig, rendered: Rendered | None = None) -> list[str]:
    """Every readability problem of ``fig`` as displayed in a notebook (see the module docstring); [] if none."""
    rendered = rendered or render(fig)
    problems = []
    if rendered.display_width > NOTEBOOK_WIDTH_PX:
        problems.append(f"{rendered.display_width} px wide as displayed (at most {NOTEBOOK_WIDTH_PX}: the notebook "
                        f"would shrink it to {rendered.scale:.0%}); make figsize narrower than "
                        f"{NOTEBOOK_WIDTH_PX / 96:.1f} in including legends")
    fig.canvas.draw()                               # the layout of the render above (same size, same fonts)
    renderer = fig.canvas.get_renderer()
    small = {}
    for t in _texts(fig):
        shown = t.get_fontsize() * rendered.scale
        if shown < MIN_PT - 1e-6:
            small.setdefault(round(shown, 1), []).append(t.get_text()[:30])
    for pt, names in sorted(small.items()):
        problems.append(f"{len(names)} text(s) at {pt:g} pt as displayed (at least {MIN_PT:g}): {names[:4]}")
    for ax in fig.axes:
        if not ax.get_visible():
            continue
        for which, axis in (("x", ax.xaxis), ("y", ax.yaxis)):
            labels = _tick_labels(ax, axis, renderer)
            for (_, a, ba), (_, b, bb) in zip(labels, labels[1:]):
                if _overlap(ba, bb):
                    problems.append(f"{_ax_name(fig, ax)}: {which} tick labels {a.get_text()!r} and {b.get_text()!r} "
                                    f"overlap (fewer ticks, a smaller font of at least {MIN_PT:g} pt, rotation or a "
                                    f"larger figure)")
                    break
        notes = [(t, _box(t, renderer)) for t in ax.texts if t.get_visible() and t.get_text().strip()]
        clash = [(a, b) for i, (a, ba) in enumerate(notes) for b, bb in notes[i + 1:] if _overlap(ba, bb)]
        if clash:
            a, b = clash[0]
            problems.append(f"{_ax_name(fig, ax)}: {len(clash)} pair(s) of annotations overlap, e.g. "
                            f"{a.get_text()!r} and {b.get_text()!r}")
    titles = [t for t in [*(ax.title for ax in fig.axes if ax.get_visible()),
                          *(ax._left_title for ax in fig.axes if ax.get_visible()),
                          *(ax._right_title for ax in fig.axes if ax.get_visible()), *fig.texts]
              if t.get_visible() and t.get_text().strip()]
    boxes = [(t, _box(t, renderer)) for t in titles]
    for i, (a, ba) in enumerate(boxes):
        for b, bb in boxes[i + 1:]:
            if _overlap(ba, bb):
                problems.append(f"titles {a.get_text()[:40]!r} and {b.get_text()[:40]!r} overlap")
    return problems


def save(fig, path: str | Path | None = None, name: str | None = None) -> Rendered:
    """Render ``fig`` (:func:`render`), check it (:func:`check`, as :func:`mode` says), write it to ``path``
    when given; returns the rendering (what :func:`image` shows)."""
    r = render(fig)
    m = mode()
    if m != "off":
        problems = check(fig, r)
        if problems:
            err = FigureCheckError(name or (Path(path).stem if path else "figure"), problems)
            if m == "error":
                raise err
            warnings.warn(str(err), stacklevel=2)
    if path is not None:
        Path(path).write_bytes(r.png)
    return r


def image(r: Rendered):
    """An IPython image of the rendering, displayed at its true size (``display_width`` CSS pixels)."""
    from IPython.display import Image

    return Image(data=r.png, format="png", width=r.display_width)


def as_image(fig, path: str | Path | None = None, name: str | None = None):
    """:func:`save` ``fig`` (checked; written to ``path`` when given), close it, and return it as an IPython
    image at its true size: what a slider panel's view shows (matplotlib's inline copy never appears)."""
    import matplotlib.pyplot as plt

    try:
        return image(save(fig, path, name))
    finally:
        plt.close(fig)


def show(fig, path: str | Path | None = None, name: str | None = None):
    """:func:`as_image`, displayed as a new output of the running cell."""
    from IPython.display import display

    display(as_image(fig, path, name))
