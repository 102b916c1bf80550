"""Fidelity audit (FlashSVD v1.5 Table 4, and beyond): greedy token agreement with an fp32 no-cache
reference, plus perplexity through each runtime path.

The reference recomputes the full sequence every step in fp32 with transformers (no cache at
all), on the SAME factors. Per system: ``exact`` = prompts whose whole continuation matches,
``first`` = prompts whose first generated token matches, ``mean_match`` = mean fraction of matching
positions. Perplexity is measured through the prefill path (all logits of a window at once) and the
decode path (teacher-forced one token at a time through ``step``: the cache, packing, graphs).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..generation import run_generation
from ..runtime.baselines import make_runner
from ..runtime.config import EngineConfig
from ..runtime.engine import Engine
from .perplexity import windows

__all__ = ["audit", "audit_line", "certified_audit", "compare_greedy", "equivalence_line", "perplexity_table", "PROMPTS",
           "reference_tokens", "runtime_perplexity"]

PROMPTS = [
    "The capital of France is",
    "Write a short poem about the sea.",
    "def fibonacci(n):",
    "Explain why the sky is blue in one sentence.",
    "The three primary colors are",
    "Translate to French: Good morning, how are you?",
    "List three benefits of regular exercise:",
    "Once upon a time, in a small village,",
    "What is the boiling point of water at sea level?",
    "import numpy as np\n\ndef mean(xs):",
    "The theory of relativity was developed by",
    "Give me a recipe for pancakes.",
    "Summarize the plot of Romeo and Juliet.",
    "The largest planet in the solar system is",
    "How do I reverse a list in Python?",
    "Photosynthesis is the process by which",
    "Name the days of the week:",
    "A haiku about autumn leaves:",
    "The main causes of the French Revolution were",
    "SELECT name FROM users WHERE",
]


@torch.no_grad()
def reference_tokens(model, ids: torch.Tensor, n: int) -> torch.Tensor:
    """fp32, no cache: n greedy tokens by re-running the whole sequence each step. ids [1, T] -> [n]."""
    seq = ids
    out = []
    for _ in range(n):
        nxt = model(seq, use_cache=False).logits[0, -1].argmax()
        out.append(nxt)
        seq = torch.cat([seq, nxt.view(1, 1)], 1)
    return torch.stack(out)


def _fp32(model):
    p = next(model.parameters())
    return model if p.dtype == torch.float32 else copy.deepcopy(model).float()


def audit(model, tok, systems=("hf_dynamic", "hf_static", "dense_kv", "engine"), dtype=None, n_prompts: int = 20,
          n_tokens: int = 64, dense_model=None, progress: bool = True, prompts=None) -> dict:
    """Greedy agreement of each system with the fp32 no-cache reference. Returns a JSON-able dict."""
    prompts = list(prompts or PROMPTS)[:n_prompts]
    enc = [tok(p, return_tensors="pt").input_ids for p in prompts]
    ref_model = _fp32(model)
    refs = [reference_tokens(ref_model, ids, n_tokens) for ids in tqdm(enc, desc="fp32 reference", disable=not progress)]
    S = max(e.shape[1] for e in enc) + n_tokens
    res = {"n_prompts": len(prompts), "n_tokens": n_tokens, "dtype": str(dtype), "systems": {}}
    for s in systems:
        r = make_runner(s, model, dense_model, dtype=dtype, max_seq_len=S)
        exact = first = 0
        matches = []
        for ids, ref in tqdm(list(zip(enc, refs)), desc=s, disable=not progress):
            got = run_generation(r, ids, n_tokens).tokens[0].cpu()
            eq = got == ref
            exact += bool(eq.all())
            first += bool(eq[0])
            matches.append(float(eq.float().mean()))
        res["systems"][s] = {"exact": exact, "first": first, "mean_match": sum(matches) / len(matches),
                             "per_prompt_match": matches}
    return res


@torch.no_grad()
def runtime_perplexity(runner, ids: torch.Tensor, seq_len: int = 256, max_windows: int = 2,
                       mode: str = "decode", progress: bool = False) -> float:
    """Perplexity of a runner on 1-D ``ids`` over the windows of :func:`lowrank_lib.eval.perplexity.windows`.

    ``mode="prefill"``: all logits of a window from one prefill (Engine) or forward (HF runner).
    ``mode="decode"``: prefill the first token, then teacher-force the rest through ``step``.
    """
    nll, count = 0.0, 0
    for x in tqdm(windows(ids, seq_len, max_windows), desc=f"ppl/{mode}", disable=not progress):
        x = x[None]
        if mode == "prefill":
            if isinstance(runner, Engine):
                logits = runner.prefill(x, all_logits=True)[0, :-1]
            else:
                logits = runner.model(x.to(runner.device), use_cache=False).logits[0, :-1]
        elif mode == "decode":
            out = run_generation(runner, x[:, :1], seq_len - 1, return_logits=True, forced_tokens=x[:, 1:])
            logits = torch.cat(out.logits, 0)
        else:
            raise ValueError(f"mode={mode!r}: use 'prefill' or 'decode'")
        nll += float(F.cross_entropy(logits.float().cpu(), x[0, 1:], reduction="sum"))
        count += seq_len - 1
    return math.exp(nll / count)


def perplexity_table(model, tok, systems=("hf_dynamic", "dense_kv", "engine"), dtype=None, seq_len: int = 256,
                     max_windows: int = 2, dense_model=None, split: str = "test") -> dict:
    """WikiText-2 perplexity through each system's prefill and decode paths."""
    from ..data import tokens

    ids = tokens(tok, split)
    out = {}
    for s in systems:
        r = make_runner(s, model, dense_model, dtype=dtype, max_seq_len=seq_len)
        out[s] = {m: runtime_perplexity(r, ids, seq_len, max_windows, m) for m in ("prefill", "decode")}
    return out


