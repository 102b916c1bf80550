"""Per-head interpretability from one recorded prefill (no calibration, batch row 0).

    effective ranks  r_K(tau) of the query-weighted keys K C_Q^{1/2}, r_V(tau) of the mass-weighted values
                     diag(sqrt a) V, per (layer, KV head), next to the raw K / V ranks
    query subspace   normalised eigenvalue spectrum of C_Q per head (how focused its queries are)
    token saliency   per-key attention mass a_i = sum_q P_qi (sinks and salient tokens)
    factors          top tokens per factor (|U| of the weighted SVD)
    error curves     logit error ||Q(K-K_r)^T|| / ||QK^T|| and output error ||P(V-V_r)|| / ||PV|| vs rank, for
                     the attention-aware and the raw bases of one head
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention_mass import attention_mass
from .basis import attention_svd, causal_probs, logit_error, output_error, query_metric, sqrt_and_inv_sqrt, svd
from .ranks import energy_rank


@dataclass
class HeadView:
    """One (layer, KV head) of a recorded prefill: K, V [S, d]; Q [G, S, d] (its query heads); mass [S]."""

    layer: int
    head: int
    K: torch.Tensor
    V: torch.Tensor
    Q: torch.Tensor
    scaling: float
    mass: torch.Tensor


def head_view(record, layer: int, head: int) -> HeadView:
    K, V = record.keys[layer][0, head].float(), record.values[layer][0, head].float()
    obs = record.obs[layer]
    Qg = obs.grouped(record.keys[layer].shape[1])[0, head].float()            # [G, S, d]
    pos = torch.arange(K.shape[0])
    a = attention_mass(Qg[None, None], K[None, None], obs.scaling, obs.q_pos, pos)[0, 0]
    return HeadView(layer, head, K, V, Qg, obs.scaling, a)


@torch.no_grad()
def effective_ranks(record, tau: float = 0.99) -> dict[str, torch.Tensor]:
    """[L, H] maps: ``rank_k`` / ``rank_v`` (attention-aware) and ``raw_rank_k`` / ``raw_rank_v`` at ``tau``,
    plus ``q_spectrum`` [L, H, d] (normalised eigenvalues of C_Q, descending)."""
    out = {k: [] for k in ("rank_k", "rank_v", "raw_rank_k", "raw_rank_v", "q_spectrum")}
    for li, (K, V, obs) in enumerate(zip(record.keys, record.values, record.obs)):
        H = K.shape[1]
        Qg = obs.grouped(H)
        C = query_metric(Qg, eps=1e-3)                                     # [B, H, d, d]
        mass = attention_mass(Qg, K, obs.scaling, obs.q_pos, torch.arange(K.shape[-2]))
        f = attention_svd(K, V, 1, 1, C_Q=C, mass=mass).info
        raw = attention_svd(K, V, 1, 1).info
        out["rank_k"].append(energy_rank(f.sk, tau)[0])
        out["rank_v"].append(energy_rank(f.sv, tau)[0])
        out["raw_rank_k"].append(energy_rank(raw.sk, tau)[0])
        out["raw_rank_v"].append(energy_rank(raw.sv, tau)[0])
        ev = torch.linalg.eigvalsh(C[0].double()).flip(-1)
        out["q_spectrum"].append((ev / ev.sum(-1, keepdim=True)).float())
    return {k: torch.stack(v) for k, v in out.items()}


@torch.no_grad()
def spectra(h: HeadView) -> dict[str, torch.Tensor]:
    """Normalised singular-value energy (sigma^2 / sum) of raw vs attention-aware K and V for one head."""
    C = query_metric(h.Q[None, None], eps=1e-3)[0, 0]
    W, _ = sqrt_and_inv_sqrt(C)
    sa = (h.mass + 1e-3 * h.mass.mean()).sqrt()
    e = lambda s: (s.double() ** 2 / (s.double() ** 2).sum()).float()
    return {"raw_k": e(svd(h.K)[1]), "aware_k": e(svd(h.K @ W)[1]),
            "raw_v": e(svd(h.V)[1]), "aware_v": e(svd(sa[:, None] * h.V)[1])}


@torch.no_grad()
def reconstructions(h: HeadView, rank: int) -> dict[str, torch.Tensor]:
    """Rank-r K_r / V_r [S, d] of one head with the attention-aware and the raw bases."""
    C = query_metric(h.Q[None, None], eps=1e-3)
    ak, av = attention_svd(h.K[None, None], h.V[None, None], rank, rank, C_Q=C, mass=h.mass[None, None]).dense()
    rk, rv = attention_svd(h.K[None, None], h.V[None, None], rank, rank).dense()
    return {"aware_k": ak[0, 0], "aware_v": av[0, 0], "raw_k": rk[0, 0], "raw_v": rv[0, 0]}


@torch.no_grad()
def error_curves(h: HeadView, ranks: list[int]) -> dict[str, list[float]]:
    """Relative logit and output errors (mean over the group's query heads) vs rank, aware vs raw."""
    P = causal_probs(h.Q, h.K, h.scaling)                                   # [G, S, S]
    out = {"rank": list(ranks), "logit_aware": [], "logit_raw": [], "output_aware": [], "output_raw": []}
    for r in ranks:
        rec = reconstructions(h, r)
        out["logit_aware"].append(float(logit_error(h.Q, h.K, rec["aware_k"]).mean()))
        out["logit_raw"].append(float(logit_error(h.Q, h.K, rec["raw_k"]).mean()))
        out["output_aware"].append(float(output_error(P, h.V, rec["aware_v"]).mean()))
        out["output_raw"].append(float(output_error(P, h.V, rec["raw_v"]).mean()))
    return out


@torch.no_grad()
def attention_rows(h: HeadView, rank: int, query: int = -1) -> dict[str, torch.Tensor]:
    """Attention distribution [S] of one query (first head of the group) with dense, aware and raw keys."""
    rec = reconstructions(h, rank)
    q = h.Q[0, query]
    S = h.K.shape[0]
    upto = S if query == -1 else query + 1
    row = lambda K: torch.softmax((K[:upto] @ q) * h.scaling, -1)
    return {"dense": row(h.K), "aware": row(rec["aware_k"]), "raw": row(rec["raw_k"])}


@torch.no_grad()
def top_tokens(h: HeadView, token_ids: list[int], tok, n_factors: int = 4, k: int = 5,
               which: str = "k") -> list[list[tuple[str, float]]]:
    """For the leading ``n_factors`` attention-aware factors of K (or V): the ``k`` tokens with the largest
    |U| weights and their energy share within the factor."""
    C = query_metric(h.Q[None, None], eps=1e-3)[0, 0]
    if which == "k":
        W, _ = sqrt_and_inv_sqrt(C)
        U = svd(h.K @ W)[0]
    else:
        U = svd((h.mass + 1e-3 * h.mass.mean()).sqrt()[:, None] * h.V)[0]
    out = []
    for j in range(n_factors):
        u2 = U[:, j] ** 2
        top = u2.topk(min(k, u2.numel()))
        out.append([(tok.decode([token_ids[i]]) if tok is not None else str(token_ids[i]), float(v))
                    for v, i in zip(top.values.tolist(), top.indices.tolist())])
    return out
