"""Per-key attention mass of a prefill: the statistic the AttSVD value weighting, its interpretability
and the attention-scoring eviction policies (H2O, SnapKV) share. Pure tensor math.

    Q : [B, H, G, m, d]  post-RoPE queries grouped by the KV head they read (query head h*G + g -> KV head h)
    K : [B, H, S, d]     post-RoPE keys
"""
from __future__ import annotations

import torch


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


@torch.no_grad()
def attention_mass(Q: torch.Tensor, K: torch.Tensor, scaling: float, q_pos: torch.Tensor,
                   k_pos: torch.Tensor, q_valid: torch.Tensor | None = None,
                   k_valid: torch.Tensor | None = None, chunk: int = 256) -> torch.Tensor:
    """Per-key attention mass a_i = sum_{g, q} softmax(q K^T * scaling)_i under the causal mask.

    Q : [B, H, G, m, d]; K : [B, H, S, d]; q_pos : [m] and k_pos : [S] absolute positions (key i is visible
    to query q when k_pos[i] <= q_pos[q]); q_valid [B, m], k_valid [B, S] bool padding masks.
    Returns a [B, H, S] (fp32), computed over query chunks of ``chunk`` rows so the peak is O(chunk * S).
    """
    Bsz, H, G, m, d = Q.shape
    Kf = _f32(K)
    a = torch.zeros(Bsz, H, K.shape[-2], dtype=Kf.dtype, device=K.device)
    for s in range(0, m, chunk):
        q = _f32(Q[:, :, :, s:s + chunk])                                   # [B, H, G, c, d]
        logits = torch.einsum("bhgcd,bhsd->bhgcs", q, Kf) * scaling         # [B, H, G, c, S]
        vis = k_pos[None, :] <= q_pos[s:s + chunk, None]                    # [c, S]
        vis = vis[None].expand(Bsz, -1, -1)
        if k_valid is not None:
            vis = vis & k_valid[:, None, :]
        logits = logits.masked_fill(~vis[:, None, None], float("-inf"))
        p = torch.softmax(logits, dim=-1).nan_to_num(0.0)                  # fully masked rows -> 0
        if q_valid is not None:
            p = p * q_valid[:, None, None, s:s + chunk, None].to(p.dtype)
        a += p.sum(dim=(2, 3))
    return a
