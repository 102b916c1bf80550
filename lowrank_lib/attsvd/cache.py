"""AttSVD low-rank KV cache as a transformers ``Cache`` (5.x API, transformers >= 5.4).

Per layer the cache holds one :class:`~lowrank_lib.attsvd.kv.LowRankKV` (all tensors post-RoPE, [B, H, ., .]):

    runs[0]          the prompt bulk (all prefill tokens but the newest w), factored by Algorithm 2
    runs[1:]         stream mode: frozen rank-r blocks of aged-out decode chunks, oldest first
    k_exact/v_exact  the exact part: the prefill window (+ every generated token in accumulate mode;
                     the sliding window of n in [w, w + l] tokens in stream mode)

Position order is runs then exact rows. The decode path here is "rebuild then attend":
``LowRankKV.dense()`` materialises [B, H, S, d] keys/values for one layer, which the model's attention
function then consumes; :mod:`lowrank_lib.attsvd.factor_cache` reads the factors directly instead.

Life cycle (:class:`~lowrank_lib.hf.cache.PrefillCompressedLayer`): the prefill is stored exactly and
served exactly; the capture then hands the layer its post-RoPE queries and the prefill is compressed by
:func:`~lowrank_lib.attsvd.basis.compress_prefill`. If no queries ever arrive (the capture was not
active), the next ``update`` compresses with plain SVD and warns: the unweighted fallback of Algorithm 2.
"""
from __future__ import annotations

import warnings

import torch

from ..geometry import geometry
from ..hf.cache import CompressedKVCache, MemoryReport, Observation, PrefillCompressedLayer
from .basis import compress_prefill, trunc_svd
from .config import AttSVDConfig
from .kv import LowRankKV
from .ranks import aggregate, energy_rank


class AttSVDLayer(PrefillCompressedLayer):
    """One layer of the AttSVD cache (Algorithm 1): the prefill, then one ``LowRankKV`` (``kv``).

    ``keys`` / ``values`` are the exact rows: the prefill until it is compressed, then ``kv.k_exact`` /
    ``kv.v_exact`` (the same tensors, so transformers' layer methods keep working).
    """

    def __init__(self, cfg: AttSVDConfig, **kwargs):
        self.kv: LowRankKV | None = None
        super().__init__()
        self.cfg = cfg
        self.used_fallback = False
        self.has_bulk = False      # kv.runs[0] is the factored prompt bulk (the rest: stream blocks)

    # exact rows live in the LowRankKV once it exists
    @property
    def keys(self) -> torch.Tensor | None:
        return self._keys if self.kv is None else self.kv.k_exact

    @keys.setter
    def keys(self, t: torch.Tensor | None) -> None:
        if self.kv is None:
            self._keys = t
        else:
            self.kv.k_exact = t

    @property
    def values(self) -> torch.Tensor | None:
        return self._values if self.kv is None else self.kv.v_exact

    @values.setter
    def values(self, t: torch.Tensor | None) -> None:
        if self.kv is None:
            self._values = t
        else:
            self.kv.v_exact = t

    @property
    def rank_k(self) -> int:
        return self.kv.rank_k if self.kv is not None else 0

    @property
    def rank_v(self) -> int:
        return self.kv.rank_v if self.kv is not None else 0

    @property
    def bulk_len(self) -> int:
        """Prefill positions held as factors (0 before compression or when the prompt fits the window)."""
        return self.kv.runs[0][0].shape[-2] if self.has_bulk else 0

    @property
    def blocks(self) -> list:
        """Stream mode: the frozen blocks (runs after the prompt bulk), oldest first."""
        return [] if self.kv is None else self.kv.runs[1 if self.has_bulk else 0:]

    def compress(self, obs: Observation | None) -> None:
        if self.cfg.attention_aware and obs is None and self.seen > self.cfg.window:
            if not self.used_fallback:
                warnings.warn("AttSVD: post-RoPE queries were not captured for this prefill (run the forward "
                              "inside lowrank_lib.hf.capture(model, cache)); falling back to unweighted SVD of "
                              "K/V", RuntimeWarning, stacklevel=3)
            self.used_fallback = True
        K, V = self.keys, self.values
        if obs is None:
            self.kv = compress_prefill(K, V, None, self.cfg)
        else:
            self.kv = compress_prefill(K, V, obs.query, self.cfg, obs.k_valid, obs.scaling, obs.q_pos)
        self.has_bulk = bool(self.kv.runs)
        self._keys = self._values = None

    def _chunk_ranks(self, ck: torch.Tensor, cv: torch.Tensor) -> tuple[int, int]:
        d = ck.shape[-1]
        if not self.cfg.dynamic:
            return self.cfg.fixed_ranks(d)
        sk = torch.linalg.svdvals(ck.float())
        sv = torch.linalg.svdvals(cv.float())
        c = self.cfg
        return (aggregate(energy_rank(sk, c.tau), c.aggregator, c.rank_max),
                aggregate(energy_rank(sv, c.tau), c.aggregator, c.rank_max))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        super().append(k, v)
        cfg = self.cfg
        if cfg.mode != "stream":
            return
        # stream: factor each aged-out chunk of l tokens from its exact values (unweighted) and freeze it
        while self.keys.shape[-2] - cfg.window >= cfg.chunk:
            ck, cv = self.keys[:, :, :cfg.chunk], self.values[:, :, :cfg.chunk]
            rk, rv = self._chunk_ranks(ck, cv)
            (ak, bk), (av, bv) = trunc_svd(ck, rk), trunc_svd(cv, rv)
            self.kv.runs.append((ak.to(ck.dtype), bk.to(ck.dtype), av.to(cv.dtype), bv.to(cv.dtype)))
            self.keys = self.keys[:, :, cfg.chunk:].clone()
            self.values = self.values[:, :, cfg.chunk:].clone()

    def read(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv.dense()

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes if self.kv is not None else super().nbytes

    def reset(self) -> None:
        self.kv = None
        self.has_bulk = False
        super().reset()


class AttSVDCache(CompressedKVCache):
    """The AttSVD cache for ``model_or_config`` (a HF model or its config) with options ``cfg``.

        >>> cache = AttSVDCache(model, AttSVDConfig(ratio=0.5, window=32))
        >>> with capture(model, cache):
        ...     out = model.generate(ids, cache=cache, max_new_tokens=32)
    """

    layer_class = AttSVDLayer

    def __init__(self, model_or_config, cfg: AttSVDConfig):
        self.cfg = cfg
        super().__init__([self.layer_class(cfg) for _ in range(geometry(model_or_config).n_layers)])

    @property
    def used_fallback(self) -> bool:
        return any(l.used_fallback for l in self.layers)

    def memory(self) -> MemoryReport:
        """Bytes per layer, plus the ranks per layer and the energy-rule ranks per layer and KV head."""
        rep = super().memory()
        for l in self.layers:
            rep.rank_k.append(l.rank_k)
            rep.rank_v.append(l.rank_v)
            info = l.kv.info if l.kv is not None else None
            if info is not None and info.head_rank_k is not None:
                rep.head_rank_k.append(info.head_rank_k.double().mean(0).tolist())
                rep.head_rank_v.append(info.head_rank_v.double().mean(0).tolist())
        return rep
