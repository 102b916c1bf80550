"""Low rank or quantization at long context (issue 31): a decode step at ``P`` tokens of context reads the weights
AND the whole KV cache, so the cache's bytes stand beside the weights' on the frontier.

SmolLM2 holds 30 layers x 2 x 3 KV heads x 64 values per position: 23 KB in 16 bits, 184 MB at P = 8000, more than
llama.cpp's Q4_K_M weights (104 MB). Every point is measured on the SAME windows of ``P + cont`` tokens
(:func:`lowrank_lib.eval.kv_sweep.frontier_windows`: WikiText-2 test, seed ``seed``) and scores the same tokens: the
``cont - 1`` continuation tokens after position ``P``, each predicted with every earlier token of its window in
context (the scored tokens of ``bench kv-frontier``). ``ppl`` = exp(mean over windows of the window's mean NLL).

- **llama.cpp** (a frontier point with a GGUF: :func:`lowrank_lib.eval.frontier.gguf_file`) with its KV cache in
  each of ``llama_kv`` (``f16``: llama.cpp's default; ``q8_0``: its 8-bit cache, 34 bytes per 32 values): one pass
  over the window from an empty context, llama.cpp's own logits
  (:class:`~lowrank_lib.eval.llamacpp.GGUFLogits`); ``kv_bytes`` = the cache at ``P`` positions in that type.
- **ours** (a model): the dense cache, then every composed (or other registry) policy of ``policies`` at every
  ``budgets`` through :func:`lowrank_lib.eval.kv_sweep.kv_frontier` (the prefill recorded once per window, the
  continuation teacher-forced over the fitted cache); ``kv_bytes`` = ``bytes_ratio`` (bytes really held after the
  prefill, over the dense cache's) x the dense cache at ``P`` positions in bf16 (the engine's KV dtype).

Each point: the frontier fields of its weights (``id``, ``label``, ``system``, ``method``, ``keep``, ``weights``,
``weight_bytes_per_token``) plus ``kv`` (what holds the cache), ``context``, ``kv_bytes``, ``bytes_per_token`` =
weights + cache, ``ppl``, ``nll``, ``window_nll``. Judge them with :func:`lowrank_lib.eval.frontier.misses` at
``x="bytes_per_token"``.
"""
from __future__ import annotations

import math
import statistics
import time

import torch

__all__ = ["DEFAULT_POINTS", "KV_ELEMENT_BYTES", "kv_values_per_position", "llamacpp_continuation_nll",
           "long_context_points", "long_context_table", "measure"]

#: bytes per cached value by cache type (llama.cpp's q8_0: one fp16 scale per 32 int8 values)
KV_ELEMENT_BYTES = {"f32": 4.0, "f16": 2.0, "bf16": 2.0, "q8_0": 34 / 32}


def kv_values_per_position(config) -> int:
    """K and V values one position adds to the cache of a Llama-family ``config``."""
    hd = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * hd


def llamacpp_continuation_nll(path, windows: torch.Tensor, context: int, kv: str = "f16", threads: int = 1,
                              progress: bool = False) -> list[float]:
    """Per window of ``windows`` [n, context + cont]: the mean NLL of tokens ``context + 1 ...`` from llama.cpp's logits
    of one pass over the whole window (its cache in ``kv``)."""
    from tqdm.auto import tqdm

    from .llamacpp import GGUFLogits

    out = []
    with GGUFLogits(path, n_ctx=windows.shape[1], threads=threads, kv_type=kv) as m:
        for w in tqdm(windows, desc=f"llama.cpp {kv} cache", disable=not progress, leave=False):
            lg = torch.from_numpy(m.row_logits(w.tolist())[context:-1]).double()
            out.append(float(torch.nn.functional.cross_entropy(lg, w[context + 1:])))
    return out


def _pid(point: dict, kv: str, context: int) -> str:
    """The id of ``point``'s weights with the cache ``kv`` at ``context`` tokens."""
    return f"{point['id']}+kv:{kv}@{context}"


def _fields(point: dict, kv: str, label: str, context: int, kv_bytes: float, nll: list[float]) -> dict:
    keep = ("id", "label", "system", "method", "keep", "weights", "weight_bytes_per_token")
    p = {k: point.get(k) for k in keep}
    return {**p, "id": _pid(point, kv, context), "label": f"{point['label']} + {label}", "kv": kv,
            "context": context, "kv_bytes": kv_bytes, "bytes_per_token": point["weight_bytes_per_token"] + kv_bytes,
            "window_nll": nll, "nll": statistics.fmean(nll), "ppl": math.exp(statistics.fmean(nll))}


