"""Attention-aware low-rank factorization of one layer's K/V (Algorithm 2 of the AttSVD paper).

Pure functions on tensors; nothing here knows about transformers. Layout conventions:

    K, V : [B, H, S, d]       post-RoPE keys / values of H key-value heads (as the cache holds them)
    Q    : [B, H, G, m, d]    post-RoPE queries, grouped by the KV head they read (G = query heads per
                              KV head; query head h*G + g reads KV head h, as ``repeat_kv`` lays them out)
    Factors.A : [B, H, S, r], Factors.B : [B, H, r, d]   with   K_r = A @ B  (per batch row and KV head)

Keys are truncated in the query metric C_Q = Q^T Q + eps * (tr(Q^T Q) / d) * I (summed over the G query
heads of a group), which minimises the logit error ||Q (K - K_r)^T||_F (Eq. 3); values are row-weighted by
the per-key attention mass a_i = sum_q P_qi (+ floor), which minimises sum_i a_i ||V_i - (V_r)_i||^2 (Eq. 4).
All SVDs run in fp32 (float64 inputs stay float64); factors are returned in fp32/float64 and cast by the
caller.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .ranks import aggregate, energy_rank


@dataclass
class Factors:
    """Rank-r factors of a [B, H, S, d] matrix: ``A`` [B, H, S, r], ``B`` [B, H, r, d]; M_r = A @ B."""

    A: torch.Tensor
    B: torch.Tensor

    @property
    def rank(self) -> int:
        return self.A.shape[-1]

    @property
    def length(self) -> int:
        return self.A.shape[-2]

    def rebuild(self) -> torch.Tensor:
        """[B, H, S, d] reconstruction A @ B."""
        return self.A @ self.B

    @property
    def nbytes(self) -> int:
        return self.A.numel() * self.A.element_size() + self.B.numel() * self.B.element_size()

    def to(self, dtype: torch.dtype) -> "Factors":
        return Factors(self.A.to(dtype), self.B.to(dtype))


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def svd(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of X [..., n, d] in fp32: U [..., n, k], S [..., k], Vh [..., k, d] (k = min(n, d))."""
    return torch.linalg.svd(_f32(X), full_matrices=False)


def trunc(U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor, r: int) -> Factors:
    """Rank-r truncation of a thin SVD: A = U_r S_r [..., n, r], B = Vh_r [..., r, d]."""
    r = min(r, S.shape[-1])
    return Factors(U[..., :r] * S[..., None, :r], Vh[..., :r, :])


def trunc_svd(X: torch.Tensor, r: int) -> Factors:
    """TruncSVD(X, r) of Algorithm 2 (unweighted): the Eckart-Young rank-r factors of X [..., n, d]."""
    return trunc(*svd(X), r)


def query_metric(Q: torch.Tensor, eps: float = 1e-3, q_valid: torch.Tensor | None = None) -> torch.Tensor:
    """C_Q = sum_g Q_g^T Q_g + eps * mean-trace * I.

    Q : [B, H, G, m, d]; q_valid : [B, m] bool (padding queries excluded). Returns C_Q [B, H, d, d] (fp32).
    A head with no valid queries gets the identity metric (plain SVD).
    """
    Qf = _f32(Q)
    if q_valid is not None:
        Qf = Qf * q_valid[:, None, None, :, None].to(Qf.dtype)
    C = torch.einsum("bhgmd,bhgme->bhde", Qf, Qf)
    d = C.shape[-1]
    cbar = torch.diagonal(C, dim1=-2, dim2=-1).sum(-1) / d  # [B, H]
    ridge = torch.where(cbar > 0, eps * cbar, torch.ones_like(cbar))
    eye = torch.eye(d, dtype=C.dtype, device=C.device)
    return C + ridge[..., None, None] * eye


