"""Notebook 04's rank explorer: one head's errors at EVERY rank from one SVD per basis, and its top keys.

For one (layer, KV head) of a recorded prefill, with keys K and values V [S, d], the group's query heads
Q_g [S, d] and their causal attention P_g [S, S],

    logit error    e_K(r) = mean_g ||Q_g (K - K_r)^T||_F / ||Q_g K^T||_F
    output error   e_V(r) = mean_g ||P_g (V - V_r)||_F / ||P_g V||_F

where K_r, V_r are the rank-r truncations AttSVD stores (the same as ``attsvd.interpret.reconstructions``):
raw SVD, or attention-aware (keys: SVD of K W, W = C_Q^{1/2}, mapped back by W^{-1}; values: SVD of
diag(sa) V with sa = sqrt(mass + floor), mapped back by diag(1/sa)). Each basis is ONE decomposition
M = sum_j s_j u_j b_j with orthonormal u_j (keys) or orthonormal b_j (values), so the residual of every
rank is a tail of the same sum and its norm is a suffix sum:

    ||Q_g (K - K_r)^T||^2 = sum_{j >= r} s_j^2 b_j C_g b_j^T          (C_g = Q_g^T Q_g; b_j = vh_j or vh_j W^-1)
    ||P_g (V - V_r)||^2   = sum_{j >= r} s_j^2 ||P_g u'_j||^2          (u'_j = u_j or u_j / sa)

so :class:`HeadRanks` gives both errors at every r in 1..d for the price of one SVD and one P U product per
basis, where sampling ``interpret.error_curves`` at every rank would rebuild K_r and V_r d times.
``tests/test_nb_04.py`` checks the two agree.

The attention panel shows the last query's TOP keys (by dense attention) as grouped bars for dense,
attention-aware and raw rank-r keys, with the total-variation distance of the whole distribution to
dense: three probability curves over a thousand keys overlap into one line; the top keys do not.
"""
from __future__ import annotations

import torch

from ..attention_mass import attention_mass
from ..attsvd.basis import causal_probs, query_metric, sqrt_and_inv_sqrt
from ..attsvd.interpret import HeadView, head_view, top_tokens
from .ui import SliderPanel, in_kernel_with_widgets, int_slider

BASES = ("aware", "raw")
CURVES = ("logit_aware", "logit_raw", "output_aware", "output_raw")
COLORS = {"dense": "0.25", "aware": "tab:blue", "raw": "tab:red"}


def _suffix(t: torch.Tensor) -> torch.Tensor:
    """[G, k] terms -> [G, k + 1] tails: out[:, r] = sum_{j >= r} t[:, j] (out[:, k] = 0)."""
    tail = t.flip(-1).cumsum(-1).flip(-1)
    return torch.cat([tail, tail.new_zeros(t.shape[0], 1)], dim=-1).clamp_min(0)


def split_view(record, layer: int, head: int, prompt_len: int) -> tuple[HeadView, torch.Tensor]:
    """One head of a recorded prompt + continuation, split for a held-out score: the :class:`HeadView` of the
    first ``prompt_len`` tokens only (keys, values, queries and attention mass among them: all a basis is fitted
    on) and the continuation's post-RoPE queries [G, T, d] (tokens the basis never saw). The recording is causal,
    so the prompt's view equals a recording of the prompt alone."""
    full = head_view(record, layer, head)
    S = prompt_len
    if not 0 < S < full.K.shape[0]:
        raise ValueError(f"prompt_len {S} must leave held-out tokens in a recording of {full.K.shape[0]}")
    K, Q = full.K[:S], full.Q[:, :S]
    pos = torch.arange(S, device=K.device)
    mass = attention_mass(Q[None, None], K[None, None], full.scaling, pos, pos)[0, 0]
    return HeadView(layer, head, K, full.V[:S], Q, full.scaling, mass), full.Q[:, S:]


