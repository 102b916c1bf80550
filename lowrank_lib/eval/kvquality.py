"""KV-cache quality: teacher-forced continuation after a compressed prefill, vs the dense cache.

For each of ``n_windows`` WikiText-2 windows of ``prefill_len + cont_len`` tokens: the prefill is run once
(exact, recorded with its post-RoPE queries: :func:`lowrank_lib.kv.hf_adapter.record`), every method is fitted
from it (``KVCache.from_prefill``), and the continuation is fed teacher-forced in forwards of ``step`` tokens. Reported per method: perplexity of the continuation
and the mean per-token KL(p_dense || p_method), averaged over windows with the spread (std, min, max).
Judge by KL: one window's perplexity is noisy.

The caches of one window are continued together, one batch row each (:class:`StackedCache`): one forward reads the
weights once for all of them (a forward of a few tokens is bound by reading the weights), and each row's attention
reads its own cache's tiers. Each row's numbers are its cache's alone, up to the float round-off of a batched
matrix product.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm
from transformers.cache_utils import Cache, CacheLayerMixin

from ..compat import cache_kw
from ..kv.hf_adapter import KVCache, TieredRead, dense_cache, record, tiered_attention

__all__ = ["continuation_by_rank", "continuation_quality", "eval_windows", "QualityResult", "StackedCache",
           "wikitext_windows"]

#: caches continued in one batch hold at most this many dense prefill bytes together (then the next batch)
BATCH_BYTES = 1 << 30


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


def eval_windows(tok, n_windows: int, length: int, vocab_size: int, seed: int = 0) -> torch.Tensor:
    """:func:`wikitext_windows` of the test split, or, without a tokenizer (a checkpoint alone: issue 28), seeded
    random ids below ``vocab_size`` of the same shape. A caller without text leaves its perplexity out."""
    if tok is None:
        from ..data import random_token_batches

        return random_token_batches(vocab_size, n_windows, length, seed)
    return wikitext_windows(tok, n_windows, length, seed=seed)


class _StackedRead(TieredRead):
    """Batch row j's queries read cache j's fitted layer (each through its own method and backend)."""

    def __init__(self, reads: list[TieredRead]):
        self.reads = reads

    def attend(self, query: torch.Tensor, scaling: float | None) -> torch.Tensor:
        return torch.cat([r.attend(query[j:j + 1], scaling) for j, r in enumerate(self.reads)])


class _StackedLayer(CacheLayerMixin):
    """One layer of a :class:`StackedCache`: row j's new tokens go to cache j's layer."""

    is_compileable = False
    is_croppable = False

    def __init__(self, members: list):
        super().__init__()
        self.members = members
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        pass

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if key_states.shape[0] != len(self.members):
            raise ValueError(f"StackedCache: a batch of {key_states.shape[0]} rows for {len(self.members)} caches")
        r = _StackedRead([m.update(key_states[j:j + 1], value_states[j:j + 1], *args, **kwargs)[0]
                          for j, m in enumerate(self.members)])
        return r, r

    def get_seq_length(self) -> int:
        return self.members[0].get_seq_length()

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, *args, **kwargs):
        return self.members[0].get_mask_sizes(*args, **kwargs)


class StackedCache(Cache):
    """Several fitted :class:`~lowrank_lib.kv.hf_adapter.KVCache` of the same prompt length as ONE transformers
    ``Cache``, batch row j served by cache j (appends through its method, attention over its tiers): a forward
    of ``[len(caches), t]`` tokens continues every cache at once. Run the model inside
    :func:`~lowrank_lib.kv.hf_adapter.tiered_attention`. The attention mask transformers builds is not read
    (as for one KVCache)."""

    def __init__(self, caches: list[KVCache]):
        if not caches or any(c.layers[0].state is None for c in caches):
            raise ValueError("StackedCache: give fitted caches (KVCache.from_prefill)")
        if len({c.get_seq_length() for c in caches}) != 1:
            raise ValueError("StackedCache: every cache must hold the same number of positions")
        self.caches = caches
        super().__init__(layers=[_StackedLayer([c.layers[i] for c in caches]) for i in range(len(caches[0].layers))])


def _continue(model, cache, cont: torch.Tensor, step: int) -> torch.Tensor:
    """Teacher-forced logits [B, T, V] (fp32) for ``cont`` [B, T] fed in forwards of ``step`` tokens (a
    StackedCache inside tiered attention)."""
    import contextlib

    outs = []
    with tiered_attention(model) if isinstance(cache, StackedCache) else contextlib.nullcontext():
        for s in range(0, cont.shape[1], step):
            outs.append(model(cont[:, s:s + step], **cache_kw(cache)).logits.float())
    return torch.cat(outs, 1)


@torch.no_grad()
def continuation_quality(model, windows: torch.Tensor, prefill_len: int, methods: dict,
                         step: int = 32, progress: bool = True, attention: dict | None = None,
                         batch: int | None = None) -> dict[str, QualityResult]:
    """Quality of each method's cache on ``windows`` [N, prefill_len + T].

    methods : name -> a KV method (``lowrank_lib.kv.make_method``); each is fitted from every window's prefill.
    attention : name -> the tiered attention backend that method's cache decodes with (default ``"portable"``).
    batch : caches continued together in one batched forward (default: as many as hold :data:`BATCH_BYTES` of
    dense prefill bytes together); 1 continues each cache on its own.
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
        ref = F.log_softmax(_continue(model, dense_cache(rec, model), cont, step)[0], -1)   # [T-1, V]
        dense_nll.append(float(F.nll_loss(ref, tgt)))
        per = batch or max(1, BATCH_BYTES // max(1, rec.dense_nbytes()))
        names = list(methods)
        for lo in range(0, len(names), per):
            group = names[lo:lo + per]
            caches = [KVCache.from_prefill(methods[n], rec, model, (attention or {}).get(n, "portable")) for n in group]
            logits = _continue(model, StackedCache(caches), cont.expand(len(group), -1), step)
            for name, cache, lg in zip(group, caches, logits):
                report[name] = cache.describe()
                lp = F.log_softmax(lg, -1)
                mem[name].append(report[name]["bytes_ratio"])
                mem_end[name].append(cache.nbytes / report[name]["dense_bytes"])
                for b, c in cache.attention_calls.items():
                    calls[name][b] = calls[name].get(b, 0) + c
                kl[name].append(float(F.kl_div(lp, ref, log_target=True, reduction="batchmean")))
                nll[name].append(float(F.nll_loss(lp, tgt)))
            del caches, logits
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
    "rebuild_calls" (tiered attention calls of each reader: both really ran)}. Without a tokenizer (``tok`` None) the
    windows are random ids (:func:`eval_windows`) and every perplexity is None: the KL and the per-window NLL
    difference still compare the routes.
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
    wins = eval_windows(tok, n_windows, prefill_len + cont_len, model.config.vocab_size)
    res = continuation_quality(model, wins, prefill_len, methods, progress=progress, attention=attention)
    text = tok is not None                          # random ids: no perplexity
    ppl = lambda v: v if text else None
    rows = [{"rank_frac": f, "rank": r, "ppl": ppl(res[f"factor@{f}"].ppl), "kl": res[f"factor@{f}"].kl,
             "kl_std": res[f"factor@{f}"].kl_std, "memory_ratio": res[f"factor@{f}"].memory_ratio}
            for f, r in ranks.items()]
    out = {"prefill_len": prefill_len, "cont_len": cont_len, "n_windows": n_windows, "window": window,
           "text": text, "ppl_dense": ppl(next(iter(res.values())).ppl_dense), "rows": rows}
    if identity_frac is not None:
        reb, fac = res["rebuild@identity"], res["factor@identity"]
        out["identity"] = {"rank": ir, "ppl_rebuild": ppl(reb.ppl), "ppl_factor": ppl(fac.ppl),
                           "kl_rebuild": reb.kl, "kl_factor": fac.kl, "memory_ratio_rebuild": reb.memory_ratio,
                           "memory_ratio_factor": fac.memory_ratio,
                           "ppl_rel_diff": ppl(abs(fac.ppl - reb.ppl) / reb.ppl),
                           "max_window_nll_diff": max(abs(a - b) for a, b in zip(fac.window_nll, reb.window_nll))}
    # which reader really ran: the tiered attention calls of every factor-space method and of the rebuild one
    out["factor_calls"] = sum(res[f"factor@{f}"].attention_calls.get("portable", 0) for f in ranks)
    out["rebuild_calls"] = res["rebuild@identity"].attention_calls.get("rebuild", 0) if identity_frac is not None else 0
    return out
