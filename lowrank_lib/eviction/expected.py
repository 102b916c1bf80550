"""Expected Attention (Devoto, Jeblick, Jégou, 2025, arXiv:2510.00636): score each cached key by the
attention that FUTURE queries are expected to give it, in closed form from the statistics of the queries.

The pre-RoPE queries of the prefill are modelled as Gaussian, ``q ~ N(mu, Sigma)`` (per query head,
statistics over the prefill positions after the first ``sinks``). A future query at position ``t`` is
``R(t) q`` (RoPE is a rotation), so over the next ``n_future`` positions the queries have mean
``mu_bar = R_bar mu`` and covariance ``Sigma_bar = R_bar Sigma R_bar^T`` with ``R_bar`` the average of the
rotations (the paper's approximation: RoPE applied to the query mean and covariance). For a Gaussian
query the expected unnormalised attention has the closed form

    E[exp(s q.k)] = exp(s mu_bar.k + s^2 k^T Sigma_bar k / 2)          (s = the softmax scale)

normalised over the keys (a softmax of the exponent), averaged over the query heads of a GQA group and,
as in the paper, multiplied by the value norm ``||v||`` (a key's contribution to the residual stream is
its attention times its value). The first ``sinks`` keys are always kept.

RoPE comes from the observation (``needs_rope``): the adapter serving the cache passes the model's own rotary
module (:func:`model_rope`: cos/sin at any position, scaled variants such as llama3 and yarn included) or the
engine's RoPE table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from .base import Rope, Scorer


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """transformers' Llama convention: pairs (i, i + d/2) rotate together."""
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def model_rope(model) -> Rope:
    """cos/sin at arbitrary positions from ``model``'s rotary-embedding module (its scaling included)."""
    rot = next((m for m in model.modules() if hasattr(m, "inv_freq") and callable(m)), None)
    if rot is None:
        raise ValueError(f"{type(model).__name__} has no rotary-embedding module (a module with inv_freq)")

    @torch.no_grad()
    def rope(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.zeros(1, dtype=torch.float32, device=rot.inv_freq.device)
        cos, sin = rot(x, pos.to(rot.inv_freq.device)[None])
        return cos[0].float(), sin[0].float()

    return rope


def rotation_matrix(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The d x d matrix of x -> x * cos + rotate_half(x) * sin (cos, sin [d]); x R^T in row convention."""
    d = cos.shape[-1]
    eye = torch.eye(d, dtype=cos.dtype, device=cos.device)
    return torch.diag(cos) + sin[:, None] * rotate_half(eye).T


@dataclass
class ExpectedAttention(Scorer):
    """Expected attention of the next ``n_future`` queries (closed form, Gaussian queries) x value norm.

    n_future : future positions averaged over (the paper's default horizon 512).
    sinks : the first keys, always kept and left out of the query statistics.
    stats_window : only the last ``stats_window`` prefill queries give the statistics (None: all after the sinks).
    use_covariance : include the ``k^T Sigma k`` term (False: the mean query only).
    use_vnorm : multiply by ``||v||``. epsilon : added to the expected attention before the value norm.
    """

    n_future: int = 512
    sinks: int = 4
    stats_window: int | None = None
    use_covariance: bool = True
    use_vnorm: bool = True
    epsilon: float = 0.0
    needs_queries: ClassVar[bool] = True
    needs_rope: ClassVar[bool] = True
    forced_window: ClassVar[int | None] = 0

    @torch.no_grad()
    def score(self, K: torch.Tensor, V: torch.Tensor, obs) -> torch.Tensor:
        """K, V [B, H, S, d]; obs.query [B, Hq, m, d] post-RoPE at positions obs.q_pos -> scores [B, H, S]."""
        rope: Rope | None = obs.rope
        if rope is None:
            raise RuntimeError("ExpectedAttention needs RoPE: the observation carries none (obs.rope)")
        B, H, S, d = K.shape
        q, pos = obs.query.float(), obs.q_pos
        keep = pos >= self.sinks
        if self.stats_window is not None:
            keep &= pos > pos.max() - self.stats_window
        if not bool(keep.any()):
            keep = torch.ones_like(keep)
        q, pos = q[:, :, keep], pos[keep]
        cos, sin = rope(pos)                                         # [m, d] (scaled by attention_scaling)
        a2 = (cos[:1] ** 2 + sin[:1] ** 2).mean()                         # attention_scaling^2
        q_pre = (q * cos - rotate_half(q) * sin) / a2                      # undo RoPE: [B, Hq, m, d]
        mu = q_pre.mean(-2)                                               # [B, Hq, d]
        last = int(obs.q_pos.max())
        cf, sf = rope(torch.arange(last + 1, last + 1 + self.n_future, device=pos.device))
        R = rotation_matrix(cf.mean(0), sf.mean(0)).to(q.device)          # the average future rotation
        mu_f = mu @ R.T                                                   # [B, Hq, d]
        s = obs.scaling
        Kf = K.float()
        G = q.shape[1] // H
        Kg = Kf.repeat_interleave(G, dim=1)                               # [B, Hq, S, d]
        z = s * (Kg @ mu_f[..., None])[..., 0]                            # [B, Hq, S]
        if self.use_covariance and q_pre.shape[-2] > 1:
            xc = q_pre - mu[..., None, :]
            cov = xc.mT @ xc / (q_pre.shape[-2] - 1)                      # [B, Hq, d, d]
            cov_f = R @ cov @ R.T
            z = z + 0.5 * s * s * ((Kg @ cov_f) * Kg).sum(-1)
        p = torch.softmax(z, dim=-1).view(B, H, G, S).mean(2)              # expected attention [B, H, S]
        if self.use_vnorm:
            p = (p + self.epsilon) * V.float().norm(dim=-1)
        p[..., :self.sinks] = float("inf")
        return p
