"""Quality of quantized factors (issue 30): perplexity of one compressed model with its factors as computed (fp32),
rounded to bf16, and quantized to int8 / int4 at several group sizes, on the same windows.

The protocol is the README's (WikiText-2 test windows, SVD-LLM v1 calibrated on WikiText-2 valid, fp32 model), and
the compressor, calibration and perplexity are the library's (``compress.svdllm``, ``compress.calib``,
``eval.perplexity``). Only the factors change between rows:

* ``fp32``: the compressor's factors;  ``bf16``: each factor rounded to bf16 (the engine's storage today);
* ``int{8,4}_g{G}``: :func:`lowrank_lib.quantize_factors` (QUANT_SPEC), evaluated as the engine runs a prefill
  (more than 8 rows: the factors dequantized, fp32 GEMMs). The spec's own product (:func:`lowrank_lib.quant.qmatmul`,
  activations quantized to int16 per group, what decode runs) is checked against it on a shorter prefix of the
  first window (``check_tokens``): the two perplexities are reported side by side.

Every projection computes in fp32, so the rows differ by the factors' storage alone.

:func:`head_rows` does the same for the LM head (``res["heads"]``): the bf16-factor model with its head replaced by
the group-wise quantized copy an approximate head serves (``EngineConfig(lm_head="q8" / "q4")``,
``runtime.lm_head.APPROX_HEADS``: every decode logit from that copy), its perplexity and, at every position of the
same windows, how often its argmax is the exact head's (teacher-forced: what a greedy step would pick).
"""
from __future__ import annotations

import copy
import platform
import time

import torch

from .. import quant
from ..factorized import MIXED_4_8, LowRankLinear, account, factor_matrix, lowrank_modules, quantize_factors, set_module
from ..runtime.lm_head import APPROX_HEADS
from .perplexity import perplexity, windows as eval_windows

__all__ = ["dequantized", "rounded_factors", "quant_rows", "head_rows", "pick_group", "measure_quant_quality", "table",
           "label"]


def dequantized(model):
    """A copy of ``model`` whose quantized factors are dequantized to fp32 ``nn.Parameter`` (the engine's prefill
    math: dequantize, then aten); a shared factor stays shared."""
    m = copy.deepcopy(model)
    done: dict[int, torch.Tensor] = {}
    for name, lr in lowrank_modules(m).items():
        U, V = (done.setdefault(id(f), torch.nn.Parameter(factor_matrix(f), requires_grad=False)) for f in (lr.U, lr.V))
        set_module(m, name, LowRankLinear(U, V, lr.bias))
    return m


