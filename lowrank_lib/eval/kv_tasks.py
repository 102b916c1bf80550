"""RULER-style tasks with the question left uncompressed, as kvpress evaluates: every frontier policy at byte
budgets. The library of ``python -m lowrank_lib.bench kv-tasks``.

Protocol, per sample (:class:`~lowrank_lib.eval.longctx.Sample`, split into ``context`` and ``question``,
each tokenised on its own: :func:`~lowrank_lib.eval.longctx.sample_ids`):

1. the CONTEXT only (instruction head + haystack with the needles) is prefilled once and recorded
   (:func:`~lowrank_lib.kv.hf_adapter.record`: K, V and post-RoPE queries of every layer);
2. every registry method of ``policies`` is fitted from that record at each byte budget, exactly as
   ``kv_frontier`` fits them (``kv_sweep.frontier_caches``; scores memoised on the record: one scoring per
   scorer);
3. the QUESTION tokens go through the compressed cache in one forward, exactly (they are appended as exact
   rows, never compressed);
4. the answer is decoded greedily (``longctx.greedy_decode``) until a newline / EOS or ``max_new`` tokens, and
   scored (``longctx.score``: exact / partial).

``adapter="engine"`` serves every method through the runtime engine instead
(:class:`~lowrank_lib.kv.engine_adapter.MethodStore`): the engine prefills the context, the method fits inside
the engine (KVzip's reconstruction forward run by the engine), the question tokens are decode steps (appended
exactly, one by one: the same rows a single forward appends) and the answer is the engine's greedy decode.

Dense is the ``dense`` method (every context token exact). ``bytes_ratio`` is what the method reports right after
it is fitted to the context (bytes really held, positions and descriptors included, over the dense context
bytes), before the question is appended.

Question-agnostic scoring (kvpress's setting; the choice written down here): the scorers see ONLY the
context. KVzip reconstructs the context ids alone (its ``score_prefill`` reads the context's ids and record); SnapKV's observation window is the last ``obs_window`` (64) queries of the CONTEXT, i.e.
the end of the haystack, not the question; ExpectedAttention's query statistics and H2O's attention mass
come from the context prefill's queries; the composed cache's low-rank tier is fitted with the context's
statistics (KVzip's reconstruction queries). The question influences nothing before it is fed.
"""
from __future__ import annotations

import statistics
import time

import torch

from ..compat import cache_kw
from ..generation import greedy
from ..kv import METHODS, method_kind
from .kv_sweep import FRONTIER_COMPOSED, FRONTIER_EVICTION, FRONTIER_LOWRANK, frontier_caches, frontier_method
from .longctx import Sample, greedy_decode, make_sample, sample_ids, score, stop_ids

__all__ = ["ADAPTERS", "answer", "BUDGETS", "build_task_samples", "check_policies", "DEFAULT_POLICIES",
           "engine_answer", "evaluate_tasks", "merge_tasks", "policy_answers", "target_tokens", "task_rows", "TASKS",
           "tasks_table"]

TASKS = ("needle_single", "needle_multikey", "variable_tracking")
BUDGETS = (0.5, 0.25)
DEFAULT_POLICIES = ("dense", *FRONTIER_EVICTION, *FRONTIER_LOWRANK, *FRONTIER_COMPOSED)
ADAPTERS = ("hf", "engine")


def check_policies(names) -> list[str]:
    """``names`` validated against the KV registry (dense always first)."""
    bad = [n for n in names if n not in METHODS]
    if bad:
        raise ValueError(f"unknown policies {bad}; choose from {sorted(METHODS)}")
    return ["dense", *dict.fromkeys(n for n in names if n != "dense")]


