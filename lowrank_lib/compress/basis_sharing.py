"""Basis Sharing (Wang et al., ICLR'25): consecutive layers share one basis per projection type.

For a group g of G layers and a shared type t (q, k, v, up, gate for Llama; o and down stay
per layer): A = sum_{l in g} X_l^T X_l, S = chol(A)^T (float64, shift fallback 7e-6),
Wcat = [W_1^T | ... | W_G^T] [in, out*G], SVD(S Wcat) = U Sigma Vh and, with
nb = floor(in*out*G*keep / (in + out*G)):

    basis        = (S^-1 U_nb Sigma_nb)^T     [nb, in]   ALL of Sigma lives here (V side)
    coefficient_l = Vh_nb[:, l-th slice]^T    [out, nb]  orthonormal columns (U side)

In the ONE representation each layer's ``LowRankLinear`` has ``U = coefficient_l`` and
``V = basis``, the basis being ONE ``nn.Parameter`` object referenced by the G modules.
"""
from __future__ import annotations

import torch
from torch import nn
from tqdm.auto import tqdm

from ..factorized import LLAMA_PARENT as PARENT
from ..factorized import LLAMA_PROJ, LowRankLinear, replace_with_factors, thin_svd
from ..ranks import basis_sharing_num_basis
from .calib import CalibStats, cholesky_lower
from .common import copy_for_factors

__all__ = ["SHARED_LLAMA", "layer_groups", "shared_basis", "compress_basis_sharing"]

SHARED_LLAMA = ("q_proj", "k_proj", "v_proj", "up_proj", "gate_proj")


def layer_groups(n_layers: int, group_size: int) -> list[list[int]]:
    """Consecutive groups [[0,1],[2,3],...]; a remainder becomes its own (smaller) group."""
    return [list(range(i, min(i + group_size, n_layers))) for i in range(0, n_layers, group_size)]


def shared_basis(Ws: list[torch.Tensor], A: torch.Tensor, keep: float,
                 num_basis: int | None = None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Ws: G matrices [out, in]; A [in, in] summed Gram. Returns basis [nb, in], coefficients [out, nb] each."""
    out_f, in_f = Ws[0].shape
    G = len(Ws)
    nb = num_basis if num_basis is not None else basis_sharing_num_basis(in_f, out_f, G, keep)
    nb = max(1, min(nb, in_f, out_f * G))
    S = cholesky_lower(A, eps=7e-6).T                                  # upper, S^T S = A
    Wcat = torch.cat([W.double().T for W in Ws], dim=1)                # [in, out*G]
    U, Sig, Vh = thin_svd(S @ Wcat)
    basis = torch.linalg.solve_triangular(S, U[:, :nb] * Sig[:nb], upper=True)  # S^-1 U Sigma [in, nb]
    coefs = [Vh[:nb, j * out_f:(j + 1) * out_f].T for j in range(G)]   # [out, nb]
    return basis.T, coefs


def compress_basis_sharing(model, stats: CalibStats, keep: float, group_size: int = 2,
                           shared: tuple[str, ...] = SHARED_LLAMA, targets=LLAMA_PROJ, inplace: bool = False,
                           progress: bool = True, num_basis: int | None = None):
    """Basis Sharing at canonical ``keep`` (= 1 - compression_ratio/100) with groups of ``group_size``.

    ``num_basis`` overrides the formula (clamped to [1, min(in, out*G)]; a large value is exact).
    ``model.lowrank_meta`` gets ``groups`` ({type: [[layers]]}) and ``num_basis`` ({type: nb}).
    """
    n_layers = model.config.num_hidden_layers
    new: dict[str, LowRankLinear] = {}
    groups_meta, nb_meta, shared_names = {}, {}, []
    for typ in tqdm([t for t in LLAMA_PROJ if t in targets], desc="basis sharing", disable=not progress, leave=False):
        groups = layer_groups(n_layers, group_size if typ in shared else 1)
        groups_meta[typ.replace("_proj", "")] = groups
        for g in groups:
            names = [f"model.layers.{i}.{PARENT[typ]}.{typ}" for i in g]
            lins = [model.get_submodule(n) for n in names]
            A = sum(stats[n].xtx for n in names)
            basis, coefs = shared_basis([lin.weight for lin in lins], A, keep, num_basis)
            dt = lins[0].weight.dtype
            V = nn.Parameter(basis.to(dt).contiguous(), requires_grad=False)
            for n, lin, c in zip(names, lins, coefs):
                b = None if lin.bias is None else lin.bias.detach().clone()
                new[n] = LowRankLinear(c.to(dt).contiguous(), V, b)
            nb_meta[typ.replace("_proj", "")] = basis.shape[0]
            if len(names) > 1:
                shared_names.append([f"{n}.V" for n in names])
    meta = {"family": "basis_sharing", "keep": keep, "group_size": group_size, "groups": groups_meta,
            "num_basis": nb_meta, "shared_groups": shared_names}
    return replace_with_factors(model if inplace else copy_for_factors(model, new), new, meta)