def factor_concentration(h: HeadView, n_factors: int = 4, k: int = 6, which: str = "k") -> list[dict]:
    """How concentrated each leading attention-aware factor (``interpret.top_tokens``) is on a few tokens: per
    factor its ``k`` top positions and energy shares, their total ``top_share`` against ``uniform`` = k / S (every
    token alike), and ``effective_tokens`` = 1 / sum(share^2) (S when spread evenly, 1 on one token)."""
    S = h.K.shape[0]
    out = []
    for row in top_tokens(h, list(range(S)), None, n_factors, S, which):
        shares = torch.tensor([v for _, v in row], dtype=torch.float64)
        out.append({"positions": [int(p) for p, _ in row[:k]], "shares": shares[:k].tolist(),
                    "top_share": float(shares[:k].sum()), "uniform": k / S,
                    "effective_tokens": float(1.0 / shares.pow(2).sum())})
    return out


class HeadRanks:
    """One head's attention-aware and raw truncations at every rank 1..d (float64 inside).

    ``curves``: ``{"rank": [1..d], "logit_aware": [...], "logit_raw": [...], "output_aware": [...],
    "output_raw": [...]}`` (the format of ``interpret.error_curves``). ``eps`` and ``mass_floor`` are
    the query-metric ridge and the mass floor AttSVD and ``interpret`` use.
    """

    def __init__(self, h: HeadView, eps: float = 1e-3, mass_floor: float = 1e-3):
        self.view = h
        K, V, Q = h.K.double(), h.V.double(), h.Q.double()           # [S, d], [S, d], [G, S, d]
        S, d = K.shape
        self.d = d
        W, Wi = (x.double() for x in sqrt_and_inv_sqrt(query_metric(h.Q[None, None], eps=eps)[0, 0]))
        keys = {}
        for basis, M, back in (("aware", K @ W, Wi), ("raw", K, None)):
            U, s, Vh = torch.linalg.svd(M, full_matrices=False)
            keys[basis] = (U * s, Vh if back is None else Vh @ back, s)   # K_r = A[:, :r] @ B[:r]
        a = h.mass.double()
        mean = a.mean()
        sa = (a + mass_floor * mean if float(mean) > 0 else torch.ones_like(a)).clamp_min(1e-300).sqrt()
        vals = {}
        for basis, M, rescale in (("aware", sa[:, None] * V, sa), ("raw", V, None)):
            U, s, Vh = torch.linalg.svd(M, full_matrices=False)
            vals[basis] = (U if rescale is None else U / rescale[:, None], s)
        self._keys, self._vals = keys, vals
        self._q = h.Q[0].double()                                       # the first query head of the group
        self.curves: dict[str, list] = self._curves(Q, causal_probs(h.Q, h.K, h.scaling).double())

    def _curves(self, Q: torch.Tensor, P: torch.Tensor) -> dict[str, list]:
        """Both errors at every rank for queries Q [G, T, d] with attention P [G, T, S] over this head's keys."""
        K, V = self.view.K.double(), self.view.V.double()
        Cg = Q.transpose(-1, -2) @ Q                                    # [G, d, d]
        den_k = torch.einsum("sd,gde,se->g", K, Cg, K).clamp_min(1e-300)
        den_v = (P @ V).pow(2).sum((-2, -1)).clamp_min(1e-300)
        ranks = list(range(1, self.d + 1))
        curves: dict[str, list] = {"rank": ranks}
        for basis in BASES:
            _, B, s = self._keys[basis]
            t_k = s ** 2 * torch.einsum("jd,gde,je->gj", B, Cg, B)       # [G, k]
            U2, s2 = self._vals[basis]
            t_v = s2 ** 2 * (P @ U2).pow(2).sum(-2)                      # [G, k]
            for name, t, den in (("logit", t_k, den_k), ("output", t_v, den_v)):
                tails = _suffix(t)                                       # [G, k + 1]
                k = t.shape[-1]
                idx = torch.tensor([min(r, k) for r in ranks])
                err = (tails[:, idx] / den[:, None]).sqrt().mean(0)
                curves[f"{name}_{basis}"] = [float(e) for e in err]
        return curves

    @torch.no_grad()
    def heldout(self, Q_out: torch.Tensor) -> dict[str, list]:
        """:attr:`curves` scored on queries the bases never saw: ``Q_out`` [G, T, d], post-RoPE queries of tokens
        AFTER this head's keys (:func:`split_view`), each attending to every key of the head (its attention over
        the cached keys, renormalised there). The bases stay the ones fitted on the head's own queries."""
        Q = Q_out.double()
        P = torch.softmax((Q @ self.view.K.double().T) * self.view.scaling, -1)   # [G, T, S]
        return self._curves(Q, P)

    @property
    def layer(self) -> int:
        return self.view.layer

    @property
    def head(self) -> int:
        return self.view.head

    def errors(self, r: int) -> dict[str, float]:
        """The four errors at rank ``r`` (1..d)."""
        if not 1 <= r <= self.d:
            raise ValueError(f"rank {r} outside [1, {self.d}]")
        return {c: self.curves[c][r - 1] for c in CURVES}

    @torch.no_grad()
    def attention_rows(self, r: int, query: int = -1) -> dict[str, torch.Tensor]:
        """Attention of one query (first head of the group) over the keys it sees, with dense, aware and raw
        rank-r keys: ``{"dense", "aware", "raw"}`` -> [S] fp32 (``interpret.attention_rows``'s values)."""
        h = self.view
        S = h.K.shape[0]
        upto = S if query == -1 else query + 1
        q = self._q[query]
        out = {"dense": torch.softmax((h.K.double()[:upto] @ q) * h.scaling, -1).float()}
        for basis in BASES:
            A, B, _ = self._keys[basis]
            out[basis] = torch.softmax((A[:upto, :r] @ (B[:r] @ q)) * h.scaling, -1).float()
        return out

    def top_keys(self, r: int, k: int = 12, query: int = -1) -> dict:
        """The ``k`` keys with the largest dense attention of one query, their probabilities under each
        basis at rank ``r``, and the total-variation distance of each whole distribution to dense."""
        rows = self.attention_rows(r, query)
        top = rows["dense"].topk(min(k, rows["dense"].numel())).indices
        out = {"positions": top.tolist(), **{n: rows[n][top].tolist() for n in rows}}
        for basis in BASES:
            out[f"tv_{basis}"] = float(0.5 * (rows[basis] - rows["dense"]).abs().sum())
        out["top_mass_dense"] = float(rows["dense"][top].sum())
        return out

    def summary(self, r: int, k: int = 12) -> dict:
        """Everything the explorer prints at rank ``r``."""
        top = self.top_keys(r, k)
        return {"layer": self.layer, "head": self.head, "rank": r, **self.errors(r),
                "tv_aware": top["tv_aware"], "tv_raw": top["tv_raw"]}


