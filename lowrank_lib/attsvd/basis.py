"""Attention-aware low-rank factorization of one layer's K/V (Algorithm 2 of the AttSVD paper).

Pure functions on tensors; nothing here knows about transformers or the runtime. Layout conventions:

    K, V : [B, H, S, d]       post-RoPE keys / values of H key-value heads (as a cache holds them)
    Q    : [B, H, G, m, d]    post-RoPE queries, grouped by the KV head they read (G = query heads per
                              KV head; query head h*G + g reads KV head h, as ``repeat_kv`` lays them out)
    factors A [B, H, S, r], B [B, H, r, d]   with   K_r = A @ B  (per batch row and KV head)

Keys are truncated in the query metric C_Q = Q^T Q + eps * (tr(Q^T Q) / d) * I (summed over the G query
heads of a group), which minimises the logit error ||Q (K - K_r)^T||_F (Eq. 3); values are row-weighted by
the per-key attention mass a_i = sum_q P_qi (+ floor), which minimises sum_i a_i ||V_i - (V_r)_i||^2 (Eq. 4).
All SVDs run in fp32 (float64 inputs stay float64); factors are returned in fp32/float64 and cast by the
caller. :func:`compress_prefill` is the one entry every path calls (transformers cache, engine store,
evaluation): prefill K, V, Q -> :class:`~lowrank_lib.attsvd.kv.LowRankKV`.
"""
from __future__ import annotations

import torch

from ..attention_mass import attention_mass
from .config import AttSVDConfig
from .kv import LowRankKV, Spectra
from .ranks import aggregate, energy_rank


def _f32(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def svd(X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD of X [..., n, d] in fp32: U [..., n, k], S [..., k], Vh [..., k, d] (k = min(n, d))."""
    return torch.linalg.svd(_f32(X), full_matrices=False)


def trunc(U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank-r truncation of a thin SVD: (A = U_r S_r [..., n, r], B = Vh_r [..., r, d])."""
    r = min(r, S.shape[-1])
    return U[..., :r] * S[..., None, :r], Vh[..., :r, :]


def trunc_svd(X: torch.Tensor, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """TruncSVD(X, r) of Algorithm 2 (unweighted): the Eckart-Young rank-r factors (A, B) of X [..., n, d]."""
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


def attention_svd(K: torch.Tensor, V: torch.Tensor, rank_k: int | None, rank_v: int | None,
                  C_Q: torch.Tensor | None = None, mass: torch.Tensor | None = None,
                  tau: float | None = None, aggregator: str = "max", rank_max: int | None = None,
                  mass_floor: float = 1e-3, key_mass: bool = False) -> LowRankKV:
    """AttentionSVD (Algorithm 2) of one layer's bulk K, V [B, H, S, d] -> one factored run.

    Returns a :class:`LowRankKV` with ONE run (A_K [B, H, S, r_K], B_K [B, H, r_K, d], A_V, B_V, fp32) and
    no exact rows; ``info`` holds the spectra and the energy-rule ranks that chose r_K, r_V.

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
    (ak, bk), (av, bv) = trunc(Uk, Sk, Vhk, rank_k), trunc(Uv, Sv, Vhv, rank_v)
    if Wi is not None:
        bk = bk @ Wi
    if ska is not None:
        ak = ak / ska[..., None]
    if sa is not None:
        av = av / sa[..., None]
    info = Spectra(Sk, Sv, hrk, hrv, weighted=C_Q is not None or mass is not None)
    return LowRankKV([(ak, bk, av, bv)], info=info)


def compress_prefill(K: torch.Tensor, V: torch.Tensor, Q: torch.Tensor | None, config: AttSVDConfig,
                     valid: torch.Tensor | None = None, scaling: float | None = None,
                     q_pos: torch.Tensor | None = None) -> LowRankKV:
    """Compress one layer's prefill: factor the bulk (all but the newest ``config.window`` tokens), keep the
    window exact. Every path calls this: the transformers cache, the engine store, evaluation.

    Parameters
    ----------
    K, V : [B, H, S, d] post-RoPE prefill keys / values.
    Q : [B, Hq, m, d] post-RoPE queries of the last m prefill positions (m = S at a prefill), or None:
        then the attention-aware weighting is skipped (the unweighted fallback of Algorithm 2; the
        caller warns when it expected queries).
    config : rank rule, window, weighting switches (:class:`~lowrank_lib.attsvd.config.AttSVDConfig`).
    valid : [B, S] bool, False at left-pad slots (None: all real). Padded keys get no attention mass and
        are zeroed before factoring, so they take no rank.
    scaling : softmax scale of the attention (default 1/sqrt(d)); q_pos : [m] query positions
        (default the last m of S).

    Returns
    -------
    LowRankKV with one run (the factored bulk, in K's dtype) when S > window, and the window's exact
    rows (a copy, so the prefill tensors can be freed); ``info`` = the spectra that chose the ranks.
    """
    B, H, S, d = K.shape
    nb = max(0, S - config.window)
    if nb == 0:
        return LowRankKV([], K, V).validate()
    Kb, Vb = K[:, :, :nb], V[:, :, :nb]
    C_Q = mass = k_valid = None
    if config.attention_aware and Q is not None:
        Bq, Hq, m, dq = Q.shape
        if Hq % H or dq != d or Bq != B:
            raise ValueError(f"compress_prefill: queries {tuple(Q.shape)} [B, Hq, m, d] do not fit keys "
                             f"{tuple(K.shape)} [B, H, S, d] (Hq a multiple of H, same B and d)")
        Qg = Q.view(B, H, Hq // H, m, d)                                   # [B, H, G, m, d]
        q_pos = torch.arange(S - m, S, device=K.device) if q_pos is None else q_pos
        q_valid = None if valid is None else valid[:, -m:]
        if config.obs_window is not None and m > config.obs_window:
            Qg = Qg[..., -config.obs_window:, :]
            q_pos = q_pos[-config.obs_window:]
            q_valid = None if q_valid is None else q_valid[:, -config.obs_window:]
        k_valid = valid
        C_Q = query_metric(Qg, config.eps, q_valid)
        scale = d ** -0.5 if scaling is None else scaling
        mass = attention_mass(Qg, K, scale, q_pos, torch.arange(S, device=K.device), q_valid, k_valid)[..., :nb]
    if k_valid is not None:   # padding rows are never attended: zero them so they take no rank
        kv = k_valid[:, None, :nb, None].to(Kb.dtype)
        Kb, Vb = Kb * kv, Vb * kv
    rk = rv = None
    if not config.dynamic:
        rk, rv = config.fixed_ranks(d)
    bulk = attention_svd(Kb, Vb, rk, rv, C_Q=C_Q, mass=mass, tau=config.tau, aggregator=config.aggregator,
                         rank_max=config.rank_max, mass_floor=config.mass_floor, key_mass=config.key_mass)
    run = tuple(t.to(K.dtype) for t in bulk.runs[0])
    return LowRankKV([run], K[:, :, nb:].clone(), V[:, :, nb:].clone(), bulk.info).validate()


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
