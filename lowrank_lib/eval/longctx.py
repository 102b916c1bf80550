"""Long-context tasks generated locally (no downloads): passkey retrieval, RULER-style needles
(single and multi-key), variable tracking. Haystacks are WikiText-2 text; scoring is exact / partial match.

Each :class:`Sample` is a prompt with its expected answers, split as kvpress evaluates: the ``context``
(instruction head + haystack with the needles) and the ``question`` (the tail that asks for the needle),
``prompt = context + question``. :func:`sample_ids` tokenises the two parts SEPARATELY and concatenates
the ids, so the question's tokens are the same whether it is fed after a compressed context
(:mod:`lowrank_lib.eval.kv_tasks`) or as the tail of the full prompt (:func:`evaluate`); every token
count here is of those concatenated ids. :func:`build_samples` makes samples at a target token length,
:func:`evaluate` decodes greedily with every method's cache (the whole prompt is prefilled and compressed
together; the prefill is recorded once per sample and replayed, so all methods see identical prefill
state) and scores the outputs.

:class:`ByteTokenizer` (one token per UTF-8 byte) stands in for a tokenizer with the tiny random models.
"""
from __future__ import annotations

import random
import re
import statistics
from dataclasses import asdict, dataclass
from types import SimpleNamespace

import torch
from tqdm.auto import tqdm

from ..compat import cache_kw
from ..generation import greedy
from ..kv.hf_adapter import KVCache, record

__all__ = ["build_samples", "ByteTokenizer", "evaluate", "greedy_decode", "make_sample", "Sample", "sample_ids",
           "score", "stop_ids", "TASKS"]

TASKS = ("passkey", "needle_single", "needle_multikey", "variable_tracking")
_WORDS = ["apple", "river", "silver", "garden", "violet", "harbor", "meadow", "copper", "falcon", "maple",
          "thunder", "crystal", "lantern", "orchid", "summit", "velvet", "willow", "ember", "glacier", "prairie"]


@dataclass
class Sample:
    task: str
    prompt: str                 # context + question
    answers: list[str]          # every expected string (one for retrieval tasks, several for tracking)
    n_tokens: int = 0           # len(context ids) + len(question ids)
    context: str = ""           # head + haystack with the needles (what a KV press compresses)
    question: str = ""          # the tail asking for the answer (fed exactly after the compressed context)

    def __post_init__(self):
        if (self.context or self.question) and self.context + self.question != self.prompt:
            raise ValueError("Sample: prompt must be context + question")


class ByteTokenizer:
    """One token per UTF-8 byte (ids 0-255): the tokenizer of the tiny random models (vocab 256), so the
    tasks and the KVzip reconstruction prompt run end to end on them. No EOS; decode replaces bad bytes."""

    eos_token_id = None
    chat_template = None
    vocab_size = 256

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        ids = list(str(text).encode("utf-8"))
        return SimpleNamespace(input_ids=torch.tensor([ids], dtype=torch.long) if return_tensors == "pt" else ids)

    def decode(self, ids, skip_special_tokens=False) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(int(i) % 256 for i in ids).decode("utf-8", errors="replace")


def _n_ids(tok, text: str) -> int:
    return len(tok(text, add_special_tokens=False).input_ids)


