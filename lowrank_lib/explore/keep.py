"""Notebook 00's keep slider: SVD-LLM v1 at any keep ratio, one perplexity and one answer per keep, cached.

The compressed model at a keep comes from :class:`lowrank_lib.compress.whitened.WhitenedSpectra`
(one whitened SVD per matrix, computed once; each keep is a slice), so a slider step costs one deep
copy, one perplexity window and one short greedy answer. Every value the slider has shown is kept in
``KeepExplorer.results``: going back to it is free.
"""
from __future__ import annotations

import gc
import sys
import time
import traceback

import torch

from ..compress.whitened import WhitenedSpectra
from ..eval.perplexity import perplexity
from ..factorized import account
from ..generation import answer
from .ui import in_kernel_with_widgets


class KeepExplorer:
    """Perplexity on ``window`` (1-D token ids, one window) and the answer to ``question`` at each keep."""

    def __init__(self, model, tok, spectra: WhitenedSpectra, window: torch.Tensor, question: str,
                 max_new_tokens: int = 24):
        if window.dim() != 1:
            raise ValueError(f"window must be 1-D token ids, got shape {tuple(window.shape)}")
        self.model, self.tok, self.spectra = model, tok, spectra
        self.window, self.question, self.max_new_tokens = window, question, max_new_tokens
        self.results: dict[float, dict] = {}
        self._dense: dict | None = None

    def _measure(self, m) -> dict:
        t0 = time.perf_counter()
        ppl = perplexity(m, self.window, seq_len=self.window.numel(), progress=False).ppl
        text = answer(m, self.tok, self.question, max_new_tokens=self.max_new_tokens)
        acc = account(m)
        return {"ppl": ppl, "answer": text, "params": acc.total_params, "linear_keep": acc.linear_keep,
                "seconds": time.perf_counter() - t0}

    def dense(self) -> dict:
        """The dense model's row (computed once)."""
        if self._dense is None:
            self._dense = {"keep": 1.0, "method": "dense", **self._measure(self.model)}
        return self._dense

    @staticmethod
    def key(keep: float) -> float:
        return round(float(keep), 4)

    def result(self, keep: float) -> dict:
        """``{keep, method, ppl, answer, params, linear_keep, seconds, cached}`` at ``keep`` (cached per value)."""
        k = self.key(keep)
        if k in self.results:
            return {**self.results[k], "cached": True}
        t0 = time.perf_counter()
        m = self.spectra.compress(self.model, k)
        row = {"keep": k, "method": "svdllm", **self._measure(m)}
        row["seconds"] = time.perf_counter() - t0
        del m
        gc.collect()
        self.results[k] = row
        return {**row, "cached": False}

    def describe(self, row: dict) -> str:
        """Three lines: the numbers at this keep next to dense, the answer, the keeps computed so far."""
        d = self.dense()
        how = "cached" if row.get("cached") else f"computed in {row['seconds']:.1f} s"
        done = ", ".join(f"{k:.2f}" for k in sorted(self.results))
        return (f"keep {row['keep']:.2f} (SVD-LLM v1): {row['params'] / 1e6:.1f} M parameters "
                f"({row['params'] / d['params']:.0%} of dense), perplexity {row['ppl']:.2f} on "
                f"{self.window.numel()} WikiText-2 tokens (dense {d['ppl']:.2f}); {how}\n"
                f"answer: {row['answer']}\n"
                f"keeps computed so far: {done}")

    def draw(self, ax, current: float | None = None):
        """Perplexity of every keep computed so far; the current one highlighted; dense as a line."""
        rows = sorted(self.results.values(), key=lambda r: r["keep"])
        ax.plot([r["keep"] for r in rows], [r["ppl"] for r in rows], "o-", color="tab:blue", ms=4,
                label="SVD-LLM v1 (keeps visited)")
        if current is not None and self.key(current) in self.results:
            r = self.results[self.key(current)]
            ax.plot([r["keep"]], [r["ppl"]], "o", color="tab:orange", ms=9, label=f"keep {r['keep']:.2f}")
        ax.axhline(self.dense()["ppl"], color="k", ls="--", label="dense")
        ax.set(xlabel="canonical keep ratio", ylabel="perplexity (one window)", yscale="log")
        ax.legend(fontsize=8)

    def widget(self, value: float, lo: float = 0.4, hi: float = 1.0, step: float = 0.05):
        """Display a keep slider (``continuous_update=False``: a drag computes only where it is released)
        with the numbers, the answer and the perplexity plot; returns it. None outside a kernel."""
        if not in_kernel_with_widgets():
            return None
        import ipywidgets as W
        import matplotlib.pyplot as plt
        from IPython.display import clear_output, display

        slider = W.FloatSlider(value=value, min=lo, max=hi, step=step, description="keep",
                               continuous_update=False, readout_format=".2f")
        status = W.Label("")
        out = W.Output()

        def render(keep):
            status.value = f"computing keep {keep:.2f} ..."
            try:
                row = self.result(keep)
                with out:
                    clear_output(wait=True)
                    print(self.describe(row))
                    fig, ax = plt.subplots(figsize=(6, 3))
                    self.draw(ax, keep)
                    plt.show()
            except Exception:                  # a callback's exception would only reach the browser's log
                with out:
                    clear_output(wait=True)
                    traceback.print_exc(file=sys.stdout)
            finally:
                status.value = ""

        slider.observe(lambda ch: render(ch["new"]), names="value")
        ui = W.VBox([W.HBox([slider, status]), out])
        ui.slider = slider
        display(ui)
        render(value)
        return ui
