"""AttSVD low-rank KV cache as a transformers ``Cache`` (5.x API, transformers >= 5.4).

Per layer the cache holds, for every batch row and KV head (all tensors post-RoPE, [B, H, ., .]):

    bulk_k, bulk_v : Factors    prompt bulk (all prefill tokens but the newest w): A [B, H, S_b, r], B [B, H, r, d]
    blocks         : list of (Factors, Factors)   stream mode: frozen rank-r blocks of aged-out decode chunks,
                                                  oldest first, each A [B, H, l, r], B [B, H, r, d]
    keys, values   : [B, H, n, d]   exact part: the prefill window (+ every generated token in accumulate mode;
                                    the sliding window of n in [w, w + l] tokens in stream mode)

Position order of the logical sequence is bulk ⊕ blocks ⊕ exact. Attention in factor space can read the
factors directly: scores_bulk = A_K (B_K q) / sqrt(d), output_bulk = (p^T A_V) B_V. The decode path here is
"rebuild then attend": :func:`rebuild_kv` materialises [B, H, S, d] keys/values for one layer, which the
model's attention function then consumes; it is the one function to swap for a factor-space kernel.

Life cycle of a layer: the first ``update`` (prefill) stores the exact K/V and returns them unchanged, so
prefill logits are bit-identical to a dense cache. The registered attention function of
:mod:`lowrank_lib.attsvd.capture` then hands the layer its post-RoPE queries (``observe``), and the bulk is
factorized (Algorithm 2) and the dense bulk freed. If no queries ever arrive (the capture was not active),
the next ``update`` factorizes with plain SVD and warns: the unweighted fallback of Algorithm 2.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from .basis import Factors, LayerFactors, attention_mass, attention_svd, query_metric, trunc_svd
from .config import AttSVDConfig
from .ranks import aggregate, energy_rank


# ----------------------------------------------------------------------------- observed prefill
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


def rebuild_kv(bulk_k: Factors | None, bulk_v: Factors | None, blocks: list[tuple[Factors, Factors]],
               keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode-time "rebuild then attend": [A_K B_K ; blocks ; exact] -> K, V [B, H, S, d].

    The result is transient (one layer at a time); only the factors and the exact part persist.
    """
    ks, vs = [], []
    if bulk_k is not None:
        ks.append(bulk_k.rebuild().to(keys.dtype))
        vs.append(bulk_v.rebuild().to(values.dtype))
    for fk, fv in blocks:
        ks.append(fk.rebuild().to(keys.dtype))
        vs.append(fv.rebuild().to(values.dtype))
    ks.append(keys)
    vs.append(values)
    if len(ks) == 1:
        return keys, values
    return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)


class PrefillCompressedLayer(CacheLayerMixin):
    """Shared life cycle of a layer compressed once after prefill (AttSVD and eviction policies).

    Subclasses implement ``_compress(obs)`` (obs may be None when no queries were captured) and
    ``_full()`` (the K/V attention reads after compression) and may override ``_append``.
    """

    is_compileable = False
    is_croppable = False
    needs_queries = False

    def __init__(self, **kwargs):
        super().__init__()
        self.seen = 0              # logical number of tokens (positions) held
        self.pending = False       # prefill stored exactly, not yet compressed
        self.used_fallback = False

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device, self.dtype = key_states.device, key_states.dtype
        self.keys, self.values = key_states, value_states
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Store new K/V [B, H, q, d]; return the K/V attention reads (exact at prefill)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.seen = key_states.shape[-2]
            self.pending = True
            return key_states, value_states
        if self.pending:   # the capture never delivered queries for the prefill
            self._compress(None)
            self.pending = False
        self.seen += key_states.shape[-2]
        self._append(key_states, value_states)
        return self._full()

    def observe(self, obs: Observation) -> None:
        """Called by the capture after the attention of this layer; compresses a pending prefill."""
        if self.pending:
            self._compress(obs)
            self.pending = False

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        self.keys = torch.cat([self.keys, k], dim=-2)
        self.values = torch.cat([self.values, v], dim=-2)

    def stored_len(self) -> int:
        """Number of key positions the attention reads (kv length before the new tokens)."""
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

    def exact_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.keys, self.values) if t is not None]

    def stored_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.exact_tensors())

    def dense_bytes(self) -> int:
        if not self.is_initialized:
            return 0
        B, H, _, d = self.keys.shape
        return 2 * B * H * self.seen * d * self.keys.element_size()


