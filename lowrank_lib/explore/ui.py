"""The notebooks' slider panels: controls, a status line, and a view that is ordinary cell output.

A :class:`SliderPanel` shows its sliders (wide tracks: one step of a drag is one slider step) with a status
line, and writes its view (a figure, a table, a line of text: whatever ``render`` returns) as plain
``display_data`` outputs under them, each through an IPython display handle that every slider change
UPDATES in place. The notebook file therefore always holds the last view as ordinary output: a reopened
notebook, a report rendered to HTML without the widget scripts, or a headless papermill run shows the
figure and table of the last slider value without a kernel. The widget state itself is saved with the
notebook too (papermill stores it; JupyterLab does when its ``saveState`` setting is on, see
:func:`lowrank_lib.notebooks.install_lab_settings`).

Headless (papermill) the panel renders its first value and the sliders never move; outside a kernel
:func:`in_kernel_with_widgets` is False and callers print the values instead.
"""
from __future__ import annotations

import sys
import time
import traceback
from typing import Callable


def in_kernel_with_widgets() -> bool:
    """True inside a Jupyter kernel (JupyterLab, papermill) with ipywidgets installed; False in plain Python."""
    try:
        import ipywidgets  # noqa: F401
        from IPython import get_ipython
    except ImportError:
        return False
    ip = get_ipython()
    return ip is not None and hasattr(ip, "kernel")


#: a slider's width and its label's (the track is what remains after the label and the readout: a 64-step
#: rank slider gets about 10 px per step, so a small drag is one step)
TRACK = "800px"
LABEL = "90px"


def int_slider(value: int, lo: int, hi: int, description: str, step: int = 1):
    """A wide integer slider that reports only where a drag is released."""
    import ipywidgets as W

    return W.IntSlider(value=value, min=lo, max=hi, step=step, description=description, continuous_update=False,
                       layout=W.Layout(width=TRACK), style={"description_width": LABEL})


def float_slider(value: float, lo: float, hi: float, step: float, description: str, fmt: str = ".2f"):
    """A wide float slider that reports only where a drag is released."""
    import ipywidgets as W

    return W.FloatSlider(value=value, min=lo, max=hi, step=step, description=description, continuous_update=False,
                         readout_format=fmt, layout=W.Layout(width=TRACK), style={"description_width": LABEL})


class SliderPanel:
    """Sliders + status line + a view of ``n_views`` outputs kept in step with the sliders.

    ``render(**values) -> list`` returns the ``n_views`` objects to show (anything IPython displays: an
    ``Image``, a pandas ``DataFrame`` or its ``Styler``, ``Markdown``, text); each replaces its predecessor
    in place. ``describe(**values) -> str`` names what is being computed (the status line while it runs).
    ``history`` holds ``(values, seconds)`` of every answer, the first render included.
    """

    def __init__(self, sliders: dict, render: Callable[..., list], n_views: int,
                 describe: Callable[..., str] | None = None):
        self.sliders, self.render, self.n_views = sliders, render, n_views
        self.describe = describe or (lambda **v: ", ".join(f"{k} {x}" for k, x in v.items()))
        self.history: list[tuple[dict, float]] = []
        self.handles: list = []
        self.status = None

    @property
    def values(self) -> dict:
        return {k: s.value for k, s in self.sliders.items()}

    def _answer(self, *_):
        from IPython.display import display

        values = self.values
        what = self.describe(**values)
        if self.status is not None:
            self.status.value = f"computing {what} ..."
        t0 = time.perf_counter()
        try:
            views = list(self.render(**values))
            if len(views) != self.n_views:
                raise ValueError(f"render returned {len(views)} views, the panel shows {self.n_views}")
            if not self.handles:
                self.handles = [display(v, display_id=True) for v in views]
            else:
                for h, v in zip(self.handles, views):
                    h.update(v)
            dt = time.perf_counter() - t0
            self.history.append((values, dt))
            if self.status is not None:
                self.status.value = f"showing {what} (answered in {dt:.1f} s)"
        except Exception:                      # a callback's exception would only reach the browser's log
            if self.status is not None:
                self.status.value = f"{what} failed: see below"
            text = traceback.format_exc()
            print(text, file=sys.stdout)
            if self.handles:
                from IPython.display import Pretty

                self.handles[0].update(Pretty(text))
            raise

    def show(self):
        """Display the controls, then the view of the current values (raises if that first render fails)."""
        import ipywidgets as W
        from IPython.display import display

        self.status = W.HTML("", layout=W.Layout(margin="0 0 0 12px"))
        display(W.VBox([*self.sliders.values(), self.status]))
        self._answer()
        for s in self.sliders.values():
            s.observe(self._safe_answer, names="value")
        return self

    def _safe_answer(self, change):
        try:
            self._answer()
        except Exception:                      # shown in the view and the status line; the kernel goes on
            pass
