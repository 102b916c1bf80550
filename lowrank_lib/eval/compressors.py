"""Compressors against their papers on one protocol (issue 31): SVD-LLM v1 / v2 taken apart, ASVD uniform vs its STRS
search. ``bench compressors`` parses its options into :class:`CompressorsConfig` and calls :func:`measure`.

    python -m lowrank_lib.bench compressors --threads 1                        # SmolLM2, keep 0.8 / 0.6
    python -m lowrank_lib.bench compressors --model tiny-smol --windows 1 --prompt-len 128 --calib-samples 2

:func:`compress_at_shape` (``bench compress-memory``, one child per method) times calibration and a compressor on a
random model of a real geometry, for their memory at 1B / 7B shape.

Variants (all on the SAME calibration statistics and evaluation windows, in memory, fp32):

* ``svdllm_v1``           v1: Cholesky whitening, uniform rank rule
* ``svdllm_v2_uniform``   v2's loss-optimised truncation at v1's uniform ranks (v2's truncation alone)
* ``svdllm_v1_v2alloc``   v1's truncation at v2's heterogeneous ranks (v2's allocation alone)
* ``svdllm_v2``           full v2 (allocation + truncation), losses in the paper's token units (the default)
* ``svdllm_v2_raw``       full v2 with raw losses (our calibration's token count; the compressor before issue 31)
* ``asvd_uniform``        ASVD with p = keep on every matrix
* ``asvd_strs``           ASVD with its sensitivity-based truncation rank search (sensitivity on the first
                          ``asvd_calib`` = (samples, tokens) of the calibration set; cached)

Besides perplexity the JSON holds, per keep, the per-matrix truncation loss ||(W - W_r) X||_F that v1 and v2
reach at the same rank relative to the theoretical minimum (float64 and rounded to the model dtype), v2's
per-type keep ranges and ASVD's chosen parameter ratios.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

__all__ = ["CompressorsConfig", "VARIANTS", "format_table", "measure"]

VARIANTS = ("svdllm_v1", "svdllm_v2_uniform", "svdllm_v1_v2alloc", "svdllm_v2", "svdllm_v2_raw", "asvd_uniform",
            "asvd_strs")


@dataclass
class CompressorsConfig:
    """One comparison: ``variants`` at every keep of ``keeps``, the same calibration and windows for all."""

    model: str = "smollm2"
    keeps: tuple[float, ...] = (0.8, 0.6)
    variants: tuple[str, ...] = VARIANTS
    windows: int = 4                            # first N windows of WikiText-2 test
    seq_len: int = 2048                         # perplexity window tokens
    calib_samples: int = 16
    calib_len: int = 512                        # tokens per calibration sample
    asvd_calib: tuple[int, int] = (2, 256)      # ASVD's sensitivity: the first SAMPLES samples, TOKENS each
    asvd_candidates: tuple[float, ...] | None = None   # parameter ratios ASVD tries (None: the paper's)
    loss_table: bool = True                     # the per-matrix truncation-loss comparison


def _summary(table: dict) -> dict:
    import statistics

    out = {}
    for col in ("v1", "v2", "v1_rounded", "v2_rounded"):
        rel = [row[col] / row["minimum"] - 1 for row in table.values() if row["minimum"] > 0]
        out[col] = {"max_rel_excess": max(rel), "median_rel_excess": statistics.median(rel)}
    out["v2_le_v1_rounded"] = sum(row["v2_rounded"] <= row["v1_rounded"] for row in table.values())
    out["matrices"] = len(table)
    return out


def _by_type(values: dict[str, float]) -> dict[str, dict]:
    from ..compress.common import leaf

    groups: dict[str, list[float]] = {}
    for name, v in values.items():
        groups.setdefault(leaf(name), []).append(float(v))
    return {t: {"min": min(v), "max": max(v), "mean": sum(v) / len(v), "per_layer": [round(x, 4) for x in v]}
            for t, v in groups.items()}


def measure(a: CompressorsConfig, progress: bool = True, on_row=None) -> dict:
    """Every variant at every keep; ``on_row(result_so_far)`` after each finished row."""
    import platform

    from .. import models
    from ..compress.asvd import PARAM_RATIO_CANDIDATES, asvd_sensitivity, compress_asvd, param_ratio
    from ..compress.calib import calibration_data, collect_stats
    from ..compress.svdllm import (PAPER_CALIB_TOKENS, compress_svdllm, compress_svdllm_v2, truncation_loss_table,
                                   v2_keep_ratios, v2_ranks)
    from ..factorized import account, iter_linears
    from ..host import load_average
    from .perplexity import perplexity
    from .quality import QualityConfig, eval_tokens

    seq = a.seq_len
    torch.manual_seed(0)
    model, tok = models.load(a.model)
    ids = eval_tokens(model, tok, QualityConfig(model=a.model, seq_len=seq, max_windows=a.windows))
    t0 = time.perf_counter()
    calib = calibration_data(tok, a.calib_samples, a.calib_len, 0, model.config.vocab_size)
    stats = collect_stats(model, calib, progress=progress)
    calib_s = time.perf_counter() - t0
    asvd_ids = calib[:a.asvd_calib[0], :a.asvd_calib[1]]
    cands = tuple(a.asvd_candidates or PARAM_RATIO_CANDIDATES)

    def ppl(m, desc):
        return perplexity(m, ids, seq_len=seq, max_windows=a.windows, progress=progress, desc=desc).ppl

    res = {"protocol": {"model": a.model, "eval": f"WikiText-2 test, first {a.windows} windows of {seq} tokens",
                        "calibration": f"WikiText-2 valid, {a.calib_samples} x {a.calib_len} tokens, seed 0",
                        "asvd_sensitivity_tokens": list(asvd_ids.shape), "asvd_candidates": list(cands),
                        "v2_loss_tokens": PAPER_CALIB_TOKENS, "dtype": str(model.dtype),
                        "in_memory": True, "calib_seconds": round(calib_s, 1)},
           "host": {"node": platform.node(), "machine": platform.machine(), "processor": platform.processor(),
                    "torch": torch.__version__, "threads": torch.get_num_threads(), "load_average": load_average()},
           "dense": {"ppl": ppl(model, "dense"), "linear_params": account(model).linear_params},
           "rows": [], "truncation_loss": {}, "v2_keep_by_type": {}, "asvd_strs": {}}
    numels = {n: lin.weight.numel() for n, lin in iter_linears(model)}
    sens = None
    for keep in a.keeps:
        if a.loss_table and {"svdllm_v1", "svdllm_v2_uniform"} & set(a.variants):
            res["truncation_loss"][str(keep)] = _summary(truncation_loss_table(model, stats, keep))
        if {"svdllm_v2", "svdllm_v1_v2alloc"} & set(a.variants):
            res["v2_keep_by_type"][str(keep)] = _by_type(v2_keep_ratios(model, stats, keep))
        if "svdllm_v2_raw" in a.variants:
            res["v2_keep_by_type"][f"{keep}_raw"] = _by_type(v2_keep_ratios(model, stats, keep, loss_tokens=None))
        for var in a.variants:
            t1 = time.perf_counter()
            if var == "svdllm_v1":
                cm = compress_svdllm(model, stats, keep, progress=False)
            elif var == "svdllm_v1_v2alloc":
                cm = compress_svdllm(model, stats, keep, ranks=v2_ranks(model, stats, keep), progress=False)
            elif var == "svdllm_v2_uniform":
                cm = compress_svdllm_v2(model, stats, keep, allocation="uniform", progress=False)
            elif var == "svdllm_v2":
                cm = compress_svdllm_v2(model, stats, keep, progress=False)
            elif var == "svdllm_v2_raw":
                cm = compress_svdllm_v2(model, stats, keep, loss_tokens=None, progress=False)
            elif var == "asvd_uniform":
                cm = compress_asvd(model, stats, keep, search="uniform", progress=False)
            else:
                if sens is None:
                    ts = time.perf_counter()
                    sens = asvd_sensitivity(model, stats, asvd_ids, candidates=cands, progress=progress)
                    res["protocol"]["asvd_sensitivity_seconds"] = round(time.perf_counter() - ts, 1)
                cm = compress_asvd(model, stats, keep, sensitivity=sens, progress=False)
                ratios = cm.lowrank_meta["param_ratio_per_matrix"]
                res["asvd_strs"][str(keep)] = {"param_ratio": param_ratio(ratios, numels),
                                               "dense_matrices": sum(p >= 1 for p in ratios.values()),
                                               "p_by_type": _by_type(ratios)}
            comp_s = time.perf_counter() - t1
            acc = account(cm)
            row = {"variant": var, "keep": keep, "ppl": ppl(cm, f"{var}@{keep}"), "linear_params": acc.linear_params,
                   "linear_keep": acc.linear_keep, "total_params": acc.total_params, "compress_s": round(comp_s, 1)}
            res["rows"].append(row)
            if on_row is not None:
                on_row(res)
            if progress:
                print(f"{var:20s} keep {keep}: ppl {row['ppl']:.2f}  linear keep {row['linear_keep']:.4f}", flush=True)
            del cm
    return res


def format_table(res: dict) -> str:
    keeps = sorted({r["keep"] for r in res["rows"]}, reverse=True)
    lines = ["| variant | " + " | ".join(f"keep {k}: PPL (linear keep)" for k in keeps) + " |",
             "|---|" + "---|" * len(keeps), f"| dense | {res['dense']['ppl']:.2f} |" + " |" * (len(keeps) - 1)]
    for var in dict.fromkeys(r["variant"] for r in res["rows"]):
        cells = []
        for k in keeps:
            r = next((r for r in res["rows"] if r["variant"] == var and r["keep"] == k), None)
            cells.append("" if r is None else f"{r['ppl']:.4g} ({r['linear_keep']:.3f})")
        lines.append(f"| {var} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def compress_at_shape(shape: str, method: str, keep: float, calib_samples: int, calib_len: int,
                      layers: int | None = None, seed: int = 0) -> dict:
    """Calibrate and compress a random model of a real geometry (``models.SHAPES``; its bf16 files memory-mapped)
    the way ``resolve_models(MODEL, method=..., keep=...)`` does: ``collect_stats`` over the dense model, then the
    family's compressor. Returns each phase's seconds, the statistics' float64 X^T X bytes (what a collector holding
    every layer at once keeps in memory) and the anonymous memory after loading and after calibration; run it in a
    child (``bench compress-memory``) to read the peak memory of the whole."""
    import torch

    from .. import models
    from ..compress import COMPRESSORS, collect_stats
    from ..compress.calib import calibration_data
    from ..factorized import account
    from ..host import status_bytes

    if method not in COMPRESSORS:
        raise ValueError(f"method {method!r}: one of {sorted(COMPRESSORS)}")
    model = models.load_shape_model(shape, layers=layers, seed=seed, progress=False)
    base_anon = status_bytes("RssAnon")
    ids = calibration_data(None, calib_samples, calib_len, seed, vocab_size=model.config.vocab_size)
    t0 = time.perf_counter()
    stats = collect_stats(model, ids, progress=False)
    calib_s = time.perf_counter() - t0
    distinct = {id(st): st for st in stats.stats.values()}.values()
    stats_bytes = sum(st.xtx.numel() * st.xtx.element_size() for st in distinct)
    after_calib_anon = status_bytes("RssAnon")
    t1 = time.perf_counter()
    cm = COMPRESSORS[method](model, stats, keep, progress=False)
    compress_s = time.perf_counter() - t1
    with torch.no_grad():
        finite = bool(torch.isfinite(cm(ids[:1, :8]).logits).all())
    return {"shape": shape, "layers": model.config.num_hidden_layers, "method": method, "keep": keep,
            "calib_tokens": calib_samples * calib_len, "calib_s": round(calib_s, 1), "compress_s": round(compress_s, 1),
            "stats_bytes": stats_bytes, "anon_after_load": base_anon, "anon_after_calibration": after_calib_anon,
            "kept_params": account(cm).linear_params, "logits_finite": finite}
