"""KV-cache quality: teacher-forced continuation after a compressed prefill, vs the dense cache.

For each of ``n_windows`` WikiText-2 windows of ``prefill_len + cont_len`` tokens: the prefill is run once
(exact, recorded with its post-RoPE queries: :func:`lowrank_lib.kv.hf_adapter.record`), every method is fitted
from it (``KVCache.from_prefill``), and the continuation is fed teacher-forced in forwards of ``step`` tokens. Reported per method: perplexity of the continuation
and the mean per-token KL(p_dense || p_method), averaged over windows with the spread (std, min, max).
Judge by KL: one window's perplexity is noisy.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..compat import cache_kw
from ..kv.hf_adapter import KVCache, dense_cache, record

__all__ = ["continuation_by_rank", "continuation_quality", "QualityResult", "wikitext_windows"]


@dataclass
class QualityResult:
    method: str
    ppl: float                 # exp(mean NLL over all continuation tokens of all windows)
    ppl_dense: float
    kl: float                  # mean over windows of the per-token mean KL(dense || method)
    kl_std: float
    kl_min: float
    kl_max: float
    window_kl: list[float]
    window_nll: list[float]
    memory_ratio: float        # bytes held / dense KV bytes right after the prefill (mean over windows)
    memory_ratio_end: float    # ... and at the end of the continuation (accumulate grows, stream stays bounded)
    tokens: int
    memory: dict | None = None  # the last window's fit as the method describes it (bytes, ranks, tiers)
    attention_calls: dict | None = None   # tiered attention calls by backend, summed over windows (which reader ran)

    def to_dict(self) -> dict:
        return asdict(self)


def wikitext_windows(tok, n_windows: int, length: int, split: str = "test", seed: int = 0) -> torch.Tensor:
    """``[n_windows, length]`` non-overlapping windows of the split, evenly spaced (deterministic)."""
    from ..data import tokens

    ids = tokens(tok, split)
    n_avail = ids.numel() // length
    if n_avail < n_windows:
        raise ValueError(f"{split} has {ids.numel()} tokens: only {n_avail} windows of {length}, need {n_windows}")
    g = torch.Generator().manual_seed(seed)
    pick = torch.randperm(n_avail, generator=g)[:n_windows].sort().values
    return torch.stack([ids[i * length:(i + 1) * length] for i in pick.tolist()])


@torch.no_grad()
def _continue(model, cache, cont: torch.Tensor, step: int) -> torch.Tensor:
    """Teacher-forced logits [T, V] (fp32) for ``cont`` [1, T] fed in forwards of ``step`` tokens (a KVCache inside
    its adapter's routing)."""
    import contextlib

    outs = []
    with cache.serving(model) if isinstance(cache, KVCache) else contextlib.nullcontext():
        for s in range(0, cont.shape[1], step):
            outs.append(model(cont[:, s:s + step], **cache_kw(cache)).logits[0].float())
    return torch.cat(outs)


@torch.no_grad()
def continuation_quality(model, windows: torch.Tensor, prefill_len: int, methods: dict,
                         step: int = 32, progress: bool = True, attention: dict | None = None) -> dict[str, QualityResult]:
    """Quality of each method's cache on ``windows`` [N, prefill_len + T].

    methods : name -> a KV method (``lowrank_lib.kv.make_method``); each is fitted from every window's prefill.
    attention : name -> the tiered attention backend that method's cache decodes with (default ``"portable"``).
    """
    N, L = windows.shape
    T = L - prefill_len
    if T < 2:
        raise ValueError(f"windows of {L} tokens leave no continuation after prefill_len={prefill_len}")
    dev = next(model.parameters()).device
    kl = {m: [] for m in methods}
    nll = {m: [] for m in methods}
    mem = {m: [] for m in methods}
    mem_end = {m: [] for m in methods}
    report = {m: None for m in methods}
    calls = {m: {} for m in methods}
    dense_nll = []
    for w in tqdm(range(N), desc="kv-quality windows", disable=not progress):
        x = windows[w:w + 1].to(dev)
        pre, cont, tgt = x[:, :prefill_len], x[:, prefill_len:-1], x[0, prefill_len + 1:]
        rec = record(model, pre)
        ref = F.log_softmax(_continue(model, dense_cache(rec, model), cont, step), -1)   # [T-1, V]
        dense_nll.append(float(F.nll_loss(ref, tgt)))
        for name, method in methods.items():
            cache = KVCache.from_prefill(method, rec, model, (attention or {}).get(name, "portable"))
            report[name] = cache.describe()
            lp = F.log_softmax(_continue(model, cache, cont, step), -1)
            mem[name].append(report[name]["bytes_ratio"])
            mem_end[name].append(cache.nbytes / report[name]["dense_bytes"])
            for b, c in cache.attention_calls.items():
                calls[name][b] = calls[name].get(b, 0) + c
            kl[name].append(float(F.kl_div(lp, ref, log_target=True, reduction="batchmean")))
            nll[name].append(float(F.nll_loss(lp, tgt)))
        del rec
    out = {}
    ppl_dense = math.exp(statistics.fmean(dense_nll))
    for name in methods:
        k = kl[name]
        out[name] = QualityResult(name, math.exp(statistics.fmean(nll[name])), ppl_dense, statistics.fmean(k),
                                  statistics.pstdev(k), min(k), max(k), k, nll[name],
                                  statistics.fmean(mem[name]), statistics.fmean(mem_end[name]), N * (T - 1),
                                  report[name], calls[name])
    return out


@torch.inference_mode()
def continuation_by_rank(model, tok, rank_fracs: list[float], prefill_len: int = 2048, cont_len: int = 128,
                         n_windows: int = 2, window: int = 32, identity_frac: float | None = 0.5,
                         progress: bool = True) -> dict:
    """The AttSVD issue's continuation protocol (:func:`continuation_quality`) per AttSVD rank r = frac x d.

    Every rank decodes in factor space; at ``identity_frac`` (r/d) the paper's rebuild-then-attend path runs too,
    on the same windows, so the identity of the two paths shows in the same numbers.
    Returns {"rows": [{rank_frac, rank, ppl, kl, kl_std, memory_ratio}], "ppl_dense", "identity": {...}, "factor_calls",
    "rebuild_calls" (tiered attention calls of each reader: both really ran)}.
    """
    from ..geometry import geometry
    from ..kv import make_method

    d = geometry(model).head_dim
    ranks = {f: max(1, round(f * d)) for f in rank_fracs}
    methods = {f"factor@{f}": make_method("attsvd", rank=r, window=window) for f, r in ranks.items()}
    attention = {}
    if identity_frac is not None:
        ir = max(1, round(identity_frac * d))
        methods["rebuild@identity"] = methods["factor@identity"] = make_method("attsvd", rank=ir, window=window)
        attention["rebuild@identity"] = "rebuild"
    wins = wikitext_windows(tok, n_windows, prefill_len + cont_len)
    res = continuation_quality(model, wins, prefill_len, methods, progress=progress, attention=attention)
    rows = [{"rank_frac": f, "rank": r, "ppl": res[f"factor@{f}"].ppl, "kl": res[f"factor@{f}"].kl,
             "kl_std": res[f"factor@{f}"].kl_std, "memory_ratio": res[f"factor@{f}"].memory_ratio}
            for f, r in ranks.items()]
    out = {"prefill_len": prefill_len, "cont_len": cont_len, "n_windows": n_windows, "window": window,
           "ppl_dense": next(iter(res.values())).ppl_dense, "rows": rows}
    if identity_frac is not None:
        reb, fac = res["rebuild@identity"], res["factor@identity"]
        out["identity"] = {"rank": ir, "ppl_rebuild": reb.ppl, "ppl_factor": fac.ppl,
                           "kl_rebuild": reb.kl, "kl_factor": fac.kl, "memory_ratio_rebuild": reb.memory_ratio,
                           "memory_ratio_factor": fac.memory_ratio,
                           "ppl_rel_diff": abs(fac.ppl - reb.ppl) / reb.ppl,
                           "max_window_nll_diff": max(abs(a - b) for a, b in zip(fac.window_nll, reb.window_nll))}
    # which reader really ran: the tiered attention calls of every factor-space method and of the rebuild one
    out["factor_calls"] = sum(res[f"factor@{f}"].attention_calls.get("portable", 0) for f in ranks)
    out["rebuild_calls"] = res["rebuild@identity"].attention_calls.get("rebuild", 0) if identity_frac is not None else 0
    return out