def rounded_factors(model, dtype: torch.dtype = torch.bfloat16):
    """A copy whose factors are rounded to ``dtype`` and stored back in their own dtype (storage precision only)."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        for p in {id(f): f for lr in lowrank_modules(m).values() for f in (lr.U, lr.V)}.values():
            p.copy_(p.to(dtype).to(p.dtype))
    return m


def quant_rows(model, ids: torch.Tensor, configs, seq_len: int, windows: int, check_tokens: int = 0,
               progress: bool = False, on_row=None, stats=None) -> list[dict]:
    """Perplexity of ``model`` (a factorized fp32 model, unchanged) with its factors fp32, bf16 and quantized at
    each ``(bits, group)`` of ``configs`` (rounded to nearest; bits ``"mixed"``: :data:`lowrank_lib.MIXED_4_8`),
    and, given ``stats`` (``collect_stats`` of this model), each again with GPTQ codes (``quantize_factors(...,
    stats=stats)``; rows ``method: "gptq"``).
    ``check_tokens``: also the perplexity of the first window's first ``check_tokens`` tokens through the spec's
    qmatmul forward and through the dequantized one."""
    def ppl(m, desc, n=seq_len, w=windows):
        with torch.no_grad():
            return perplexity(m, ids, seq_len=n, max_windows=w, progress=progress, desc=desc).ppl

    rows = []

    def add(row):
        rows.append(row)
        if on_row is not None:
            on_row(rows)

    acc = account(model)
    add({"factors": "fp32", "ppl": ppl(model, "fp32"), "linear_bytes": acc.linear_bytes})
    add({"factors": "bf16", "ppl": ppl(rounded_factors(model), "bf16"), "linear_bytes": acc.linear_bytes // 2})
    for bits, group, method in [(b, g, m) for b, g in configs for m in ("rtn", "gptq") if m == "rtn" or stats]:
        t0 = time.perf_counter()
        q = quantize_factors(copy.deepcopy(model), MIXED_4_8 if bits == "mixed" else bits, group,
                             stats=stats if method == "gptq" else None)
        kind = "mixed" if bits == "mixed" else f"int{bits}"
        row = {"factors": f"{kind}_g{group}" + ("_gptq" if method == "gptq" else ""), "bits": bits,
               "group": group, "method": method, "quantize_s": round(time.perf_counter() - t0, 1),
               "linear_bytes": account(q).linear_bytes}
        row["ppl"] = ppl(dequantized(q), row["factors"])
        if check_tokens:
            row["check"] = {"tokens": check_tokens, "ppl_qmatmul": ppl(q, "qmatmul", check_tokens, 1),
                            "ppl_dequantized": ppl(dequantized(q), "deq", check_tokens, 1)}
        del q
        add(row)
    ref, ref32 = (next(r["ppl"] for r in rows if r["factors"] == f) for f in ("bf16", "fp32"))
    for r in rows:
        r["rel_to_bf16"], r["rel_to_fp32"] = r["ppl"] / ref - 1, r["ppl"] / ref32 - 1
    return rows


def with_head(model, W: torch.Tensor):
    """A copy of ``model`` whose LM head is its own (untied) ``nn.Linear`` with weight ``W``."""
    m = copy.deepcopy(model)
    m.config.tie_word_embeddings = False
    head = torch.nn.Linear(W.shape[1], W.shape[0], bias=False, dtype=W.dtype)
    head.weight = torch.nn.Parameter(W.clone(), requires_grad=False)
    m.set_output_embeddings(head)
    return m


def head_rows(model, ids: torch.Tensor, seq_len: int, windows: int, heads=tuple(APPROX_HEADS),
              progress: bool = False) -> list[dict]:
    """Perplexity of ``model`` with its exact head and with each approximate head of ``heads`` (the head's weight
    replaced by ``quant.dequantize(quant.quantize(W, bits, group))``, the copy ``lm_head=<mode>`` scores), the head's
    bytes, and ``argmax_agreement``: over every scored position of the windows, the fraction whose argmax equals the
    exact head's."""
    W = model.get_output_embeddings().weight.detach().float()
    wins = eval_windows(ids, seq_len, windows)
    with torch.no_grad():
        exact = [model(w[None]).logits[0].argmax(-1) for w in wins]
    rows = [{"head": "exact", "bits": None, "group": None, "head_bytes": W.numel() * 2, "argmax_agreement": 1.0,
             "ppl": perplexity(model, ids, seq_len=seq_len, max_windows=windows, progress=progress, desc="exact").ppl}]
    for mode in heads:
        bits, group = APPROX_HEADS[mode]
        m = with_head(model, quant.dequantize(quant.quantize(W, bits, group)))
        with torch.no_grad():
            same = [(m(w[None]).logits[0].argmax(-1) == e).float().mean().item() for w, e in zip(wins, exact)]
            ppl = perplexity(m, ids, seq_len=seq_len, max_windows=windows, progress=progress, desc=mode).ppl
        rows.append({"head": mode, "bits": bits, "group": group, "head_bytes": quant.quantized_nbytes(*W.shape, bits, group),
                     "argmax_agreement": sum(same) / len(same), "ppl": ppl})
        del m
    for r in rows:
        r["rel_to_exact"] = r["ppl"] / rows[0]["ppl"] - 1
    return rows


def label(row: dict) -> str:
    """A factor row's name in tables: ``fp32``, ``bf16``, ``int4, group 32`` or ``int4, group 32, GPTQ``."""
    if "bits" not in row:
        return row["factors"]
    kind = "int4 / int8 mixed" if row["bits"] == "mixed" else f"int{row['bits']}"
    return f"{kind}, group {row['group']}" + (", GPTQ" if row.get("method") == "gptq" else "")


def table(res: dict) -> str:
    """The factor rows, then (when measured) the head rows, as Markdown."""
    lines = ["| factors | PPL | vs bf16 | vs fp32 | projection bytes |", "|---|---|---|---|---|"]
    for r in res["rows"]:
        rel = [r.get(k) for k in ("rel_to_bf16", "rel_to_fp32")]
        lines.append(f"| {label(r)} | {r['ppl']:.4f} | "
                     + " | ".join('' if x is None else f'{100 * x:+.3f} %' for x in rel) +
                     f" | {r['linear_bytes'] / 1e6:.1f} MB |")
    if res.get("heads"):
        lines += ["", "| LM head (bf16 factors) | PPL | vs exact head | argmax = exact head's | head bytes |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['head']} | {r['ppl']:.4f} | {100 * r['rel_to_exact']:+.3f} % | "
                  f"{100 * r['argmax_agreement']:.2f} % | {r['head_bytes'] / 1e6:.1f} MB |" for r in res["heads"]]
    return "\n".join(lines)


