"""Attention geometry of a Llama-family config: the ONE place head counts and head_dim are derived.

    >>> g = geometry(model)            # a model, a PretrainedConfig, or a multimodal config
    >>> g.n_layers, g.n_heads, g.n_kv_heads, g.head_dim, g.group
    (30, 9, 3, 64, 3)

``head_dim`` is the config's own ``head_dim`` when it sets one (Gemma, Qwen3, many Llama
derivatives set it to something other than ``hidden_size // num_attention_heads``), else the
quotient. Every module that needs these numbers calls :func:`geometry`; nothing recomputes them.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Geometry", "geometry", "text_config"]


@dataclass(frozen=True)
class Geometry:
    n_layers: int
    hidden: int
    n_heads: int      # query heads
    n_kv_heads: int   # key/value heads (== n_heads for MHA, fewer for GQA)
    head_dim: int

    @property
    def group(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.n_heads // self.n_kv_heads

    @property
    def kv_dim(self) -> int:
        return self.n_kv_heads * self.head_dim


def text_config(obj):
    """The text config of a model, a config, or a multimodal config (``get_text_config``)."""
    cfg = getattr(obj, "config", obj)
    return cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg


def geometry(obj) -> Geometry:
    """:class:`Geometry` of a model or (text / multimodal) config. Raises ``ValueError`` on an
    inconsistent config (heads not dividing, non-positive sizes) naming the fields."""
    cfg = text_config(obj)
    nq = int(cfg.num_attention_heads)
    nkv = int(getattr(cfg, "num_key_value_heads", None) or nq)
    hidden = int(cfg.hidden_size)
    hd = getattr(cfg, "head_dim", None)
    hd = int(hd) if hd else (hidden // nq if nq > 0 else 0)
    n_layers = int(cfg.num_hidden_layers)
    if min(nq, nkv, hidden, hd, n_layers) <= 0 or nq % nkv:
        raise ValueError(f"inconsistent attention geometry: num_hidden_layers={n_layers}, hidden_size={hidden}, "
                         f"num_attention_heads={nq}, num_key_value_heads={nkv}, head_dim={hd} "
                         f"(all must be positive and num_key_value_heads must divide num_attention_heads)")
    return Geometry(n_layers, hidden, nq, nkv, hd)