def long_context_points(config, tok, ours: list[tuple[dict, object]], llamacpp: list[tuple[dict, str]], context: int = 8000,
                        cont: int = 64, windows: int = 2, seed: int = 0, llama_kv=("f16", "q8_0"),
                        policies=("composed-kvzip-q8",), budgets=(0.25, 0.125), threads: int = 1, done=(),
                        on_point=None, progress: bool = True, log=print) -> list[dict]:
    """The points at ``context`` (see the module docstring) of one geometry (``config``: the HF config every model and
    GGUF shares): ``ours`` = (frontier point, its HF model) pairs, ``llamacpp`` = (frontier point, its GGUF path)
    pairs; ``done``: ids not measured again; ``on_point(p)`` after each point."""
    from ..data import random_token_batches
    from .kv_sweep import FrontierConfig, frontier_windows, kv_frontier

    out: list[dict] = []
    cache_values = kv_values_per_position(config) * context

    def add(p):
        out.append(p)
        log(f"[long-context] {p['label']}: ppl {p['ppl']:.4f}, {p['bytes_per_token'] / 1e6:.1f} MB/token "
            f"({p['kv_bytes'] / 1e6:.1f} MB of cache)")
        if on_point is not None:
            on_point(p)

    for point, model in ours:
        todo = [_pid(point, k, context) for k in ("dense-bf16", *(f"{q}:{b:g}" for q in policies for b in budgets))]
        if all(t in done for t in todo):
            continue
        dense_kv = cache_values * KV_ELEMENT_BYTES["bf16"]
        t0 = time.perf_counter()
        cfg = FrontierConfig(prompt_len=[context], windows=windows, cont=cont, budgets=list(budgets),
                             policies=list(policies), seed=seed)
        res = kv_frontier(cfg, progress=progress, model=model, tok=tok)
        dn = [res["dense_nll"][str(context)][w] for w in sorted(res["dense_nll"][str(context)])]
        took = round(time.perf_counter() - t0, 1)
        if todo[0] not in done:
            add({**_fields(point, "dense-bf16", "dense bf16 KV", context, dense_kv, dn), "eval_s": took})
        for r in res["rows"]:
            kv = f"{r['policy']}:{r['budget']:g}"
            if _pid(point, kv, context) in done:
                continue
            nll = [x["nll"] for x in res["per_window"] if x["policy"] == r["policy"] and x["budget"] == r["budget"]]
            add({**_fields(point, kv, f"{r['policy']} KV at budget {r['budget']:g}", context,
                           r["bytes_ratio"] * dense_kv, nll), "bytes_ratio": r["bytes_ratio"], "kl_mean": r["kl_mean"],
                 "eval_s": took})
    if llamacpp:              # kv_frontier's windows (seeded random ids of the vocabulary without a tokenizer)
        W = (frontier_windows(tok, None, windows, context + cont, seed) if tok is not None else
             random_token_batches(config.vocab_size, windows, context + cont, seed))
        for point, path in llamacpp:
            for kv in llama_kv:
                if _pid(point, kv, context) in done:
                    continue
                t0 = time.perf_counter()
                nll = llamacpp_continuation_nll(path, W, context, kv, threads, progress)
                add({**_fields(point, kv, f"{kv} KV", context, cache_values * KV_ELEMENT_BYTES[kv], nll),
                     "eval_s": round(time.perf_counter() - t0, 1)})
    return out


def long_context_table(points: list[dict]) -> str:
    """The points as Markdown, fewest bytes first, with whether each is on the (bytes, perplexity) frontier and by
    how much it misses it (:func:`lowrank_lib.eval.frontier.misses`)."""
    from .frontier import misses

    m = {x["id"]: x for x in misses(points, x="bytes_per_token", y="ppl")}
    lines = ["| point | weights MB | cache MB | MB per token | perplexity | on the frontier |", "|---|---|---|---|---|---|"]
    for p in sorted(points, key=lambda p: p["bytes_per_token"]):
        x = m.get(p["id"], {})
        verdict = "**yes**" if x.get("on_frontier") else (
            f"no: +{x['extra_y']:.2f} ({100 * x['extra_y_rel']:+.1f} %) at no more bytes" if x.get("extra_y") is not None
            else "no")
        lines.append(f"| {p['label']} | {p['weight_bytes_per_token'] / 1e6:.1f} | {p['kv_bytes'] / 1e6:.1f} | "
                     f"{p['bytes_per_token'] / 1e6:.1f} | {p['ppl']:.3f} | {verdict} |")
    return "\n".join(lines)


#: the frontier points measured at long context unless named (``bench frontier --longctx --prompt-len P --points ...``)
DEFAULT_POINTS = ("llama.cpp:bf16", "llama.cpp:q8_0", "llama.cpp:q4_k_m", "lowrank_lib:dense:bf16")


def measure(frontier: dict, model_name: str, workdir, context: int = 8000, names=DEFAULT_POINTS, **kw) -> dict:
    """``frontier`` (a ``bench frontier`` result) with ``frontier["long_context"]``: the points ``names`` (ids or
    labels, :func:`lowrank_lib.eval.frontier.select_points`) at ``context`` tokens (:func:`long_context_points`,
    ``kw``: its options; points already there are kept). ``model_name``: the dense model the frontier was made from
    (:func:`lowrank_lib.models.load`; llama.cpp's GGUFs: :func:`~lowrank_lib.eval.frontier.gguf_file` under
    ``workdir``; ours: :func:`~lowrank_lib.eval.frontier.point_model`, a low-rank point without its saved file is
    skipped and named in ``skipped_no_file``)."""
    from .. import models
    from .frontier import gguf_file, point_model, select_points

    made_from = frontier.get("protocol", {}).get("model")
    if made_from not in (None, model_name):
        raise ValueError(f"the frontier was measured on {made_from!r}, not {model_name!r}: its points' files and "
                         "GGUFs belong to that model")
    model, tok = models.load(model_name)

    out = frontier.setdefault("long_context", {"points": []})
    chosen = select_points(frontier["points"], names)
    ours = [(p, m) for p in chosen if p["system"] != "llama.cpp" for m in [point_model(p, model)] if m is not None]
    llama = [(p, gguf_file(model, workdir, p["weights"])) for p in chosen if p["system"] == "llama.cpp"]
    skipped = [p["id"] for p in chosen if p["system"] != "llama.cpp" and p["id"] not in {q["id"] for q, _ in ours}]
    out.update({k: v for k, v in kw.items() if k in ("cont", "windows", "seed", "llama_kv", "policies", "budgets")},
               context=context, skipped_no_file=skipped)
    user_add = kw.pop("on_point", None)

    def add(p):
        out["points"].append(p)
        if user_add is not None:
            user_add(p)

    long_context_points(model.config, tok, ours, llama, context, done={p["id"] for p in out["points"]}, on_point=add,
                        **kw)
    return frontier
