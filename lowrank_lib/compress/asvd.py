"""ASVD (Yuan et al. 2023, arXiv 2312.05821): activation-aware SVD + Sensitivity-based Truncation Rank Searching.

**Activation-aware transform** (paper §3, "activation-aware SVD"; official ``modules/svd_linear.py``):
W = (W S) S^-1 with S = diag(s), s_j = (sum_samples mean_t |x_tj|)^alpha + 1e-6 (``abs_mean``,
alpha = 0.5); SVD(W S) = U Sigma Vh (EXACT here, so results are deterministic; the original uses
``torch.svd_lowrank``); the inverse scale is absorbed into the right factor, V <- Vh / s;
ALinear = U sqrt(Sigma) [out, r], BLinear = sqrt(Sigma) V [r, in] (``sigma_fuse="UV"``).
Rank r = int(out*in*p) // (in + out) for a parameter ratio p (optionally aligned up to ``rank_align``).

**STRS** (paper §3, "sensitivity-based truncation rank searching"; official ``sensitivity.py`` +
``binary_search.py``), :func:`asvd_sensitivity` and :func:`strs_ratios`:

1. Sensitivity list: for every target Linear and every candidate p in ``PARAM_RATIO_CANDIDATES``
   (0.1 ... 0.9), truncate ONLY that Linear to p and record the perplexity of the calibration tokens.
2. Sort the (layer, p, ppl) entries by ppl, worst first; for a threshold index i, every entry
   from i on is "allowed" and each layer takes the smallest allowed p (1 = stays dense). The
   parameter ratio sum_l numel_l p_l / sum_l numel_l only grows with i; binary-search the LARGEST
   i (least compression) whose ratio is <= the target. (The official loop ends on its last probe,
   which can overshoot the target by one entry; ours always meets it.)

Our sensitivity pass is the same measurement made cheaper, not a proxy: the dense inputs of every
decoder layer are cached once, and truncating a Linear of layer l re-runs only layers l..L-1, the
final norm and the head (bit-identical to a full forward up to float summation order). The list is
cached on disk keyed by a digest of the weights, the calibration tokens, alpha and the candidates.
The search covers the decoder projections (``targets``); the official one also tries ``lm_head``
(tied to the embeddings on SmolLM2, so it cannot be factorized here).

Measured on SmolLM2 (``benchmarks/results/compressors_smollm2_w4x2048_c16x512_asvd.json``; sensitivity on
1 x 256 calibration tokens, candidates 0.1 / 0.3 / 0.5 / 0.7 / 0.9): PPL 101.6 at keep 0.8 and 525 at 0.6,
against 5.6e5 / 3.6e6 with one uniform ratio (dense 20.04; SVD-LLM v1 51.3 / 134.8). At 0.8 the search
leaves 114 of the 210 projections dense and cuts the rest hard.

``compress_asvd(..., keep)`` with ``search="strs"`` (default when ``calib_ids`` is given) runs the
search; ``search="uniform"`` applies p = keep to every matrix (the old behaviour); ``ratios`` /
``ranks`` set them explicitly.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..factorized import LLAMA_PROJ, LowRankLinear, iter_linears, set_module, thin_svd
from .calib import CalibStats
from .common import compress_each

__all__ = ["PARAM_RATIO_CANDIDATES", "asvd_rank", "asvd_scale", "asvd_factors", "sensitivity_key",
           "default_cache_dir", "asvd_sensitivity", "strs_ratios", "param_ratio", "compress_asvd"]

#: the official sensitivity.py candidates (parameter ratio p of one Linear)
PARAM_RATIO_CANDIDATES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)


def asvd_rank(out_f: int, in_f: int, p: float, rank_align: int = 1) -> int:
    r = int(out_f * in_f * p) // (in_f + out_f)
    if rank_align > 1:
        r = math.ceil(r / rank_align) * rank_align
    return max(1, min(r, min(out_f, in_f)))


def asvd_scale(stats: CalibStats, name: str, alpha: float) -> torch.Tensor:
    """s = abs_mean^alpha + 1e-6 [in] float64 (the diagonal of ASVD's S)."""
    return stats[name].abs_mean.double().pow(alpha) + 1e-6


def _scaled_svd(W: torch.Tensor, scale: torch.Tensor):
    return thin_svd(W.double() * scale.double()[None, :])


def _truncate(svd, scale: torch.Tensor, rank: int):
    U, S, Vh = svd
    sq = S[:rank].sqrt()
    return U[:, :rank] * sq, (sq[:, None] * Vh[:rank]) / scale.double()[None, :]


def asvd_factors(W: torch.Tensor, scale: torch.Tensor, rank: int):
    """W [out, in], scale s [in] > 0 -> (U sqrt(S) [out, r], sqrt(S) Vh / s [r, in]) float64."""
    return _truncate(_scaled_svd(W, scale), scale, rank)


# ---------------------------------------------------------------- STRS step 1: the sensitivity list
def _layer_index(name: str) -> int:
    parts = name.split(".")
    return int(parts[parts.index("layers") + 1])


class _TailRunner:
    """Calibration perplexity of ``model`` when only layers >= l changed: the dense inputs of every decoder
    layer (positional and keyword arguments, as the model passed them) are captured once."""

    @torch.no_grad()
    def __init__(self, model, ids: torch.Tensor):
        self.model, self.ids = model, ids
        self.layers = model.model.layers
        self.inputs: list = [None] * len(self.layers)

        def grab(i):
            def pre(mod, args, kwargs):
                self.inputs[i] = (args, dict(kwargs))
            return pre

        hooks = [layer.register_forward_pre_hook(grab(i), with_kwargs=True) for i, layer in enumerate(self.layers)]
        try:
            self.dense_ppl = self._ppl(model(ids, use_cache=False).logits)
        finally:
            for h in hooks:
                h.remove()

    def _ppl(self, logits: torch.Tensor) -> float:
        nll = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), self.ids[:, 1:].reshape(-1))
        return float(torch.exp(nll.double()))

    @torch.no_grad()
    def ppl_from(self, start: int) -> float:
        args, kwargs = self.inputs[start]
        h = args[0]
        for layer in self.layers[start:]:
            out = layer(h, *args[1:], **kwargs)
            h = out[0] if isinstance(out, tuple) else out
        return self._ppl(self.model.lm_head(self.model.model.norm(h)))


