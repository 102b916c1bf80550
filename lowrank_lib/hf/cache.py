"""A transformers ``Cache`` (5.x API) whose layers hold a prefill exactly, then compress it once.

Life cycle of a layer (:class:`PrefillCompressedLayer`): the first ``update`` (the prefill) stores the
exact K/V and returns them unchanged, so prefill logits are bit-identical to a dense cache. The
capture (:func:`lowrank_lib.hf.capture.capture`) then hands the layer the prefill's post-RoPE queries
(``observe``), and the layer compresses (``compress``: AttSVD factors it, an eviction policy drops
rows). If no queries ever arrive, the next ``update`` compresses without them (``compress(None)``).
A recorded prefill is loaded directly with ``load_prefill`` (:func:`lowrank_lib.hf.record.replay`).

Subclasses implement ``compress(obs)`` and ``read()`` (what attention reads after compression).
Bytes held: the ``nbytes`` property of a layer (``dense_nbytes``: the dense equivalent).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


@dataclass
class Observation:
    """What the capture hands a layer after the prefill attention.

    query : [B, Hq, m, d] post-RoPE queries; k_valid / q_valid : [B, S] / [B, m] bool (padding);
    scaling : the module's softmax scale; q_pos : [m] absolute query positions.
    """

    query: torch.Tensor
    scaling: float
    q_pos: torch.Tensor
    k_valid: torch.Tensor | None = None
    q_valid: torch.Tensor | None = None

    def grouped(self, n_kv: int) -> torch.Tensor:
        """Queries as [B, H, G, m, d] (query head h * G + g reads KV head h)."""
        B, Hq, m, d = self.query.shape
        if Hq % n_kv:
            raise ValueError(f"query heads {Hq} not a multiple of KV heads {n_kv}")
        return self.query.view(B, n_kv, Hq // n_kv, m, d)


def _tensor_bytes(*ts) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


class PrefillCompressedLayer(CacheLayerMixin):
    """Shared life cycle of a layer compressed once after prefill (AttSVD and eviction policies)."""

    is_compileable = False
    is_croppable = False
    needs_queries = False

    def __init__(self, **kwargs):
        super().__init__()
        self.seen = 0              # logical number of tokens (positions) held
        self.pending = False       # prefill stored exactly, not yet compressed

    # ------------------------------------------------------------------ to implement
    def compress(self, obs: Observation | None) -> None:
        """Compress the exact prefill held in ``keys`` / ``values`` (obs: its queries, or None)."""
        raise NotImplementedError

    def read(self):
        """What attention reads after compression (dense K/V, or a low-rank object)."""
        return self.keys, self.values

    # ------------------------------------------------------------------ transformers' layer API
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys, self.values = key_states, value_states
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new K/V [B, H, q, d]; return what attention reads (the exact K/V at prefill)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.seen = key_states.shape[-2]
            self.pending = True
            return key_states, value_states
        if self.pending:   # the capture never delivered queries for the prefill
            self.compress(None)
            self.pending = False
        self.seen += key_states.shape[-2]
        self.append(key_states, value_states)
        return self.read()

    def observe(self, obs: Observation) -> None:
        """Called by the capture after the attention of this layer; compresses a pending prefill."""
        if self.pending:
            self.compress(obs)
            self.pending = False

    def load_prefill(self, keys: torch.Tensor, values: torch.Tensor, obs: Observation | None = None) -> None:
        """Hold a recorded prefill (K, V [B, H, S, d], its queries ``obs``) and compress it now."""
        if self.is_initialized:
            raise RuntimeError(f"{type(self).__name__}.load_prefill: the layer already holds {self.seen} tokens")
        self.lazy_initialization(keys, values)
        self.seen = keys.shape[-2]
        self.compress(obs)

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Generated tokens [B, H, q, d] are appended exactly (the accumulate schedule)."""
        self.keys = torch.cat([self.keys, k], dim=-2)
        self.values = torch.cat([self.values, v], dim=-2)

    def stored_len(self) -> int:
        """Number of key positions attention reads (kv length before the new tokens)."""
        return self.seen

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        n = self.stored_len()
        return n + query_length, self.seen - n

    def reset(self) -> None:
        self.keys = self.values = None
        self.is_initialized = False
        self.seen = 0
        self.pending = False

    # ------------------------------------------------------------------ accounting
    @property
    def nbytes(self) -> int:
        """Bytes this layer holds (the exact rows here; subclasses add what they store)."""
        return _tensor_bytes(self.keys, self.values)

    @property
    def dense_nbytes(self) -> int:
        """Bytes a dense cache would hold for the same tokens (same dtype)."""
        if not self.is_initialized:
            return 0
        B, H, _, d = self.keys.shape
        return 2 * B * H * self.seen * d * self.keys.element_size()


@dataclass
class MemoryReport:
    """Bytes actually stored vs the dense equivalent (same dtype), per layer and in total."""

    stored_bytes: int
    dense_bytes: int
    layer_stored: list[int]
    layer_dense: list[int]
    rank_k: list[int] = field(default_factory=list)        # per layer (AttSVD only)
    rank_v: list[int] = field(default_factory=list)
    head_rank_k: list[list[float]] = field(default_factory=list)  # per layer, per KV head (energy rule)
    head_rank_v: list[list[float]] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        return self.stored_bytes / max(1, self.dense_bytes)

    def to_dict(self) -> dict:
        d = {k: getattr(self, k) for k in self.__dataclass_fields__}
        d["ratio"] = self.ratio
        return d


class CompressedKVCache(Cache):
    """A transformers ``Cache`` whose layers compress once after prefill (see module docstring).

    Use through :func:`lowrank_lib.hf.capture.capture` so the layers receive post-RoPE queries:

        >>> with capture(model, cache):
        ...     out = model.generate(ids, cache=cache, max_new_tokens=32)
    """

    def __init__(self, layers: list[PrefillCompressedLayer]):
        super().__init__(layers=layers)

    def observe(self, layer_idx: int, obs: Observation) -> None:
        self.layers[layer_idx].observe(obs)

    def memory(self) -> MemoryReport:
        ls = [l.nbytes for l in self.layers]
        ld = [l.dense_nbytes for l in self.layers]
        return MemoryReport(sum(ls), sum(ld), ls, ld)
