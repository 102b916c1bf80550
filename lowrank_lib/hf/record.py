"""Run a prefill once, load it into many caches.

Every cache here serves the prefill exactly (dense-identical logits) and compresses afterwards from the
same (K, V, post-RoPE Q) of each layer. :func:`record_prefill` runs the forward once inside
:func:`~lowrank_lib.hf.capture.capture` and keeps those tensors; :func:`replay` loads them into a fresh
cache (``PrefillCompressedLayer.load_prefill``: store and compress at once), so methods are compared on
identical prefill state and the long prefill is not recomputed per method.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import DynamicCache

from ..geometry import geometry
from .cache import CompressedKVCache, Observation, PrefillCompressedLayer
from .capture import capture


class _RecordLayer(PrefillCompressedLayer):
    def __init__(self):
        super().__init__()
        self.obs: Observation | None = None

    def compress(self, obs):
        self.obs = obs

    def read(self):
        raise RuntimeError("a recording cache serves only the prefill")


@dataclass
class PrefillRecord:
    """Per layer: keys / values [B, H, S, d], the observation (queries [B, Hq, S, d]); ``last_logits`` [B, V]."""

    keys: list[torch.Tensor]
    values: list[torch.Tensor]
    obs: list[Observation]
    last_logits: torch.Tensor

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2]


@torch.no_grad()
def record_prefill(model, ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> PrefillRecord:
    """Prefill ``ids`` [B, S] once, capturing every layer's K, V and post-RoPE queries."""
    rec = CompressedKVCache([_RecordLayer() for _ in range(geometry(model).n_layers)])
    with capture(model, rec):
        out = model(ids, attention_mask=attention_mask, cache=rec, logits_to_keep=1)
    ls = rec.layers
    if any(l.obs is None for l in ls):
        raise RuntimeError("record_prefill: queries were not captured for every layer")
    return PrefillRecord([l.keys for l in ls], [l.values for l in ls], [l.obs for l in ls],
                         out.logits[:, -1].float())


def replay(record: PrefillRecord, cache):
    """Load a recorded prefill into ``cache`` (a CompressedKVCache or a DynamicCache) and return it."""
    for i, (k, v, obs) in enumerate(zip(record.keys, record.values, record.obs)):
        if isinstance(cache, CompressedKVCache):
            cache.layers[i].load_prefill(k, v, obs)
        else:
            cache.update(k, v, i)
    return cache


def dense_from(record: PrefillRecord, model) -> DynamicCache:
    """A DynamicCache holding the recorded prefill (the dense reference)."""
    return replay(record, DynamicCache(config=model.config))