def sensitivity_key(model, stats: CalibStats, calib_ids: torch.Tensor, alpha: float, candidates, targets) -> str:
    """Digest of the weights, the activation scales, the calibration tokens and the search settings (the cache key)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    for name, _ in iter_linears(model, targets):
        h.update(stats[name].abs_mean.double().contiguous().numpy().tobytes())
    h.update(calib_ids.to(torch.int64).contiguous().numpy().tobytes())
    h.update(json.dumps([alpha, list(candidates), list(targets)]).encode())
    return h.hexdigest()[:24]


def default_cache_dir() -> Path:
    from ..models import default_cache_dir as root

    return root() / "asvd_sensitivity"


@torch.no_grad()
def asvd_sensitivity(model, stats: CalibStats, calib_ids: torch.Tensor, alpha: float = 0.5,
                     candidates=PARAM_RATIO_CANDIDATES, targets=LLAMA_PROJ, cache_dir: str | Path | bool | None = None,
                     use_cache: bool = True, progress: bool = True) -> dict[str, dict[float, float]]:
    """STRS step 1: ``{linear name: {p: calibration perplexity with only that Linear truncated to p}}``.

    ``calib_ids`` [n, seq]: the tokens whose perplexity is measured (ASVD uses its calibration set).
    The model is left unchanged. Cached under ``cache_dir`` (default ``<lowrank_lib cache>/asvd_sensitivity``)
    as JSON named by :func:`sensitivity_key`; ``use_cache=False`` recomputes (and rewrites) it; ``cache_dir=False``
    neither reads nor writes one.
    """
    candidates = tuple(float(p) for p in candidates)
    path = None
    if cache_dir is not False:
        key = sensitivity_key(model, stats, calib_ids, alpha, candidates, targets)
        path = Path(cache_dir or default_cache_dir()) / f"{key}.json"
        if use_cache and path.exists():
            raw = json.loads(path.read_text())
            return {n: {float(p): v for p, v in d.items()} for n, d in raw["sensitivity"].items()}
    runner = _TailRunner(model, calib_ids)
    lins = list(iter_linears(model, targets))
    out: dict[str, dict[float, float]] = {}
    bar = tqdm(total=len(lins) * len(candidates), desc="ASVD sensitivity", disable=not progress, leave=False)
    try:
        for name, lin in lins:
            if isinstance(lin, LowRankLinear):
                raise ValueError(f"{name} is already factorized; ASVD's search needs the dense model")
            s = asvd_scale(stats, name, alpha)
            svd = _scaled_svd(lin.weight, s)
            start = _layer_index(name)
            out[name] = {}
            try:
                for p in candidates:
                    u, v = _truncate(svd, s, asvd_rank(lin.out_features, lin.in_features, p))
                    b = None if lin.bias is None else lin.bias.detach()
                    dt = lin.weight.dtype
                    set_module(model, name, LowRankLinear(u.to(dt), v.to(dt), b))
                    ppl = runner.ppl_from(start)
                    out[name][p] = ppl if math.isfinite(ppl) else float("inf")
                    bar.update(1)
                    bar.set_postfix(layer=name.split("layers.")[-1], ppl=f"{ppl:.3g}")
            finally:
                set_module(model, name, lin)
    finally:
        bar.close()
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"alpha": alpha, "candidates": list(candidates), "dense_ppl": runner.dense_ppl,
                                    "calib_shape": list(calib_ids.shape),
                                    "sensitivity": {n: {str(p): v for p, v in d.items()} for n, d in out.items()}}))
    return out


# ---------------------------------------------------------------- STRS step 2: the binary search
def strs_ratios(sensitivity: dict[str, dict[float, float]], numels: dict[str, int], target: float) -> dict[str, float]:
    """STRS step 2: per-Linear parameter ratio p (1.0 = dense) with sum numel*p / sum numel <= ``target``.

    Entries sorted by perplexity, worst first; threshold i allows entries[i:]; each Linear takes the
    smallest allowed p. The LARGEST i meeting the target is found by binary search (the ratio is
    monotone in i). If even allowing every entry misses the target, that (most compressed) choice
    is returned.
    """
    entries = sorted(((n, float(p), float(v)) for n, d in sensitivity.items() for p, v in d.items() if p < 1),
                     key=lambda e: -(e[2] if math.isfinite(e[2]) else math.inf))
    total = sum(numels[n] for n in sensitivity)

    def ratios(i: int) -> dict[str, float]:
        r = {n: 1.0 for n in sensitivity}
        for n, p, _ in entries[i:]:
            r[n] = min(r[n], p)
        return r

    def ratio(i: int) -> float:
        return sum(numels[n] * p for n, p in ratios(i).items()) / total

    lo, hi = 0, len(entries)            # invariant: ratio(lo) <= target (or lo == 0); answer in [lo, hi]
    if ratio(0) > target:
        return ratios(0)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if ratio(mid) <= target:
            lo = mid
        else:
            hi = mid - 1
    return ratios(lo)


def param_ratio(ratios: dict[str, float], numels: dict[str, int]) -> float:
    """ASVD's parameter ratio of a choice (nominal: sum numel*p / sum numel, p = 1 for a dense Linear)."""
    return sum(numels[n] * ratios.get(n, 1.0) for n in numels) / sum(numels.values())