class AttSVDLayer(PrefillCompressedLayer):
    """One layer of the AttSVD cache (Algorithm 1): factored prompt bulk, exact tail, stream blocks."""

    def __init__(self, cfg: AttSVDConfig, **kwargs):
        super().__init__()
        self.cfg = cfg
        self.bulk_k: Factors | None = None
        self.bulk_v: Factors | None = None
        self.blocks: list[tuple[Factors, Factors]] = []
        self.info: LayerFactors | None = None   # spectra / energy ranks of the prefill factorization

    @property
    def rank_k(self) -> int:
        return self.bulk_k.rank if self.bulk_k is not None else 0

    @property
    def rank_v(self) -> int:
        return self.bulk_v.rank if self.bulk_v is not None else 0

    def _compress(self, obs: Observation | None) -> None:
        cfg = self.cfg
        K, V = self.keys, self.values            # [B, H, S, d] exact prefill
        B, H, S, d = K.shape
        nb = max(0, S - cfg.window)
        if nb == 0:
            return
        Kb, Vb = K[:, :, :nb], V[:, :, :nb]
        C_Q = mass = None
        k_valid = None
        if cfg.attention_aware:
            if obs is None:
                if not self.used_fallback:
                    warnings.warn("AttSVD: post-RoPE queries were not captured for this prefill (run the forward "
                                  "inside lowrank_lib.attsvd.capture.capture(model, cache)); falling back to "
                                  "unweighted SVD of K/V", RuntimeWarning, stacklevel=3)
                self.used_fallback = True
            else:
                Qg = obs.grouped(H)                                   # [B, H, G, m, d]
                q_pos, q_valid = obs.q_pos, obs.q_valid
                if cfg.obs_window is not None and Qg.shape[-2] > cfg.obs_window:
                    Qg = Qg[..., -cfg.obs_window:, :]
                    q_pos = q_pos[-cfg.obs_window:]
                    q_valid = None if q_valid is None else q_valid[:, -cfg.obs_window:]
                k_valid = obs.k_valid
                C_Q = query_metric(Qg, cfg.eps, q_valid)
                k_pos = torch.arange(S, device=K.device)
                mass = attention_mass(Qg, K, obs.scaling, q_pos, k_pos, q_valid, k_valid)[..., :nb]
        if k_valid is not None:   # padding rows are never attended: zero them so they take no rank
            kv = k_valid[:, None, :nb, None].to(Kb.dtype)
            Kb, Vb = Kb * kv, Vb * kv
        rk = rv = None
        if not cfg.dynamic:
            rk, rv = cfg.fixed_ranks(d)
        info = attention_svd(Kb, Vb, rk, rv, C_Q=C_Q, mass=mass, tau=cfg.tau, aggregator=cfg.aggregator,
                             rank_max=cfg.rank_max, mass_floor=cfg.mass_floor,
                             key_mass=cfg.key_mass)
        self.info = info
        self.bulk_k, self.bulk_v = info.k.to(K.dtype), info.v.to(V.dtype)
        # free the dense bulk: keep only the exact window (a copy, so the prefill tensor can be released)
        self.keys = K[:, :, nb:].clone()
        self.values = V[:, :, nb:].clone()

    def _chunk_ranks(self, ck: torch.Tensor, cv: torch.Tensor) -> tuple[int, int]:
        d = ck.shape[-1]
        if not self.cfg.dynamic:
            return self.cfg.fixed_ranks(d)
        sk = torch.linalg.svdvals(ck.float())
        sv = torch.linalg.svdvals(cv.float())
        c = self.cfg
        return (aggregate(energy_rank(sk, c.tau), c.aggregator, c.rank_max),
                aggregate(energy_rank(sv, c.tau), c.aggregator, c.rank_max))

    def _append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        super()._append(k, v)
        cfg = self.cfg
        if cfg.mode != "stream":
            return
        # stream: factor each aged-out chunk of l tokens from its exact values (unweighted) and freeze it
        while self.keys.shape[-2] - cfg.window >= cfg.chunk:
            ck, cv = self.keys[:, :, :cfg.chunk], self.values[:, :, :cfg.chunk]
            rk, rv = self._chunk_ranks(ck, cv)
            self.blocks.append((trunc_svd(ck, rk).to(ck.dtype), trunc_svd(cv, rv).to(cv.dtype)))
            self.keys = self.keys[:, :, cfg.chunk:].clone()
            self.values = self.values[:, :, cfg.chunk:].clone()

    def _full(self) -> tuple[torch.Tensor, torch.Tensor]:
        return rebuild_kv(self.bulk_k, self.bulk_v, self.blocks, self.keys, self.values)

    def exact_tensors(self) -> list[torch.Tensor]:
        out = super().exact_tensors()
        return out

    def stored_bytes(self) -> int:
        n = super().stored_bytes()
        if self.bulk_k is not None:
            n += self.bulk_k.nbytes + self.bulk_v.nbytes
        n += sum(fk.nbytes + fv.nbytes for fk, fv in self.blocks)
        return n

    def reset(self) -> None:
        super().reset()
        self.bulk_k = self.bulk_v = self.info = None
        self.blocks = []