def certified_audit(model, tok, dtype: str, n_prompts: int = 20, n_tokens: int = 64, progress: bool = True) -> dict:
    """Greedy tokens of the certified head against the exact head (same engine otherwise, eager) on the fidelity
    audit's prompts (``eval.fidelity.PROMPTS``): prompts whose ``n_tokens`` tokens are identical, the first
    difference of the others, and the certified head's counters over the whole audit."""
    enc = [tok(p, return_tensors="pt").input_ids for p in PROMPTS[:n_prompts]]
    S = max(e.shape[1] for e in enc) + n_tokens
    exact, cert = (Engine(model, EngineConfig(max_batch=1, max_seq_len=S, dtype=dtype, lm_head=head))
                   for head in ("exact", "certified"))
    same, first = 0, []
    for i, ids in enumerate(tqdm(enc, desc=f"certified head audit {dtype}", disable=not progress)):
        a, b = run_generation(exact, ids, n_tokens).tokens[0], run_generation(cert, ids, n_tokens).tokens[0]
        same += bool(torch.equal(a, b))
        if not torch.equal(a, b):
            first.append({"prompt": i, "position": int((a != b).nonzero()[0])})
    return {"prompts": len(enc), "tokens": n_tokens, "identical_prompts": same, "differences": first,
            "lm_head": cert.counters()["lm_head"]}


def audit_line(dtype: str, a: dict) -> str:
    h = a["lm_head"]
    return (f"certified head audit ({dtype}): {a['identical_prompts']}/{a['prompts']} prompts x {a['tokens']} greedy "
            f"tokens identical to the exact head; {h['head_bytes_fraction']:.3f} of the head's bytes read per token, "
            f"{h['fallback_calls']} fallbacks in {h['calls']} calls")


def compare_greedy(tokens_a, logits_a, tokens_b, logits_b) -> dict:
    """Two runtimes' greedy tokens [n] and logits [n, V] (the prefill's first) on the same prompt: are the tokens
    equal, where do they part, the logit differences (and the top-2 margins where they part)."""
    n = min(len(tokens_a), len(tokens_b))
    diff = (tokens_a[:n] != tokens_b[:n]).nonzero()
    first = int(diff[0]) if len(diff) else None
    dl = (logits_a[:n].float() - logits_b[:n].float()).abs().amax(-1)
    res = {"tokens_equal": first is None and len(tokens_a) == len(tokens_b), "n_tokens": n,
           "first_divergence": first, "n_equal_before_divergence": n if first is None else first,
           "max_abs_logit_diff": float(dl.max()), "prefill_abs_logit_diff": float(dl[0]),
           "logit_scale": float(logits_b[0].abs().max())}
    if first is not None:
        top = [lg[first].float().topk(2).values for lg in (logits_a, logits_b)]
        res.update(tokens_a=int(tokens_a[first]), tokens_b=int(tokens_b[first]),
                   top2_margin_a=float(top[0][0] - top[0][1]), top2_margin_b=float(top[1][0] - top[1][1]))
    return res


def equivalence_line(e: dict) -> str:
    return (f"greedy tokens llama.cpp vs lowrank_lib dense ({e['dtype']}): "
            + ("equal" if e["tokens_equal"] else f"diverge at {e['first_divergence']}")
            + f" over {e['n_tokens']} (max |logit diff| {e['max_abs_logit_diff']:.3g}, prefill "
              f"{e['prefill_abs_logit_diff']:.3g}, logit scale {e['logit_scale']:.3g})")