def target_tokens(length: int, max_positions: int | None, max_new: int) -> int:
    """The prompt length to build for a requested ``length``: ``length`` itself, unless prompt + answer could
    pass the model's context (``max_positions``), then ``max_positions - max_new - `` the fit tolerance
    (``longctx._fit`` lands within max(8, L/50) tokens of its target)."""
    if not max_positions or length + max_new <= max_positions:
        return length
    return max_positions - max_new - max(8, length // 50)


def build_task_samples(tok, tasks=TASKS, lengths=(4096,), n_per: int = 1, seed: int = 0,
                       max_positions: int | None = None, max_new: int = 24,
                       split: str = "test") -> list[tuple[int, Sample]]:
    """[(requested length, sample)]: ``n_per`` samples of every task at every length (WikiText-2 haystacks)."""
    import re

    from ..data import load_text

    text = re.sub(r"\s+", " ", load_text(split))
    return [(L, make_sample(t, tok, text, target_tokens(L, max_positions, max_new), seed + i))
            for L in lengths for t in tasks for i in range(n_per)]


@torch.no_grad()
def answer(model, cache, question: torch.Tensor, max_new: int, stop: set[int] | None) -> list[int]:
    """Greedy answer tokens after feeding ``question`` [1, n_q] through ``cache`` (a KVCache) in one forward
    (exactly, appended)."""
    if question.shape[-1] == 0:
        raise ValueError("answer: the question has no tokens")
    with cache.serving(model):
        logits = model(question, **cache_kw(cache)).logits[:, -1].float()
        return greedy_decode(model, cache, logits, max_new, stop)


@torch.no_grad()
def engine_answer(model, tok, method, ctx: torch.Tensor, question: torch.Tensor, max_new: int,
                  stop: set[int] | None) -> tuple[list[int], float]:
    """(greedy answer tokens, bytes ratio of the fit) with ``method`` served by the runtime engine: the context
    prefilled and fitted inside the engine, the question fed as decode steps, then greedy decoding."""
    from ..kv.engine_adapter import MethodStore
    from ..runtime import Engine, EngineConfig

    store = MethodStore(method, tok)
    eng = Engine(model, EngineConfig(max_batch=1, max_seq_len=ctx.shape[1] + question.shape[1] + max_new + 1),
                 kv=store)
    logits = eng.prefill(ctx)
    for t in question[0]:
        logits = eng.step(t.view(1))
    out = [int(greedy(logits))]
    while len(out) < max_new and not (stop and out[-1] in stop):
        out.append(int(greedy(eng.step(torch.tensor([out[-1]])))))
    return out, store.fit_info["fit"]["bytes_ratio"]


def policy_answers(model, tok, ctx: torch.Tensor, q: torch.Tensor, record, policies: list[str], budgets,
                   window: int, max_new: int, stop, adapter: str = "hf"):
    """Yield ``(policy, kind, budget, answer tokens, bytes ratio)`` for every policy at every budget (dense once,
    at 1.0), through the transformers adapter (every method fitted from ``record``, the context's prefill, as
    ``kv_frontier`` fits them) or the engine adapter."""
    if adapter not in ADAPTERS:
        raise ValueError(f"adapter must be one of {ADAPTERS}, got {adapter!r}")
    jobs = [("dense", 1.0)] + [(p, b) for p in policies if p != "dense" for b in budgets]
    if adapter == "engine":
        for p, b in jobs:
            toks, ratio = engine_answer(model, tok, frontier_method(p, b, window), ctx, q, max_new, stop)
            yield p, method_kind(p), b, toks, ratio
        return
    for p, b in jobs:
        for pol, kind, bb, cache in frontier_caches(model, record, [p], [b], window):
            yield pol, kind, bb, answer(model, cache, q, max_new, stop), cache.describe()["bytes_ratio"]


def task_rows(per_sample: list[dict]) -> list[dict]:
    """Aggregate per-sample records into ``{policy, kind, length, budget, bytes_ratio, task, exact, partial,
    same_as_dense, n_tokens, n}`` rows (means over the samples; ``same_as_dense``: answer tokens identical)."""
    groups: dict = {}
    for r in per_sample:
        groups.setdefault((r["policy"], r["kind"], r["length"], r["budget"], r["task"]), []).append(r)
    order = {"dense": 0, "eviction": 1, "lowrank": 2, "composed": 3}
    rows = []
    for (pol, kind, L, b, task), rs in groups.items():
        mean = lambda k: statistics.fmean(r[k] for r in rs)
        rows.append(dict(policy=pol, kind=kind, length=L, budget=b, bytes_ratio=mean("bytes_ratio"), task=task,
                         exact=mean("exact"), partial=mean("partial"), same_as_dense=mean("same_as_dense"),
                         n_tokens=mean("n_tokens"), n=len(rs)))
    return sorted(rows, key=lambda r: (r["length"], r["task"], -r["budget"], order[r["kind"]], r["policy"]))


@torch.no_grad()
def evaluate_tasks(model, tok, samples: list[tuple[int, Sample]], budgets=BUDGETS, policies=DEFAULT_POLICIES,
                   window: int = 32, max_new: int = 24, progress: bool = True, checkpoint=None,
                   adapter: str = "hf") -> dict:
    """Every policy at every budget on every ``(length, sample)`` (see the module docstring), served by the
    transformers (``adapter="hf"``) or the engine adapter.

    Returns ``{"rows": task_rows(...), "per_sample": [...], "timing_s": {...}}``; ``checkpoint(result)`` is
    called after every sample (long runs keep what they finished)."""
    from tqdm.auto import tqdm

    from ..kv.hf_adapter import record

    policies = check_policies(policies)
    dev = next(model.parameters()).device
    stop = stop_ids(tok)
    n_caches = 1 + (len(policies) - 1) * len(budgets)
    per_sample: list[dict] = []
    res: dict = {"timing_s": {}}
    bar = tqdm(total=len(samples) * n_caches, desc="kv-tasks", disable=not progress)
    for i, (L, s) in enumerate(samples):
        t0 = time.perf_counter()
        ctx, q = sample_ids(tok, s, dev)
        rec = record(model, ctx, tokenizer=tok) if adapter == "hf" else None
        dense_tokens = None
        for pol, kind, b, toks, ratio in policy_answers(model, tok, ctx, q, rec, policies, budgets, window, max_new,
                                                        stop, adapter):
            dense_tokens = toks if kind == "dense" else dense_tokens
            text = tok.decode(toks, skip_special_tokens=True)
            ex, pa = score(text, s.answers)
            per_sample.append(dict(sample=i, task=s.task, length=L, n_tokens=s.n_tokens, n_context=ctx.shape[1],
                                   n_question=q.shape[1], policy=pol, kind=kind, budget=b, bytes_ratio=ratio,
                                   exact=ex, partial=pa, same_as_dense=float(toks == dense_tokens),
                                   output=text, tokens=toks, answers=s.answers))
            bar.set_postfix_str(f"{s.task}@{L} {pol}@{b:g} exact={ex:.0f}")
            bar.update()
        del rec
        res["timing_s"][f"sample{i}_{s.task}_{L}"] = time.perf_counter() - t0
        res |= {"rows": task_rows(per_sample), "per_sample": per_sample}
        if checkpoint is not None:
            checkpoint(res)
    bar.close()
    return res | {"rows": task_rows(per_sample), "per_sample": per_sample}


def merge_tasks(parts: list[dict]) -> dict:
    """One result from several runs (other seeds, lengths or tasks): their per-sample records, renumbered
    (``sample`` unique over the merge, ``source`` = index of the part). The same sample in two parts (same task,
    length, token count and answers) is an error, so a merge never counts a sample twice."""
    per_sample, timing, seen, offset = [], {}, {}, 0
    for k, part in enumerate(parts):
        ids: dict = {}
        for r in part["per_sample"]:
            key = (r["task"], r["length"], r["n_tokens"], tuple(r["answers"]))
            if seen.setdefault(key, k) != k:
                raise ValueError(f"merge_tasks: the {r['task']} sample at length {r['length']} with answers "
                                 f"{r['answers']} is in parts {seen[key]} and {k}")
            ids.setdefault(r["sample"], offset + len(ids))
            per_sample.append(r | {"sample": ids[r["sample"]], "source": k})
        offset += len(ids)
        timing |= {f"part{k}_{n}": t for n, t in part.get("timing_s", {}).items()}
    return {"rows": task_rows(per_sample), "per_sample": per_sample, "timing_s": timing}


def tasks_table(res: dict) -> str:
    """Per length and task: one line per policy, exact match (and the answers equal to dense) per budget."""
    rows = res["rows"]
    lines = []
    for L in sorted({r["length"] for r in rows}):
        for task in sorted({r["task"] for r in rows if r["length"] == L}):
            at = [r for r in rows if r["length"] == L and r["task"] == task]
            bs = sorted({r["budget"] for r in at if r["kind"] != "dense"}, reverse=True)
            n_tok = statistics.fmean(r["n_tokens"] for r in at)
            lines.append(f"\nlength {L} ({n_tok:.0f} tokens), {task}, n={at[0]['n']}: exact [same answer as dense]"
                         f" (bytes held)")
            lines.append(f"{'policy':<22}" + "".join(f"{'budget ' + format(b, 'g'):>24}" for b in bs))
            for pol in dict.fromkeys(r["policy"] for r in at):
                mine = {r["budget"]: r for r in at if r["policy"] == pol}
                if pol == "dense":
                    r = mine[1.0]
                    lines.append(f"{pol:<22}{r['exact']:>10.2f} (partial {r['partial']:.2f})")
                    continue
                cells = [f"{mine[b]['exact']:.2f} [{mine[b]['same_as_dense']:.2f}] ({mine[b]['bytes_ratio']:.3f})"
                         if b in mine else "-" for b in bs]
                lines.append(f"{pol:<22}" + "".join(f"{c:>24}" for c in cells))
    return "\n".join(lines).lstrip("\n")