# ---------------------------------------------------------------- the compressor
def compress_asvd(model, stats: CalibStats, keep: float, alpha: float = 0.5, targets=LLAMA_PROJ,
                  ratios: dict[str, float] | None = None, rank_align: int = 1, inplace: bool = False,
                  progress: bool = True, ranks: dict[str, int] | None = None, search: str | None = None,
                  calib_ids: torch.Tensor | None = None, candidates=PARAM_RATIO_CANDIDATES,
                  sensitivity: dict | None = None, cache_dir: str | Path | None = None):
    """ASVD at parameter-ratio target ``keep``; returns the factorized model.

    ``search``: ``"strs"`` (the paper's search; needs ``calib_ids`` [n, seq] or a precomputed
    ``sensitivity``), ``"uniform"`` (p = keep everywhere). Default: ``"strs"`` when ``calib_ids`` or
    ``sensitivity`` is given, else ``"uniform"``. ``ratios={name: p}`` / ``ranks={name: r}`` bypass it.
    ``model.lowrank_meta["param_ratio_per_matrix"]`` records the chosen p of every target.
    """
    if search is None:
        search = "strs" if (calib_ids is not None or sensitivity is not None) else "uniform"
    if search not in ("strs", "uniform"):
        raise ValueError(f"search must be 'strs' or 'uniform', got {search!r}")
    if ratios is None and ranks is None and search == "strs":
        if sensitivity is None:
            if calib_ids is None:
                raise ValueError("ASVD's STRS needs calib_ids (the calibration tokens) or a sensitivity list")
            sensitivity = asvd_sensitivity(model, stats, calib_ids, alpha, candidates, targets, cache_dir,
                                           progress=progress)
        numels = {n: lin.weight.numel() for n, lin in iter_linears(model, targets)}
        ratios = strs_ratios(sensitivity, numels, keep)

    def fn(name, lin):
        s = asvd_scale(stats, name, alpha)
        if ranks is not None:
            return asvd_factors(lin.weight, s, ranks[name])
        p = keep if ratios is None else ratios.get(name)
        if p is None or p >= 1.0:
            return None  # stays dense, as ASVD leaves p = 1 layers
        return asvd_factors(lin.weight, s, asvd_rank(lin.out_features, lin.in_features, p, rank_align))

    meta = {"family": "asvd", "keep": keep, "alpha": alpha, "search": "explicit" if ranks is not None else search,
            "shared_groups": []}
    if ratios is not None:
        meta["param_ratio_per_matrix"] = dict(ratios)
    return compress_each(model, fn, meta, targets, inplace, "asvd", progress)
