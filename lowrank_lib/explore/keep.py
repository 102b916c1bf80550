"""Notebook 00: a compressed model's answer next to the dense one, and the keep slider over SVD-LLM v1.

:class:`AnswerComparison` generates the dense model's greedy answer once, then for any compressed model
gives its own greedy answer AND how it scores the dense answer, teacher-forced on the same prompt:

    agreement   fraction of the dense answer's tokens that are the compressed model's argmax
    kl          mean over those positions of KL(p_dense || p_compressed) of the next-token distribution

(both 1 / 0 for the dense model itself), so two answers can be compared even when one degenerates into
repetition (:func:`readable` cuts such text after its second repeat).

:class:`KeepExplorer` is the slider: the model at a keep comes from
:class:`lowrank_lib.compress.whitened.WhitenedSpectra` (one whitened SVD per matrix, computed once; each keep
is a slice), so one step costs a copy, one perplexity window, one short answer and one teacher-forced
forward (about a second for SmolLM2 on 2 cores). Every keep computed is kept in ``results``: going back
to it is free. :meth:`KeepExplorer.panel` shows it as a :class:`~lowrank_lib.explore.ui.SliderPanel`.
"""
from __future__ import annotations

import gc
import time

import torch

from ..compress.svd import FactorSpectra
from ..compress.whitened import WhitenedSpectra
from ..eval.perplexity import perplexity
from ..factorized import account
from ..host import physical_memory
from ..tokentext import decode
from .ui import SliderPanel, float_slider, in_kernel_with_widgets


class TourTooLarge(MemoryError):
    """Notebook 00's tour of a dense ``MODEL`` would not fit in this machine's memory (:func:`check_tour_fits`)."""


def tour_footprint(cfg) -> int:
    """Bytes notebook 00's tour holds at once for a dense model of config ``cfg``, all float32: the model, then per
    projection [out, in] two full-rank decompositions of k = min(out, in) components (SVD-LLM v1's whitened factors
    for the slider, plain SVD's for the sweep: u [out, k] and v [k, in] each), the embedding and head once or
    twice (tied or not)."""
    from ..models import proj_shapes

    per_layer = proj_shapes(cfg).values()
    weights = sum(o * i for o, i in per_layer)
    spectra = sum(min(o, i) * (o + i) for o, i in per_layer)
    emb = cfg.vocab_size * cfg.hidden_size * (1 if getattr(cfg, "tie_word_embeddings", False) else 2)
    return 4 * (cfg.num_hidden_layers * (weights + 2 * spectra) + emb)


def check_tour_fits(model: str, memory: int | None = None) -> None:
    """Refuse, before anything is loaded, a tour of a local dense ``MODEL`` directory whose :func:`tour_footprint`
    exceeds ``memory`` (default: this machine's physical memory): a LLaMA-2-7B needs ~100 GiB, and loading it would
    end in the kernel's out-of-memory kill, not an error. SmolLM2 and the tiny presets are not checked (well
    under 1 GB). Raises :class:`TourTooLarge` naming what to do instead."""
    from pathlib import Path

    if not (Path(model) / "config.json").is_file():
        return
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(model, local_files_only=True)
    need, have = tour_footprint(cfg), physical_memory() if memory is None else memory
    if need > have:
        raise TourTooLarge(
            f"the tour of {model} decomposes every projection twice at full rank in float32: about {need / 2**30:.0f} "
            f"GiB, and this machine has {have / 2**30:.0f} GiB. Set CHECKPOINT to a compressed checkpoint of it "
            "(the slider then re-decomposes its factors, the dense model is only the reference), or tour a smaller "
            "MODEL.")


def chat_ids(tok, question: str) -> torch.Tensor:
    """[1, T] prompt ids of one user message in the tokenizer's chat template (plain text without one):
    the prompt :func:`lowrank_lib.generation.answer` builds."""
    if getattr(tok, "chat_template", None):
        enc = tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        return enc["input_ids"]
    return tok(question, return_tensors="pt").input_ids


def readable(text: str, limit: int = 90, max_unit: int = 6) -> str:
    """``text`` on one line, cut after the second occurrence of a phrase (1 to ``max_unit`` words) repeated
    3+ times in a row (a degenerate model's ``France - France - France ...``) and at ``limit`` characters."""
    words = text.split()
    cut = None
    for i in range(len(words)):
        for n in range(1, max_unit + 1):
            unit = words[i:i + n]
            if len(unit) == n and words[i + n:i + 2 * n] == unit and words[i + 2 * n:i + 3 * n] == unit:
                cut = i + 2 * n
                break
        if cut is not None:
            break
    out = " ".join(words[:cut]) + (" … (repeats)" if cut is not None else "")
    if len(out) > limit:
        out = out[:limit - 1].rstrip() + "…"
    return out


