"""Decode attention in factor space: AttSVD without rebuilding K/V.

AttSVD stores the prompt bulk of every (layer, KV head) as post-RoPE factors ``K_b ~ A_K B_K`` and
``V_b ~ A_V B_V`` (and, in stream mode, frozen blocks factored the same way), plus exact recent rows:
one :class:`~lowrank_lib.attsvd.kv.LowRankKV`. The paper (Algorithm 1, line 25) re-materialises
``K_full = [A_K B_K; Recon(D_K); T_K]`` at every decode step: O(S r d) work per step per head.
Because the keys are factored AFTER RoPE, the logits and the output can be read straight from
the factors::

    scores_run = (q B_K^T) A_K^T * scale         [G q, r_K] x [r_K, n]  -> O(n r_K)
    out_run    = (p_run A_V) B_V                 [G q, n] x [n, r_V]    -> O(n r_V + r_V d)

one softmax over ALL positions (runs, then exact rows, in position order), so the result is the
same function as rebuild-then-attend up to float round-off. The query heads of a GQA group share
one set of factors, so each group is handled as one batched matmul with ``G * q_len`` query rows.

Layout (``Hq = G * Hkv``; HF's grouping: query head ``h`` reads KV head ``h // G``)::

    q      [B, Hq, q_len, d]
    mask   bool (True = attend) or additive float, broadcastable as [B, 1 | Hq, q_len, N]
    out    [B, Hq, q_len, d]

``N = kv.length`` and the mask's last axis is in the same position order.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .kv import FactorRun, LowRankKV


# --------------------------------------------------------------------------- helpers
def _group_queries(q: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, int]:
    """[B, Hq, q_len, d] -> ([B, Hkv, G * q_len, d], G): the rows that share one KV head."""
    if q.dim() != 4:
        raise ValueError(f"query must be [B, Hq, q_len, d], got {tuple(q.shape)}")
    b, hq, ql, d = q.shape
    if hq % kv_heads:
        raise ValueError(f"query has {hq} heads, not a multiple of the {kv_heads} KV heads")
    g = hq // kv_heads
    return q.reshape(b, kv_heads, g * ql, d), g


def _apply_mask(scores: torch.Tensor, mask: torch.Tensor | None, g: int, q_len: int) -> torch.Tensor:
    """Add ``mask`` (bool keep-mask or additive float, [B|1, 1|Hq, q_len, N]) to grouped ``scores``.

    scores: [B, Hkv, G * q_len, N] -> same shape, masked positions at the dtype's minimum.
    """
    if mask is None:
        return scores
    b, hkv, _, n = scores.shape
    if mask.dim() == 2:  # [B, N] padding mask
        mask = mask[:, None, None, :]
    if mask.dim() != 4 or mask.shape[-1] != n or mask.shape[-2] not in (1, q_len) \
            or mask.shape[1] not in (1, hkv * g) or mask.shape[0] not in (1, b):
        raise ValueError(f"attention mask has shape {tuple(mask.shape)}, expected [B|1, 1|{hkv * g}, "
                         f"1|{q_len}, {n}] for B={b}, {n} attended positions")
    heads = mask.shape[1]
    m = mask.expand(mask.shape[0], heads, q_len, n)
    m = m.reshape(mask.shape[0], hkv, g * q_len, n) if heads > 1 else m.reshape(mask.shape[0], 1, 1, q_len, n)
    s = scores if heads > 1 else scores.view(b, hkv, g, q_len, n)
    if m.dtype == torch.bool:
        s = s.masked_fill(~m, torch.finfo(s.dtype).min)
    else:
        s = s + m.to(s.dtype)
    return s.view(b, hkv, g * q_len, n)


# --------------------------------------------------------------------------- the kernels
def attend_factors(q: torch.Tensor, runs: Sequence[FactorRun], k_exact: torch.Tensor | None,
                   v_exact: torch.Tensor | None, mask: torch.Tensor | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """Attention over factored runs + exact rows given as tensors (the kernel of
    :func:`factor_space_attention`; a store with static buffers calls it with views, building no object).

    q [B, Hq, q_len, d]; runs [(a_k, b_k, a_v, b_v), ...]; k_exact / v_exact [B, Hkv, w, d] or None;
    mask over the N = sum(n_i) + w positions. Returns [B, Hq, q_len, d] in q's dtype; softmax in fp32.
    """
    b, hq, ql, d = q.shape
    if k_exact is not None and k_exact.shape[-2] == 0:
        k_exact = v_exact = None
    hkv = k_exact.shape[1] if k_exact is not None else runs[0][0].shape[1]
    scale = d ** -0.5 if scale is None else scale
    qg, g = _group_queries(q * scale, hkv)                              # [B, Hkv, G q, d]
    parts = [(qg @ b_k.mT) @ a_k.mT for a_k, b_k, _, _ in runs]         # [B, Hkv, G q, n_i]
    if k_exact is not None:
        parts.append(qg @ k_exact.mT)                                   # [B, Hkv, G q, w]
    bmax = max(p.shape[0] for p in parts)
    parts = [p.expand(bmax, *p.shape[1:]) for p in parts]
    scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)  # [B, Hkv, G q, N]
    scores = _apply_mask(scores, mask, g, ql)
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out, off = None, 0
    for a_k, _, a_v, b_v in runs:
        n = a_k.shape[-2]
        o = (p[..., off:off + n] @ a_v) @ b_v                          # [B, Hkv, G q, d]
        out = o if out is None else out + o
        off += n
    if k_exact is not None:
        o = p[..., off:] @ v_exact
        out = o if out is None else out + o
    return out.reshape(b, hq, ql, out.shape[-1])


def factor_space_attention(q: torch.Tensor, kv: LowRankKV, mask: torch.Tensor | None = None,
                           scale: float | None = None) -> torch.Tensor:
    """Attention read straight from the factors: no K/V is ever rebuilt.

    Parameters
    ----------
    q : [B, Hq, q_len, d] post-RoPE queries (decode: q_len = 1).
    kv : the factored runs + exact rows, in position order.
    mask : bool keep-mask or additive float, [B|1, 1|Hq, q_len, N] (N = ``kv.length``), or None.
    scale : logit scale, default 1/sqrt(d).

    Returns
    -------
    out : [B, Hq, q_len, d] in ``q``'s dtype. Softmax runs in fp32.

    Cost per step per KV head (q_len = 1, G query heads per KV head): scores
    ``G (r_K d + n r_K)``, output ``G (n r_V + r_V d)`` MACs per run, vs ``n r d`` to rebuild.
    """
    if q.shape[-1] != kv.head_dim:
        raise ValueError(f"query head_dim {q.shape[-1]} != cached head_dim {kv.head_dim}")
    return attend_factors(q, kv.runs, kv.k_exact, kv.v_exact, mask, scale)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
                    scale: float | None = None) -> torch.Tensor:
    """Plain GQA attention over exact K/V, grouped the same way (the dense-KV route).

    q [B, Hq, q_len, d], k / v [B, Hkv, N, d], mask as in :func:`factor_space_attention`
    -> [B, Hq, q_len, d].
    """
    b, hq, ql, d = q.shape
    if k.dim() != 4 or k.shape != v.shape or k.shape[-1] != d:
        raise ValueError(f"dense_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must be [B, Hkv, N, {d}]")
    scale = d ** -0.5 if scale is None else scale
    qg, g = _group_queries(q * scale, k.shape[1])
    scores = _apply_mask(qg @ k.mT, mask, g, ql)
    p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return (p @ v).reshape(b, hq, ql, d)


def rebuild_then_attend(q: torch.Tensor, kv: LowRankKV, mask: torch.Tensor | None = None,
                        scale: float | None = None) -> torch.Tensor:
    """The AttSVD paper's decode: rebuild ``[A_K B_K; blocks; window]`` and V, then dense attention.

    Same arguments and result as :func:`factor_space_attention`; the reference it must match.
    """
    k, v = kv.dense()
    return dense_attention(q, k, v, mask, scale)


READS = {"factor": factor_space_attention, "rebuild": rebuild_then_attend}


def attend(route: str, q: torch.Tensor, kv: LowRankKV, mask: torch.Tensor | None = None,
           scale: float | None = None) -> torch.Tensor:
    """Dispatch by route name: "factor" or "rebuild" (both read the same ``LowRankKV``)."""
    if route not in READS:
        raise ValueError(f"route must be one of {sorted(READS)} for a LowRankKV, got {route!r}")
    return READS[route](q, kv, mask, scale)
