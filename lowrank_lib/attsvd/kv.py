"""The ONE low-rank KV type: one layer's keys and values as factored runs, then exact rows.

    runs             list of (a_k, b_k, a_v, b_v), oldest first: the prompt bulk, then stream blocks
                       a_k [B, H, n, r_K]   b_k [B|1, H, r_K, d]      K_run ~ a_k @ b_k
                       a_v [B, H, n, r_V]   b_v [B|1, H, r_V, d]      V_run ~ a_v @ b_v
    k_exact, v_exact [B, H, w, d] exact rows after the runs (the recent window), or None

Position order is runs then exact rows. Keys are factored AFTER RoPE, so attention can read the
factors directly (:mod:`lowrank_lib.attsvd.factor_space`). Ranks may differ between K and V and
between runs, but are shared by the heads of a run (a smaller per-head rank is zero-padded by the
producer). ``b_*`` may have batch 1 to share a basis across rows.

Who uses it: :func:`lowrank_lib.attsvd.basis.compress_prefill` returns it (Algorithm 2 of one
layer), the AttSVD KV method (:class:`lowrank_lib.kv.methods.attsvd.AttSVD`) turns it into the tiered state both
adapters serve, and
factor-space attention and evaluation read it. Construction does not validate (decode builds no
checked objects); producers call :meth:`LowRankKV.validate`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: one batched run of factors (a_k [B, H, n, r_k], b_k [B, H, r_k, d], a_v, b_v): the algorithm's output, not the
#: per-segment ``kv.tiers.Run`` a KV method hands the tiered state
FactorRun = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]   # (a_k, b_k, a_v, b_v)


@dataclass
class Spectra:
    """What chose the ranks of a factorization (Algorithm 2): spectra and energy-rule ranks. Not stored KV."""

    sk: torch.Tensor                  # [B, H, min(S, d)] singular values of the (weighted) keys
    sv: torch.Tensor                  # [B, H, min(S, d)] singular values of the (weighted) values
    head_rank_k: torch.Tensor | None  # [B, H] energy-rule ranks before aggregation (None: fixed rule)
    head_rank_v: torch.Tensor | None
    weighted: bool                    # False when the unweighted fallback / raw-SVD baseline ran


@dataclass(eq=False)
class LowRankKV:
    """One layer's K/V in low-rank form (see the module docstring for shapes).

    ``info`` describes how the first run's ranks were chosen (diagnostics, not counted in ``nbytes``).
    """

    runs: list[FactorRun] = field(default_factory=list)
    k_exact: torch.Tensor | None = None
    v_exact: torch.Tensor | None = None
    info: Spectra | None = None

    def validate(self) -> "LowRankKV":
        """Check every shape (named tensors, expected vs found); returns self."""
        for j, run in enumerate(self.runs):
            if len(run) != 4 or not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in run):
                found = [tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__ for t in run]
                raise ValueError(f"LowRankKV.runs[{j}] must be 4-D tensors (a_k, b_k, a_v, b_v) [B, H, ., .], "
                                 f"got {found}")
            ak, bk, av, bv = run
            if ak.shape[-1] != bk.shape[-2]:
                raise ValueError(f"LowRankKV.runs[{j}]: a_k {tuple(ak.shape)} [B, H, n, r_K] and b_k "
                                 f"{tuple(bk.shape)} [B, H, r_K, d] disagree on r_K")
            if av.shape[-1] != bv.shape[-2]:
                raise ValueError(f"LowRankKV.runs[{j}]: a_v {tuple(av.shape)} [B, H, n, r_V] and b_v "
                                 f"{tuple(bv.shape)} [B, H, r_V, d] disagree on r_V")
            if ak.shape[-2] != av.shape[-2]:
                raise ValueError(f"LowRankKV.runs[{j}]: a_k has {ak.shape[-2]} positions but a_v has {av.shape[-2]}")
            if bk.shape[-1] != bv.shape[-1]:
                raise ValueError(f"LowRankKV.runs[{j}]: b_k head dim {bk.shape[-1]} != b_v head dim {bv.shape[-1]}")
            if not (ak.shape[1] == bk.shape[1] == av.shape[1] == bv.shape[1]):
                raise ValueError(f"LowRankKV.runs[{j}]: KV-head axes differ: a_k {tuple(ak.shape)} b_k "
                                 f"{tuple(bk.shape)} a_v {tuple(av.shape)} b_v {tuple(bv.shape)}")
        if (self.k_exact is None) != (self.v_exact is None):
            raise ValueError("LowRankKV: give both k_exact and v_exact, or neither")
        if self.k_exact is not None and (self.k_exact.dim() != 4 or self.k_exact.shape != self.v_exact.shape):
            raise ValueError(f"LowRankKV: k_exact {tuple(self.k_exact.shape)} and v_exact "
                             f"{tuple(self.v_exact.shape)} must both be [B, H, w, d]")
        dims = {r[1].shape[-1] for r in self.runs} | ({self.k_exact.shape[-1]} if self.k_exact is not None else set())
        heads = {r[0].shape[1] for r in self.runs} | ({self.k_exact.shape[1]} if self.k_exact is not None else set())
        if len(dims) > 1 or len(heads) > 1:
            raise ValueError(f"LowRankKV: parts disagree on head_dim {sorted(dims)} or KV heads {sorted(heads)}")
        if not dims:
            raise ValueError("LowRankKV: nothing to attend to (no runs and no exact rows)")
        return self

    # ------------------------------------------------------------------ sizes
    @property
    def window(self) -> int:
        """w, the number of exact rows."""
        return 0 if self.k_exact is None else self.k_exact.shape[-2]

    @property
    def length(self) -> int:
        """N, the number of positions attention reads."""
        return sum(r[0].shape[-2] for r in self.runs) + self.window

    @property
    def head_dim(self) -> int:
        return self.k_exact.shape[-1] if self.k_exact is not None else self.runs[0][1].shape[-1]

    @property
    def kv_heads(self) -> int:
        return self.k_exact.shape[1] if self.k_exact is not None else self.runs[0][0].shape[1]

    @property
    def rank_k(self) -> int:
        """r_K of the first run (the prompt bulk); 0 when nothing is factored."""
        return self.runs[0][0].shape[-1] if self.runs else 0

    @property
    def rank_v(self) -> int:
        return self.runs[0][2].shape[-1] if self.runs else 0

    @property
    def nbytes(self) -> int:
        """Bytes stored: factors of every run + the exact rows."""
        ts = [t for r in self.runs for t in r] + [t for t in (self.k_exact, self.v_exact) if t is not None]
        return sum(t.numel() * t.element_size() for t in ts)

    @property
    def shape(self):
        """Not a tensor: a dense attention function that asks for ``key.shape`` gets a clear error."""
        raise TypeError("a LowRankKV (factored AttSVD cache layer) reached a dense attention function: run the "
                        "model inside lowrank_lib.kv.hf_adapter.tiered_attention(model) (or serve the AttSVD method "
                        "with lowrank_lib.kv.KVCache)")

    # ------------------------------------------------------------------ transforms
    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) [B, H, N, d] rebuilt and concatenated in position order (Algorithm 1, line 25)."""
        ks = [a_k @ b_k for a_k, b_k, _, _ in self.runs]
        vs = [a_v @ b_v for _, _, a_v, b_v in self.runs]
        if self.k_exact is not None:
            ks.append(self.k_exact)
            vs.append(self.v_exact)
        if len(ks) == 1:
            return ks[0], vs[0]
        batch = max(t.shape[0] for t in ks)
        ks = [k.expand(batch, *k.shape[1:]) for k in ks]
        vs = [v.expand(batch, *v.shape[1:]) for v in vs]
        return torch.cat(ks, dim=-2), torch.cat(vs, dim=-2)

    def to(self, dtype: torch.dtype) -> "LowRankKV":
        cast = lambda t: None if t is None else t.to(dtype)
        return LowRankKV([tuple(t.to(dtype) for t in r) for r in self.runs], cast(self.k_exact), cast(self.v_exact),
                         self.info)