def format_summary(s: dict) -> str:
    """One line: layer, head, r and the values the panels show."""
    return (f"layer {s['layer']}, KV head {s['head']}, r = {s['rank']}: "
            f"logit error aware {s['logit_aware']:.4f} / raw {s['logit_raw']:.4f}; "
            f"output error aware {s['output_aware']:.4f} / raw {s['output_raw']:.4f}; "
            f"attention TV to dense aware {s['tv_aware']:.4f} / raw {s['tv_raw']:.4f}")


def draw_head(axes, hr: HeadRanks, r: int, labels: list[str] | None = None, k: int = 10) -> dict:
    """Two panels at rank ``r``: (a) logit / output error vs rank, aware vs raw, with the values at r;
    (b) the last query's top-``k`` keys under dense, aware and raw rank-r keys. Returns :meth:`HeadRanks.summary`."""
    import numpy as np

    s = hr.summary(r, k)
    c = hr.curves
    ax = axes[0]
    positive = [v for n in CURVES for v in c[n] if v > 0]
    # the axis floor: a log axis cannot show the exact 0 every basis reaches at full rank (r = d), so the
    # curves end at half the smallest positive error, and the axis label says so
    floor = 0.5 * min(positive) if positive else 1e-7
    for name, style, label in (("logit_aware", "-", "logit, attention-aware K"), ("logit_raw", "-", "logit, raw-SVD K"),
                               ("output_aware", "--", "output, mass-weighted V"), ("output_raw", "--", "output, raw-SVD V")):
        color = COLORS["aware" if name.endswith("aware") else "raw"]
        ax.semilogy(c["rank"], np.maximum(c[name], floor), style, color=color, lw=1.2,
                    label=f"{label}: {s[name]:.3g}")
        ax.plot([r], [max(s[name], floor)], "o", color=color, ms=5)
    ax.axvline(r, color="k", lw=0.8)
    ax.set(xlabel=f"rank r (0 at r = {hr.d} drawn at the floor {floor:.1g})", ylabel="relative error (log)",
           xlim=(1, hr.d), ylim=(floor, None), title=f"layer {hr.layer}, KV head {hr.head}: errors at r = {r}")
    ax.legend(fontsize=8, title=f"value at r = {r}", title_fontsize=8)
    top = hr.top_keys(r, k)
    ax = axes[1]
    x = np.arange(len(top["positions"]))
    w = 0.27
    for i, (name, label) in enumerate((("dense", "dense"), ("aware", f"attention-aware r={r} (TV {top['tv_aware']:.3f})"),
                                       ("raw", f"raw SVD r={r} (TV {top['tv_raw']:.3f})"))):
        ax.bar(x + (i - 1) * w, top[name], w, color=COLORS[name], label=label)
    names = [f"{labels[p][:10]!r} @{p}" if labels is not None else f"@{p}" for p in top["positions"]]
    ax.set_xticks(x, names, fontsize=8, rotation=90)
    ax.set(ylabel="attention of the last query",
           title=f"top {len(x)} keys ({top['top_mass_dense']:.0%} of dense attention)")
    ax.legend(fontsize=8)
    return s


