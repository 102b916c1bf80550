"""Quality sweeps: perplexity of a compressor across keep ratios, with parameter counts (``bench sweep``)."""
from __future__ import annotations

import gc
from typing import Callable, Iterable

from tqdm.auto import tqdm

from ..factorized import account
from .perplexity import perplexity


def ppl_vs_keep(model, ids, keeps: Iterable[float], compress: Callable | None = None, seq_len: int = 2048,
                max_windows: int | None = None, include_dense: bool = True, progress: bool = True,
                method: str = "svd") -> list[dict]:
    """Rows ``{method, keep, ppl, nll, params, linear_params, linear_keep, tokens, windows}``.

    ``compress(model, keep) -> factorized copy`` defaults to plain truncated SVD
    (:func:`lowrank_lib.compress.compress_svd`). The dense model is the ``keep=1.0, method="dense"`` row.
    The model is never modified; each compressed copy is freed before the next.
    """
    from ..compress.svd import SVDSpectra, compress_svd

    if compress is None:  # one SVD per matrix for the whole sweep
        spectra = SVDSpectra(model, progress=progress)
        compress = lambda m, k: compress_svd(m, k, spectra=spectra)  # noqa: E731
    rows = []
    keeps = list(keeps)
    todo = ([("dense", None)] if include_dense else []) + [(method, k) for k in keeps]
    for name, keep in tqdm(todo, desc="keep sweep", disable=not progress):
        m = model if keep is None else compress(model, keep)
        r = perplexity(m, ids, seq_len=seq_len, max_windows=max_windows, progress=progress,
                       desc=f"{name} keep={keep if keep is not None else 1.0}")
        acc = account(m)
        rows.append({"method": name, "keep": 1.0 if keep is None else keep, "ppl": r.ppl, "nll": r.nll,
                     "params": acc.total_params, "linear_params": acc.linear_params,
                     "linear_keep": acc.linear_keep, "tokens": r.tokens, "windows": r.windows,
                     "seq_len": seq_len})
        if m is not model:
            del m
            gc.collect()
    return rows


def sensitivity_by_type(model, ids, rank_frac: float = 0.9, seq_len: int = 512, max_windows: int = 2,
                        progress: bool = True, spectra=None) -> dict[str, float]:
    """Perplexity when ONLY one projection type is truncated to ``rank_frac`` of its full rank.

    Answers "which matrices break plain SVD?": ``{"dense": ppl, "q_proj": ppl, ...}``. The other
    projections stay dense (exact), so each entry isolates one type.
    """
    import copy

    from ..compress.svd import SVDSpectra
    from ..factorized import LLAMA_PROJ, replace_with_factors

    spectra = spectra or SVDSpectra(model, progress=progress)
    out = {"dense": perplexity(model, ids, seq_len=seq_len, max_windows=max_windows, progress=False).ppl}
    for t in tqdm(LLAMA_PROJ, desc="types", disable=not progress):
        names = [n for n in spectra.svd if n.rsplit(".", 1)[-1] == t]
        ranks = {n: max(1, int(rank_frac * min(spectra.svd[n][0].shape[0], spectra.svd[n][2].shape[1])))
                 for n in names}
        facs = spectra.factors(ranks=ranks)
        m = replace_with_factors(copy.deepcopy(model), facs)
        out[t] = perplexity(m, ids, seq_len=seq_len, max_windows=max_windows, progress=False).ppl
        del m
    return out
