"""Quality sweeps: perplexity of a compressor across keep ratios, with parameter counts."""
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


def main(argv: list[str] | None = None) -> int:
    """``python -m lowrank_lib.eval.sweep``: plain-SVD perplexity table (dense + keeps), JSON + table."""
    import argparse
    import json
    import platform
    import sys
    import time
    from pathlib import Path

    import torch

    from .. import models
    from ..data import tokens

    ap = argparse.ArgumentParser(prog="python -m lowrank_lib.eval.sweep", description=main.__doc__)
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.9, 0.8, 0.6])
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--windows", type=int, default=16, help="first N windows of WikiText-2 test (0 = all)")
    ap.add_argument("--sensitivity", type=float, default=None, metavar="RANK_FRAC",
                    help="instead: PPL with only one projection type truncated to RANK_FRAC of full rank")
    ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/ppl_svd_<model>_w<N>x<L>.json)")
    a = ap.parse_args(argv)
    t0 = time.time()
    model, tok = models.load(a.model)
    ids = tokens(tok, "test")
    win = a.windows or None
    info = {"command": "python -m lowrank_lib.eval.sweep " + " ".join(argv or sys.argv[1:]), "model": a.model,
            "seq_len": a.seq_len, "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    if a.sensitivity is not None:
        res = sensitivity_by_type(model, ids, a.sensitivity, seq_len=a.seq_len, max_windows=win)
        for k, v in res.items():
            print(f"{k:>10} {v:12.3f}")
        default_name = f"svd_sensitivity_{a.model}_r{a.sensitivity}_w{a.windows}x{a.seq_len}.json"
        info.update(rank_frac=a.sensitivity, windows=a.windows, ppl=res)
    else:
        rows = ppl_vs_keep(model, ids, a.keeps, seq_len=a.seq_len, max_windows=win)
        print(f"{'method':>6} {'keep':>5} {'ppl':>12} {'params (M)':>10} {'proj kept':>9}")
        for r in rows:
            print(f"{r['method']:>6} {r['keep']:5.2f} {r['ppl']:12.3f} {r['params'] / 1e6:10.2f} "
                  f"{r['linear_keep']:9.3f}")
        default_name = f"ppl_svd_{a.model}_w{a.windows}x{a.seq_len}.json"
        info.update(windows=rows[0]["windows"], test_tokens_total=int(ids.numel()), rows=rows)
    out = Path(a.out) if a.out else (models.repo_root() or Path(".")) / "benchmarks" / "results" / default_name
    out.parent.mkdir(parents=True, exist_ok=True)
    info["wall_s"] = round(time.time() - t0, 1)
    out.write_text(json.dumps(info, indent=2))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