def head_explorer(record, layer: int = 0, head: int = 0, rank: int = 32,
                  labels: list[str] | None = None, k: int = 10):
    """A (layer, KV head, r) :class:`~lowrank_lib.explore.ui.SliderPanel` over :func:`draw_head`; shows it and
    returns it (its view, the summary line and the two panels, is ordinary output kept in step).

    Every (layer, head) is decomposed once (:class:`HeadRanks`, cached in ``panel.cache``), so moving r only
    redraws. Returns None without ipywidgets or outside a kernel (headless callers show static figures).
    """
    if not in_kernel_with_widgets():
        return None
    import matplotlib.pyplot as plt
    from IPython.display import Markdown

    from ..figures import as_image

    L, H, d = len(record.keys), record.keys[0].shape[1], record.keys[0].shape[-1]
    cache: dict[tuple[int, int], HeadRanks] = {}

    def render(layer, head, r):
        if (layer, head) not in cache:
            cache[(layer, head)] = HeadRanks(head_view(record, layer, head))
        fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
        s = draw_head(axes, cache[(layer, head)], r, labels, k)
        fig.tight_layout()
        return [Markdown(format_summary(s)), as_image(fig, name="04 rank explorer")]

    sliders = {"layer": int_slider(layer, 0, L - 1, "layer"), "head": int_slider(head, 0, H - 1, "KV head"),
               "r": int_slider(rank, 1, d, "rank r")}
    panel = SliderPanel(sliders, render, 2, describe=lambda layer, head, r: f"layer {layer}, KV head {head}, r = {r}")
    panel.cache = cache
    return panel.show()