# ----------------------------------------------------------------------------- the Cache
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


def _model_geometry(config) -> tuple[int, int, int, int]:
    """(num_layers, num_kv_heads, num_q_heads, head_dim) of a HF text config (or a model)."""
    config = getattr(config, "config", config)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    nq = config.num_attention_heads
    nkv = getattr(config, "num_key_value_heads", None) or nq
    hd = getattr(config, "head_dim", None) or config.hidden_size // nq
    return config.num_hidden_layers, nkv, nq, hd


class CompressedKVCache(Cache):
    """A transformers ``Cache`` whose layers compress once after prefill (see module docstring).

    Use through :func:`lowrank_lib.attsvd.capture.capture` so the layers receive post-RoPE queries:

        >>> cache = AttSVDCache(model, AttSVDConfig(ratio=0.5, window=32))
        >>> with capture(model, cache):
        ...     out = model.generate(ids, past_key_values=cache, max_new_tokens=32)
    """

    def __init__(self, layers: list[PrefillCompressedLayer]):
        super().__init__(layers=layers)

    def observe(self, layer_idx: int, obs: Observation) -> None:
        self.layers[layer_idx].observe(obs)

    @property
    def used_fallback(self) -> bool:
        return any(getattr(l, "used_fallback", False) for l in self.layers)

    def memory(self) -> MemoryReport:
        ls = [l.stored_bytes() for l in self.layers]
        ld = [l.dense_bytes() for l in self.layers]
        rep = MemoryReport(sum(ls), sum(ld), ls, ld)
        for l in self.layers:
            if isinstance(l, AttSVDLayer):
                rep.rank_k.append(l.rank_k)
                rep.rank_v.append(l.rank_v)
                if l.info is not None and l.info.head_rank_k is not None:
                    rep.head_rank_k.append(l.info.head_rank_k.double().mean(0).tolist())
                    rep.head_rank_v.append(l.info.head_rank_v.double().mean(0).tolist())
        return rep


class AttSVDCache(CompressedKVCache):
    """The AttSVD cache for ``model_or_config`` (a HF model or its config) with options ``cfg``."""

    def __init__(self, model_or_config, cfg: AttSVDConfig):
        n_layers, _, _, _ = _model_geometry(model_or_config)
        self.cfg = cfg
        super().__init__([AttSVDLayer(cfg) for _ in range(n_layers)])