class AnswerComparison:
    """The dense answer to ``prompt_ids`` [1, T], and any model's answer + agreement + KL against it."""

    def __init__(self, dense_model, prompt_ids: torch.Tensor, tok=None, max_new_tokens: int = 24):
        if prompt_ids.dim() != 2 or prompt_ids.shape[0] != 1:
            raise ValueError(f"prompt_ids must be [1, T], got shape {tuple(prompt_ids.shape)}")
        self.tok, self.prompt, self.max_new_tokens = tok, prompt_ids, max_new_tokens
        cfg = dense_model.config
        self.pad = (getattr(tok, "pad_token_id", None) or getattr(tok, "eos_token_id", None)
                    or getattr(cfg, "pad_token_id", None) or getattr(cfg, "eos_token_id", None) or 0)
        self.dense_ids = self.generate(dense_model)
        if self.dense_ids.numel() == 0:
            raise ValueError("the dense model answers with no token: nothing to compare with")
        self._dense_logp = self._answer_logprobs(dense_model)

    def text(self, ids: torch.Tensor) -> str:
        return decode(self.tok, ids.tolist()).strip() if self.tok is not None else " ".join(map(str, ids.tolist()))

    @torch.no_grad()
    def generate(self, model) -> torch.Tensor:
        """[n] greedy answer ids of ``model`` (n <= max_new_tokens: generation stops at EOS)."""
        out = model.generate(self.prompt, attention_mask=torch.ones_like(self.prompt), do_sample=False,
                             max_new_tokens=self.max_new_tokens, pad_token_id=self.pad)
        ids = out[0, self.prompt.shape[1]:]
        eos = getattr(model.generation_config, "eos_token_id", None)
        eos = set(eos if isinstance(eos, list) else [eos]) - {None}
        cut = next((i for i, t in enumerate(ids.tolist()) if t in eos), len(ids))
        return ids[:cut]

    @torch.no_grad()
    def _answer_logprobs(self, model) -> torch.Tensor:
        """[n, V] log-probabilities ``model`` gives each dense answer token's position, teacher-forced."""
        T = self.prompt.shape[1]
        ids = torch.cat([self.prompt, self.dense_ids[None]], 1)
        logits = model(ids).logits[0, T - 1: T - 1 + self.dense_ids.numel()]
        return torch.log_softmax(logits.double(), -1)

    def compare(self, model) -> dict:
        """``{answer, answer_ids, agreement, kl}`` of ``model`` against the dense answer: both models scored on the
        dense answer teacher-forced; ``agreement`` the fraction of its positions where their top-1 tokens are equal,
        ``kl`` the mean KL(dense || model) there. (Top-1 against the dense model's own top-1 there, not against the
        generated answer: in bf16 the cached generation and the full forward round differently, and on near-ties, as
        a random-weight 7B model has, the dense model itself agreed with its generated answer at 79 % of positions.)"""
        ids = self.generate(model)
        logp = self._answer_logprobs(model)
        agree = float((logp.argmax(-1) == self._dense_logp.argmax(-1)).double().mean())
        kl = float((self._dense_logp.exp() * (self._dense_logp - logp)).sum(-1).mean().clamp_min(0.0))
        return {"answer": self.text(ids), "answer_ids": ids.tolist(), "agreement": agree, "kl": kl}

    @property
    def dense(self) -> dict:
        return {"answer": self.text(self.dense_ids), "answer_ids": self.dense_ids.tolist(), "agreement": 1.0, "kl": 0.0}