def pick_group(rows: list[dict], bits: int, target: float, method: str = "rtn") -> int | None:
    """The largest group (fewest scale bytes) whose perplexity is within ``target`` (relative) of the bf16 factors'
    with ``method``'s codes (``"rtn"``: what ``quantize_factors`` does without calibration); None if no group of
    ``bits`` meets it."""
    ok = [r["group"] for r in rows if r.get("bits") == bits and r.get("method", "rtn") == method
          and r["rel_to_bf16"] <= target]
    return max(ok) if ok else None


def measure_quant_quality(model_name: str = "smollm2", keep: float = 0.8, windows: int = 4, seq_len: int = 2048,
                          calib_samples: int = 16, calib_len: int = 512, configs=((8, 32), (8, 64), (8, 128),
                                                                                    (4, 32), (4, 64), (4, 128)),
                          check_tokens: int = 256, target_int8: float = 0.005, progress: bool = True,
                          on_row=None, heads=tuple(APPROX_HEADS), family: str = "svdllm", gptq: bool = False) -> dict:
    """``family``'s compressor (SVD-LLM v1 by default) at ``keep`` on ``model_name`` (the README's protocol), then
    :func:`quant_rows` and, for ``heads``, :func:`head_rows` on the bf16-factor model.

    ``family="dobi-remap"``: the fp32 row is Dobi's own loader (its 8-bit codes widened, fp16 values computed in
    fp32), and each int row is what ``load_checkpoint(path, factor_bits=..., factor_group=...)`` serves from the
    file's codes (``quantize`` of the widened factor, one factor at a time; ``tests/test_dobi_served.py``).

    ``gptq``: also every config with GPTQ codes, for the input moments of the compressed model on the same
    calibration tokens (``collect_stats`` of it; ``stats_seconds`` in the protocol)."""
    from .. import families, models
    from ..compress.calib import calibration_data, collect_stats
    from .quality import QualityConfig, eval_tokens

    torch.manual_seed(0)
    model, tok = models.load(model_name)
    ids = eval_tokens(model, tok, QualityConfig(model=model_name, seq_len=seq_len, max_windows=windows))
    t0 = time.perf_counter()
    calib = calibration_data(tok, calib_samples, calib_len, 0, model.config.vocab_size)
    stats = collect_stats(model, calib, progress=progress)
    fam = families.get(family)
    cm = fam.compress(model, stats, keep, progress=False)
    prep_s = time.perf_counter() - t0
    del stats, model
    res = {"protocol": {"model": model_name, "compressor": fam.title, "family": fam.name, "keep": keep,
                        "eval": f"WikiText-2 test, first {windows} windows of {seq_len} tokens",
                        "calibration": f"WikiText-2 valid, {calib_samples} x {calib_len} tokens, seed 0",
                        "compute": "fp32 everywhere; quantized rows dequantized (the engine's prefill math)",
                        "check": f"first {check_tokens} tokens of window 0 through qmatmul (the spec's product)",
                        "prepare_seconds": round(prep_s, 1)},
           "host": {"node": platform.node(), "torch": torch.__version__, "threads": torch.get_num_threads()},
           "rows": []}

    def row_done(rows):
        res["rows"] = rows
        if on_row is not None:
            on_row(res)

    qstats = None
    if gptq:
        t0 = time.perf_counter()
        qstats = collect_stats(cm, calib, progress=progress)
        res["protocol"]["gptq"] = ("GPTQ rows: input moments of the compressed fp32 model on the same calibration "
                                   "tokens; V's codes first, then U's for deq(V) H deq(V)^T; damp 0.01, no act-order")
        res["protocol"]["stats_seconds"] = round(time.perf_counter() - t0, 1)
    res["rows"] = quant_rows(cm, ids, configs, seq_len, windows, check_tokens, progress, row_done, stats=qstats)
    res["target_int8"] = target_int8
    best4 = min((r for r in res["rows"] if r.get("bits") == 4), default=None, key=lambda r: r["ppl"])
    res["chosen_group"] = {"int8": pick_group(res["rows"], 8, target_int8),
                           "int4_best": None if best4 is None else best4["group"],
                           "int4_best_method": None if best4 is None else best4["method"]}
    if heads:
        res["heads"] = head_rows(rounded_factors(cm), ids, seq_len, windows, heads, progress)
        row_done(res["rows"])
    return res