def sample_ids(tok, sample: Sample, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(context ids [1, n_c], question ids [1, n_q]), each part tokenised on its own; the full prompt's ids
    are their concatenation (a sample without the split has an empty question)."""
    ctx, q = (sample.context, sample.question) if (sample.context or sample.question) else (sample.prompt, "")
    enc = lambda t: torch.tensor([list(tok(t, add_special_tokens=False).input_ids)], dtype=torch.long)
    c_ids, q_ids = enc(ctx), enc(q) if q else torch.zeros(1, 0, dtype=torch.long)
    return c_ids.to(device), q_ids.to(device)


def _haystack(text: str, rng: random.Random, n_chars: int) -> str:
    start = rng.randrange(0, max(1, len(text) - n_chars))
    return text[start:start + n_chars]


def _fit(tok, make, question: str, target: int) -> tuple[str, int]:
    """Grow the haystack (chars) of the context ``make(n_chars)`` until context + ``question`` is ~target
    tokens (counted as the concatenation of the separately tokenised parts)."""
    n_chars = target * 4
    n_q = _n_ids(tok, question)
    for _ in range(6):
        n = _n_ids(tok, make(n_chars)) + n_q
        if abs(n - target) <= max(8, target // 50):
            break
        n_chars = max(64, int(n_chars * target / max(n, 1)))
    c = make(n_chars)
    return c, _n_ids(tok, c) + n_q


def _insert(hay: str, needle: str, depth: float) -> str:
    cut = int(len(hay) * depth)
    cut = hay.rfind(" ", 0, cut) + 1 if " " in hay[:cut] else cut
    return f"{hay[:cut]} {needle} {hay[cut:]}"


def _needle_maker(text: str, seed: int, head: str, needles: list[str], depths: list[float]):
    """context(n_chars): head + haystack of n_chars with each needle inserted at its depth."""
    def make(n_chars: int) -> str:
        hay = _haystack(text, random.Random(seed), n_chars)
        for nd, dp in sorted(zip(needles, depths), key=lambda t: -t[1]):   # deepest first keeps offsets valid
            hay = _insert(hay, nd, dp)
        return head + hay
    return make


def make_sample(task: str, tok, text: str, n_tokens: int, seed: int) -> Sample:
    """One sample of ``task`` at about ``n_tokens`` tokens (deterministic in ``seed``)."""
    rng = random.Random(f"{task}-{n_tokens}-{seed}")
    depth = rng.random()
    if task == "passkey":
        key = str(rng.randrange(10000, 99999))
        head = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                "I will quiz you about the important information there.\n")
        needle = f"The pass key is {key}. Remember it. {key} is the pass key."
        tail = "\nWhat is the pass key? The pass key is"
        make = lambda n: head + _insert(_haystack(text, random.Random(seed), n), needle, depth)
        answers = [key]
    elif task in ("needle_single", "needle_multikey"):
        n_needles = 1 if task == "needle_single" else 4
        keys = rng.sample(_WORDS, n_needles)
        vals = [str(rng.randrange(1000000, 9999999)) for _ in keys]
        depths = sorted(rng.random() for _ in keys)
        needles = [f"One of the special magic numbers for {k} is: {v}." for k, v in zip(keys, vals)]
        q = rng.randrange(n_needles)
        head = "Some special magic numbers are hidden within the following text. Make sure to memorize them.\n"
        tail = f"\nWhat is the special magic number for {keys[q]} mentioned in the text? The special magic " \
               f"number for {keys[q]} is:"

        make = _needle_maker(text, seed, head, needles, depths)
        answers = [vals[q]]
    elif task == "variable_tracking":
        value = str(rng.randrange(10000, 99999))
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(4)]
        chain = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 4)]
        depths = sorted(rng.random() for _ in chain)
        head = "Memorize and track the chain(s) of variable assignment hidden in the following text.\n"
        tail = f"\nQuestion: Find all variables that are assigned the value {value} in the text above. " \
               f"Answer: According to the chain(s) of variable assignment in the text above, 4 variables are " \
               f"assigned the value {value}, they are:"

        make = _needle_maker(text, seed, head, chain, depths)
        answers = names
    else:
        raise ValueError(f"unknown task {task!r}; choose from {TASKS}")
    context, n = _fit(tok, make, tail, n_tokens)
    return Sample(task, context + tail, answers, n, context=context, question=tail)


def build_samples(tok, tasks=TASKS, lengths=(1024,), n_per: int = 2, seed: int = 0,
                  split: str = "test") -> list[Sample]:
    """``n_per`` samples of every task at every target length."""
    from ..data import load_text

    text = re.sub(r"\s+", " ", load_text(split))
    return [make_sample(t, tok, text, L, seed + i) for t in tasks for L in lengths for i in range(n_per)]


def score(output: str, answers: list[str]) -> tuple[float, float]:
    """(exact, partial): exact = every answer appears in the output; partial = fraction that appear
    (for a single answer: the longest matching prefix of it found in the output / its length)."""
    found = [a in output for a in answers]
    exact = float(all(found))
    if len(answers) > 1:
        return exact, sum(found) / len(answers)
    a = answers[0]
    best = max((k for k in range(len(a) + 1) if a[:k] in output), default=0)
    return exact, best / len(a)


@torch.no_grad()
def greedy_decode(model, cache, first_logits: torch.Tensor, max_new: int,
                  stop_ids: set[int] | None = None) -> list[int]:
    """Manual forward loop: greedy tokens after a prefill whose last logits are ``first_logits`` [1, V];
    stops after ``max_new`` tokens or at a token in ``stop_ids`` (kept)."""
    dev = next(model.parameters()).device
    nxt = greedy(first_logits).view(1, 1).to(dev)
    out = [int(nxt)]
    while len(out) < max_new and not (stop_ids and out[-1] in stop_ids):
        logits = model(nxt, **cache_kw(cache)).logits[:, -1]
        nxt = greedy(logits).view(1, 1)
        out.append(int(nxt))
    return out


def stop_ids(tok) -> set[int]:
    """Token ids that end an answer: EOS and tokens containing a newline."""
    ids = {i for i in (tok.eos_token_id,) if i is not None}
    for t in ("\n", ".\n", "\n\n"):
        enc = tok(t, add_special_tokens=False).input_ids
        if len(enc) == 1:
            ids.add(enc[0])
    return ids


@torch.no_grad()
def evaluate(model, tok, samples: list[Sample], methods: dict, max_new: int = 24,
             progress: bool = True) -> dict:
    """Score every method on every sample. methods: name -> a KV method (``lowrank_lib.kv.make_method``), fitted
    from each sample's recorded prefill.

    Returns {"per_sample": [...], "summary": {method: {task: {"exact", "partial", "n"}}}}.
    """
    dev = next(model.parameters()).device
    stop = stop_ids(tok)
    rows = []
    for s in tqdm(samples, desc="long-context samples", disable=not progress):
        ids = torch.cat(sample_ids(tok, s, dev), 1)       # the same ids as kv_tasks' context + question
        rec = record(model, ids, tokenizer=tok)
        for name, method in methods.items():
            cache = KVCache.from_prefill(method, rec, model)
            with cache.serving(model):
                toks = greedy_decode(model, cache, rec.last_logits, max_new, stop)
            text = tok.decode(toks, skip_special_tokens=True)
            ex, pa = score(text, s.answers)
            rows.append({"method": name, "task": s.task, "n_tokens": s.n_tokens, "exact": ex, "partial": pa,
                         "output": text, "answers": s.answers})
        del rec
    summary: dict = {}
    for name in methods:
        summary[name] = {}
        for task in sorted({r["task"] for r in rows}):
            rs = [r for r in rows if r["method"] == name and r["task"] == task]
            summary[name][task] = {"exact": statistics.fmean(r["exact"] for r in rs),
                                   "partial": statistics.fmean(r["partial"] for r in rs), "n": len(rs)}
        allr = [r for r in rows if r["method"] == name]
        summary[name]["all"] = {"exact": statistics.fmean(r["exact"] for r in allr),
                                "partial": statistics.fmean(r["partial"] for r in allr), "n": len(allr)}
    kept = [asdict(s) | {"prompt": s.prompt[-200:], "context": s.context[-200:]} for s in samples]
    return {"per_sample": rows, "summary": summary, "samples": kept}
