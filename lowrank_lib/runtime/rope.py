"""Rotary position embeddings for the engine: the (cos, sin) table and its application.

The table comes from the model's own rotary module (any RoPE scaling it implements), once, for every
slot: ``[Smax, 2, D]``. Applying it to one projection output ``y`` [N, n_kv * g * D]:

    unfolded: y * cos + rotate_half(y) * sin
    folded:   the projection already produced [y, rotate_half(y)] ([U; P U], exact): (y2 * cs).sum(1)
"""
from __future__ import annotations

import torch


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, -1)
    return torch.cat((-x2, x1), -1)


def rope_table(model, n_slots: int, dtype: torch.dtype, device) -> torch.Tensor:
    """[n_slots, 2, D] (cos, sin) per position from ``model.model.rotary_emb``."""
    return rotary_rows(model.model.rotary_emb, torch.arange(n_slots), dtype, device)


def rotary_rows(rotary, positions: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """[n, 2, D] (cos, sin) at ``positions`` [n] from a transformers rotary module (its scaling included)."""
    dev = rotary.inv_freq.device
    cos, sin = rotary(torch.zeros(1, dtype=dtype, device=dev), positions.to(dev)[None])
    return torch.stack([cos[0], sin[0]], 1).to(device=device, dtype=dtype).contiguous()


def apply_rope(y: torch.Tensor, cs: torch.Tensor, n_kv: int, g: int, head_dim: int, folded: bool) -> torch.Tensor:
    """y [N, 2*n_kv*g*D] (folded) or [N, n_kv*g*D]; cs [N, 2, 1, 1, D] -> [N, n_kv, g, D]."""
    N = y.shape[0]
    if folded:
        return (y.view(N, 2, n_kv, g, head_dim) * cs).sum(1)
    y = y.view(N, n_kv, g, head_dim)
    return y * cs[:, 0] + rotate_half(y) * cs[:, 1]