def sqrt_and_inv_sqrt(C: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric PSD square root and its inverse of C [..., d, d] (eigendecomposition, float64 inside)."""
    lam, E = torch.linalg.eigh(C.double())
    lam = lam.clamp_min(lam.amax(-1, keepdim=True) * 1e-12)
    s = lam.sqrt()
    W = (E * s[..., None, :]) @ E.transpose(-1, -2)
    Wi = (E / s[..., None, :]) @ E.transpose(-1, -2)
    return W.to(C.dtype), Wi.to(C.dtype)


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


@dataclass
class LayerFactors:
    """Result of :func:`attention_svd` for one layer: factors plus what chose them."""

    k: Factors                 # A_K [B, H, S, r_K], B_K [B, H, r_K, d]
    v: Factors                 # A_V [B, H, S, r_V], B_V [B, H, r_V, d]
    sk: torch.Tensor           # [B, H, min(S, d)] singular values of the (weighted) keys
    sv: torch.Tensor           # [B, H, min(S, d)] singular values of the (weighted) values
    head_rank_k: torch.Tensor | None  # [B, H] energy-rule ranks before aggregation (None: fixed rule)
    head_rank_v: torch.Tensor | None
    weighted: bool             # False when the unweighted fallback / raw-SVD baseline ran


def attention_svd(K: torch.Tensor, V: torch.Tensor, rank_k: int | None, rank_v: int | None,
                  C_Q: torch.Tensor | None = None, mass: torch.Tensor | None = None,
                  tau: float | None = None, aggregator: str = "max", rank_max: int | None = None,
                  mass_floor: float = 1e-3, key_mass: bool = False) -> LayerFactors:
    """AttentionSVD (Algorithm 2) of one layer's bulk K, V [B, H, S, d].

    C_Q : [B, H, d, d] query metric (None = no key weighting); mass : [B, H, S] per-key attention mass
    (None = no value weighting). With both None this is SVD on raw K/V. ``tau`` selects the energy rule
    (ranks from each weighted matrix's spectrum, reduced over (batch, head) by ``aggregator``);
    otherwise ``rank_k`` / ``rank_v`` are used as given.

    ``key_mass`` (an extension, NOT in the paper's Algorithm 2; off by default): also row-weight the keys
    by sqrt(mass), i.e. factor diag(sqrt a) K C_Q^{1/2}, so the logit error is weighted by how much
    attention each key receives (the two-sided metric is still solved exactly by one SVD).
    """
    Kf, Vf = _f32(K), _f32(V)
    # values (and optionally keys) row-weighted by sqrt(mass + floor * mean mass), un-weighted after truncation
    sa = None
    if mass is not None:
        a = mass.to(Vf.dtype)
        mean = a.mean(-1, keepdim=True)
        a = torch.where(mean > 0, a + mass_floor * mean, torch.ones_like(a))
        sa = a.clamp_min(torch.finfo(a.dtype).tiny).sqrt()
    ska = sa if key_mass and sa is not None else None
    Kin = Kf if ska is None else ska[..., None] * Kf
    # keys in the query metric: factor K W, map back with W^{-1}
    if C_Q is not None:
        W, Wi = sqrt_and_inv_sqrt(C_Q.to(Kf.dtype))
        Uk, Sk, Vhk = svd(Kin @ W)
    else:
        Wi = None
        Uk, Sk, Vhk = svd(Kin)
    Uv, Sv, Vhv = svd(Vf if sa is None else sa[..., None] * Vf)
    hrk = hrv = None
    if tau is not None:
        hrk, hrv = energy_rank(Sk, tau), energy_rank(Sv, tau)
        rank_k = aggregate(hrk, aggregator, rank_max)
        rank_v = aggregate(hrv, aggregator, rank_max)
    if rank_k is None or rank_v is None:
        raise ValueError("attention_svd needs rank_k and rank_v, or tau for the energy rule")
    fk, fv = trunc(Uk, Sk, Vhk, rank_k), trunc(Uv, Sv, Vhv, rank_v)
    if Wi is not None:
        fk = Factors(fk.A, fk.B @ Wi)
    if ska is not None:
        fk = Factors(fk.A / ska[..., None], fk.B)
    if sa is not None:
        fv = Factors(fv.A / sa[..., None], fv.B)
    return LayerFactors(fk, fv, Sk, Sv, hrk, hrv, weighted=C_Q is not None or mass is not None)


# ----------------------------------------------------------------------------- error measures
def logit_error(Q: torch.Tensor, K: torch.Tensor, K_r: torch.Tensor) -> torch.Tensor:
    """Relative logit error ||Q (K - K_r)^T||_F / ||Q K^T||_F. Q [..., m, d], K, K_r [..., S, d] -> [...]."""
    Qf = _f32(Q)
    num = torch.linalg.matrix_norm(Qf @ (_f32(K) - _f32(K_r)).transpose(-1, -2))
    den = torch.linalg.matrix_norm(Qf @ _f32(K).transpose(-1, -2))
    return num / den.clamp_min(1e-30)


def output_error(P: torch.Tensor, V: torch.Tensor, V_r: torch.Tensor) -> torch.Tensor:
    """Relative output error ||P (V - V_r)||_F / ||P V||_F. P [..., m, S], V, V_r [..., S, d] -> [...]."""
    Pf = _f32(P)
    num = torch.linalg.matrix_norm(Pf @ (_f32(V) - _f32(V_r)))
    den = torch.linalg.matrix_norm(Pf @ _f32(V))
    return num / den.clamp_min(1e-30)


def causal_probs(Q: torch.Tensor, K: torch.Tensor, scaling: float | None = None,
                 offset: int = 0) -> torch.Tensor:
    """softmax(Q K^T * scaling) with query i at position offset + i and key j at position j.

    Q [..., m, d], K [..., S, d] -> P [..., m, S] (fp32).
    """
    d = Q.shape[-1]
    scaling = d ** -0.5 if scaling is None else scaling
    logits = (_f32(Q) @ _f32(K).transpose(-1, -2)) * scaling
    m, S = logits.shape[-2:]
    vis = torch.arange(S, device=Q.device)[None, :] <= (torch.arange(m, device=Q.device)[:, None] + offset)
    return torch.softmax(logits.masked_fill(~vis, float("-inf")), dim=-1)