class KeepExplorer:
    """Perplexity on ``window`` (1-D token ids, one window; None without a tokenizer: no perplexity, rather than
    one of random ids) and the answer comparison at each keep.

    ``model``: the reference every keep is compared with (the dense model; ``reference`` names it); ``spectra``
    compresses ``base`` (default: ``model``) at a keep: :class:`WhitenedSpectra` of the dense model, or
    :class:`lowrank_lib.compress.FactorSpectra` of a checkpoint (then ``base`` is the checkpoint and ``model`` its
    dense reference, or the checkpoint itself when there is none). ``spectra.method`` names the method in the rows,
    ``spectra.label`` on screen."""

    def __init__(self, model, spectra: WhitenedSpectra | FactorSpectra, window: torch.Tensor | None,
                 answers: AnswerComparison, base=None, reference: str = "dense"):
        if window is not None and window.dim() != 1:
            raise ValueError(f"window must be 1-D token ids, got shape {tuple(window.shape)}")
        self.model, self.spectra, self.window, self.answers = model, spectra, window, answers
        self.base = model if base is None else base
        self.reference = reference
        self.results: dict[float, dict] = {}
        self._dense: dict | None = None

    def _measure(self, m) -> dict:
        ppl = (None if self.window is None else
               perplexity(m, self.window, seq_len=self.window.numel(), progress=False).ppl)
        acc = account(m)
        return {"ppl": ppl, "params": acc.total_params, "linear_keep": acc.linear_keep}

    def dense(self) -> dict:
        """The dense model's row (computed once)."""
        if self._dense is None:
            self._dense = {"keep": 1.0, "method": self.reference, **self._measure(self.model), **self.answers.dense}
        return self._dense

    @staticmethod
    def key(keep: float) -> float:
        return round(float(keep), 4)

    def result(self, keep: float) -> dict:
        """``{keep, method, ppl, params, linear_keep, answer, agreement, kl, seconds, cached}`` at ``keep``."""
        k = self.key(keep)
        if k in self.results:
            return {**self.results[k], "cached": True}
        t0 = time.perf_counter()
        m = self.spectra.compress(self.base, k, share=True)     # views of the spectra: measured, then dropped
        row = {"keep": k, "method": self.spectra.method, **self._measure(m), **self.answers.compare(m)}
        row["seconds"] = time.perf_counter() - t0
        del m
        gc.collect()
        self.results[k] = row
        return {**row, "cached": False}

    def table(self, row: dict):
        """Dense and the current keep side by side: parameters, window perplexity (only with a tokenizer: no column
        without text), agreement, KL, answer."""
        import pandas as pd

        d = self.dense()
        rows = []
        ref = self.reference
        for r, name in ((d, ref), (row, f"{self.spectra.label}, keep {row['keep']:.2f}")):
            ppl = ({} if self.window is None else
                   {f"perplexity (1 × {self.window.numel()} tokens)": f"{r['ppl']:.2f}"})
            rows.append({"model": name, "parameters (M)": f"{r['params'] / 1e6:.1f} ({r['params'] / d['params']:.0%})",
                         **ppl, f"agreement with {ref} answer": f"{r['agreement']:.0%}",
                         f"KL to {ref} / token": f"{r['kl']:.3f}", "greedy answer": readable(r["answer"])})
        return pd.DataFrame(rows).set_index("model")

    def describe(self, row: dict) -> str:
        """One line: the numbers at this keep next to dense, and how they were obtained."""
        d = self.dense()
        how = "cached" if row.get("cached") else f"computed in {row['seconds']:.1f} s"
        ref = self.reference
        return (f"keep {row['keep']:.2f} ({self.spectra.label}): {row['params'] / 1e6:.1f} M parameters "
                f"({row['params'] / d['params']:.0%} of {ref}), "
                + (f"perplexity {row['ppl']:.2f} on {self.window.numel()} tokens ({ref} {d['ppl']:.2f}), "
                   if row["ppl"] is not None else "")
                + f"answer agreement {row['agreement']:.0%}, "
                f"KL {row['kl']:.3f}; {how}")

    def draw(self, axes, current: float | None = None):
        """(a) perplexity (without a tokenizer: the KL to the reference answer) and (b) answer agreement of every
        keep computed so far; the current one highlighted."""
        d = self.dense()
        rows = sorted(self.results.values(), key=lambda r: r["keep"])
        ks = [r["keep"] for r in rows]
        cur = self.results.get(self.key(current)) if current is not None else None
        first = ((axes[0], "ppl", f"perplexity (1 × {self.window.numel()} tokens)", d["ppl"])
                 if self.window is not None else (axes[0], "kl", f"KL to {self.reference} answer / token", 0.0))
        for ax, key, label, ref in (first, (axes[1], "agreement", f"agreement with {self.reference} answer", 1.0)):
            ax.plot(ks, [r[key] for r in rows], "o-", color="tab:blue", ms=4, label="keeps visited")
            if cur is not None:
                ax.plot([cur["keep"]], [cur[key]], "o", color="tab:orange", ms=9, label=f"keep {cur['keep']:.2f}")
            ax.axhline(ref, color="k", ls="--", lw=1, label=f"{self.reference} ({ref:.3g})")
            ax.set(xlabel=f"keep ratio ({self.spectra.label})", ylabel=label)
            ax.legend(fontsize=9)
        axes[0].set_yscale("log" if self.window is not None else "linear")
        axes[1].set_ylim(-0.05, 1.05)

    def panel(self, value: float, lo: float = 0.4, hi: float = 1.0, step: float = 0.05):
        """Show the keep slider (a drag computes only where it is released) with, as ordinary output, the
        plot of every keep visited and the dense-vs-compressed table; returns the panel (None outside a kernel)."""
        if not in_kernel_with_widgets():
            return None
        import matplotlib.pyplot as plt
        from IPython.display import Markdown

        from ..figures import as_image

        def render(keep):
            row = self.result(keep)
            fig, axes = plt.subplots(1, 2, figsize=(9.5, 3.2))
            self.draw(axes, keep)
            fig.tight_layout()
            return [Markdown(self.describe(row)), as_image(fig, name="00 keep slider"), self.table(row)]

        return SliderPanel({"keep": float_slider(value, lo, hi, step, "keep")}, render, 3,
                           describe=lambda keep: f"keep {keep:.2f}").show()
