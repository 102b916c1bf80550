"""Dobi-SVD (Wang et al., ICLR'25): stored forms and an activation-energy rank rule.

What the paper's method is, and what of it this module reproduces without training (issue 31)
---------------------------------------------------------------------------------------------
Dobi-SVD has three parts (paper §3; official code ``svd_trainer.py``, ``weight_updater.py``,
``modules/remapping.py``):

1. **Differentiable truncation search (needs training).** Every Linear gets a truncation value gamma,
   applied as the soft mask T_i = 0.5 tanh(beta (gamma - i)) + 0.5 (beta = 10) on the singular values of
   its activations A = X W^T; the gammas are trained by gradient descent on the LM loss plus a penalty
   pulling the parameter ratio to ``target_ratio`` (256 x 2048 WikiText-2 tokens, back-propagation
   through the SVD). This is a training run; we do NOT reproduce it. Instead the ranks come from the
   documented rule below (a global activation-energy threshold). Consequence: our ranks, and hence our
   perplexities, are not the paper's; the released gammas (``best_gamma.json``) are not derivable here.
   Dobi checkpoints that carry the paper's trained ranks are read exactly by :mod:`lowrank_lib.formats.dobi`.
2. **Weight update from the activations (training-free, reproduced).** W_new = P_k P_k^T W with P the
   principal directions of A (the paper: IncrementalPCA over the calibration activations; here the exact
   eigen-decomposition of A^T A = W X^T X W^T from the same statistics, a hard mask instead of the soft one
   at the trained gamma). Same projection for the same data, up to IPCA's streaming approximation.
3. **Remapping storage (training-free, reproduced byte for byte).** The 8-bit bitsandbytes dynamic-map
   quantisation of the first min(m, n) entries of each component plus the fp16 tail, with the
   k * max(m, n) budget that lets a remapped model keep more ranks at the same bytes.

So "Dobi-SVD" rows measured with this compressor are Dobi's update + storage at energy-rule ranks; the
gain that the paper attributes to the learned ranks is not in them.

The rank rule
-------------
For each Linear W [m, n] let A = X W^T (its outputs on calibration data)
and lambda_1 >= ... the eigenvalues of A^T A = W (X^T X) W^T. Matrix i keeps the smallest k_i
whose energy fraction sum_{j<=k} lambda_j / sum lambda reaches a global threshold tau; tau is
bisected so that sum_i k_i * cost_i <= keep * sum_i m_i n_i (cost = m + n for the no-remap
factors, max(m, n) for the remap storage), i.e. ``keep`` is Dobi's ``target_ratio`` over all
Linear parameters.

The weight update is Dobi's with a hard mask: W_new = P_k P_k^T W, P the top-k eigenvectors of
A^T A (the activation principal directions), then factored by an exact SVD:
``ALinear`` = sqrt(S) Vh [k, n] (applied first), ``BLinear`` = U sqrt(S) [m, k]; stored fp16.

Remap form: W_new = U S Vh with k components; Sigma goes on U when m >= n, on Vh when m < n; the
first min(m, n) entries of each component are 8-bit quantised with bitsandbytes' signed dynamic
map (re-implemented in :mod:`lowrank_lib.codecs`, shared with the readers), the rest
("tuple_info" tail) stays fp16. :func:`remap_encode` and :func:`remap_decode` are exact inverses on
decoded data; the in-memory model holds the decoded fp16 factors and keeps the codes on the module
(``module.dobi_remap``) so a writer reproduces the same bytes.
"""
from __future__ import annotations

import torch

from ..codecs import dequantize_rows, dynamic_map, quantize_rows, remap_decode, remap_encode  # noqa: F401 (re-export)
from ..factorized import LLAMA_PROJ, iter_linears, thin_svd
from .calib import CalibStats
from .common import BoundedCache, compress_each


def _activation_eig(W: torch.Tensor, xtx: torch.Tensor):
    """Eigen-decomposition of W X^T X W^T [m, m], descending: (lambda [m], P [m, m])."""
    Wd = W.double()
    lam, P = torch.linalg.eigh(Wd @ xtx.double() @ Wd.T)
    return lam.flip(0).clamp_min(0), P.flip(1)


def energy_ranks(spectra: dict[str, torch.Tensor], shapes: dict[str, tuple[int, int]], keep: float,
                 remap: bool) -> dict[str, int]:
    """Global energy threshold tau (bisected) -> per-matrix ranks within the parameter budget."""
    cum = {n: (s.cumsum(0) / s.sum().clamp_min(1e-300)) for n, s in spectra.items()}
    cost = {n: (max(m, k) if remap else m + k) for n, (m, k) in shapes.items()}
    budget = keep * sum(m * k for m, k in shapes.values())

    def ranks(tau):
        out = {}
        for n, c in cum.items():
            cap = min(shapes[n])
            out[n] = max(1, min(cap, int(torch.searchsorted(c, torch.tensor(tau, dtype=c.dtype)).item()) + 1))
        return out

    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(r * cost[n] for n, r in ranks(mid).items()) <= budget:
            lo = mid
        else:
            hi = mid
    return ranks(lo)


def compress_dobi(model, stats: CalibStats, keep: float, remap: bool = False, targets=LLAMA_PROJ,
                  inplace: bool = False, progress: bool = True):
    """Dobi-SVD factors (no-remap) or decoded remap factors at ``target_ratio`` = ``keep``; fp16-valued.

    Factor dtype follows the model (fp32 models hold fp16-rounded values, as Dobi stores fp16).
    """
    spectra, shapes = {}, {}
    vectors = BoundedCache()        # each matrix's eigenvectors [m, m], made again if they did not all fit
    for name, lin in iter_linears(model, targets):
        spectra[name], P = _activation_eig(lin.weight, stats[name].xtx)
        vectors.put(name, P)
        shapes[name] = (lin.out_features, lin.in_features)
    ranks = energy_ranks(spectra, shapes, keep, remap)
    codes = {}

    def fn(name, lin):
        k = ranks[name]
        P = vectors.get(name, lambda: _activation_eig(lin.weight, stats[name].xtx)[1])
        Pk = P[:, :k]                                              # [m, k]
        U2, S, Vh = thin_svd(Pk.T @ lin.weight.double())          # W_new = Pk U2 S Vh
        U = Pk @ U2
        m, n = shapes[name]
        if not remap:
            sq = S.sqrt()
            return (U * sq).half().double(), (sq[:, None] * Vh).half().double()
        US, VT = (U * S, Vh) if m >= n else (U, S[:, None] * Vh)
        codes[name] = remap_encode(US, VT)
        return tuple(t.double() for t in remap_decode(codes[name]))

    meta = {"family": "dobi-remap" if remap else "dobi", "keep": keep, "rank_rule": "activation-energy",
            "shared_groups": []}
    out = compress_each(model, fn, meta, targets, inplace, "dobi", progress)
    for name, entry in codes.items():
        out.get_submodule(name).dobi_remap = entry
    return out


def compress_dobi_remap(model, stats: CalibStats, keep: float, **kw):
    """:func:`compress_dobi` with ``remap=True``: the remap storage form (8-bit codes kept on each module)."""
    return compress_dobi(model, stats, keep, remap=True, **kw)
