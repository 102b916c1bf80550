"""Generation: the ONE decode loop every runner shares, its sampler, its output type, the padding rule.

    out = run_generation(runner, input_ids, max_new_tokens=64)     # the Engine or any baseline runner
    out.tokens, out.timings

A runner is a :class:`lowrank_lib.runtime.runner.Runner` (the written protocol: ``prefill``, ``step``,
``prepare(B) -> seconds`` of graph capture / compilation, timed apart from decode, ``device``, ...). The same
loop drives the engine and every baseline, so timings and token streams are comparable. :func:`answer` is the chat-template helper the notebooks use on transformers models.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from .tokentext import decode

NEG_INF = float("-inf")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class GenerateOutput:
    """tokens [B, n_new] (rows that hit EOS are padded with EOS); logits: per step [B, V] if asked."""

    tokens: torch.Tensor
    prefill_s: float
    step_s: list[float]
    total_s: float
    logits: list[torch.Tensor] | None = None
    info: dict = field(default_factory=dict)

    @property
    def decode_ms_per_token(self) -> float:
        """Median decode step latency in ms (one token per row per step)."""
        return 1e3 * statistics.median(self.step_s) if self.step_s else float("nan")

    @property
    def timings(self) -> dict:
        return {"prefill_s": self.prefill_s, "decode_s": sum(self.step_s), "total_s": self.total_s,
                "decode_ms_per_token_median": self.decode_ms_per_token, "steps": len(self.step_s)}


def left_pad_counts(attention_mask: torch.Tensor | None, input_ids: torch.Tensor) -> torch.Tensor:
    """[B] number of left-pad slots; refuses right padding or holes (the caches assume left padding)."""
    B, T = input_ids.shape
    if attention_mask is None:
        return torch.zeros(B, dtype=torch.long, device=input_ids.device)
    m = attention_mask.to(torch.long)
    if m.shape != (B, T):
        raise ValueError(f"attention_mask has shape {tuple(m.shape)}, expected {(B, T)}")
    pad = T - m.sum(1)
    expect = (torch.arange(T, device=m.device)[None, :] >= pad[:, None]).long()
    if not torch.equal(m, expect):
        raise ValueError("attention_mask must be LEFT padded (zeros then ones per row); use "
                         "tokenizer.padding_side='left'")
    if (pad >= T).any():
        raise ValueError("a row of the batch has no real token")
    return pad


def greedy(logits: torch.Tensor) -> torch.Tensor:
    """logits [..., V] -> the index of each row's largest value: ``torch.argmax``'s result (the first of equal maxima;
    a NaN counts as the largest), through ``max(-1).indices``, which gives the same indices (tests/test_generation.py)
    and on bf16 logits is ~4x faster on the CPU: on SmolLM2's [1, 49152] bf16 logits, 1 thread, 45 against 178 us, a
    share of every decoded token's wall time (the same for fp32 logits, ~44 us)."""
    return logits.max(-1).indices


def sample_next(logits: torch.Tensor, do_sample: bool, temperature: float = 1.0, top_k: int = 0,
                top_p: float = 1.0, generator: torch.Generator | None = None) -> torch.Tensor:
    """logits [B, V] -> next tokens [B] (greedy argmax, or temperature / top-k / top-p sampling)."""
    if not do_sample:
        return greedy(logits)
    x = logits.float() / max(temperature, 1e-6)
    if top_k and top_k < x.shape[-1]:
        kth = x.topk(top_k, -1).values[:, -1:]
        x = x.masked_fill(x < kth, NEG_INF)
    if top_p < 1.0:
        srt, idx = x.sort(-1, descending=True)
        cum = srt.softmax(-1).cumsum(-1)
        drop = cum - srt.softmax(-1) > top_p
        srt = srt.masked_fill(drop, NEG_INF)
        x = torch.full_like(x, NEG_INF).scatter(-1, idx, srt)
    p = x.softmax(-1)
    return torch.multinomial(p, 1, generator=generator).squeeze(-1)


def run_generation(runner, input_ids: torch.Tensor, max_new_tokens: int, attention_mask=None,
                   do_sample: bool = False, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                   eos_token_id: int | None = None, generator=None, return_logits: bool = False,
                   forced_tokens: torch.Tensor | None = None) -> GenerateOutput:
    """The ONE decode loop for the engine and all baselines.

    ``runner``: a :class:`lowrank_lib.runtime.runner.Runner` (``prefill``, ``prepare``, ``step``, ``device``).
    ``forced_tokens`` [B, n] teacher-forces the fed tokens (perplexity through the decode path).
    """
    dev = runner.device
    B = input_ids.shape[0]
    _sync(dev)
    t0 = time.perf_counter()
    logits = runner.prefill(input_ids, attention_mask)
    _sync(dev)
    t1 = time.perf_counter()
    capture_s = runner.prepare(B)                  # graphs / compile: not in decode time (0.0 eager)
    t1b = time.perf_counter()
    out, all_logits, steps = [], [], []
    done = torch.zeros(B, dtype=torch.bool, device=logits.device)
    for i in range(max_new_tokens):
        if return_logits:
            all_logits.append(logits.float().clone())
        nxt = forced_tokens[:, i] if forced_tokens is not None else sample_next(
            logits, do_sample, temperature, top_k, top_p, generator)
        if eos_token_id is not None:
            nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
            done |= nxt == eos_token_id
        out.append(nxt)
        if i == max_new_tokens - 1 or (eos_token_id is not None and bool(done.all())):
            break
        ts = time.perf_counter()
        logits = runner.step(nxt)
        _sync(dev)
        steps.append(time.perf_counter() - ts)
    t2 = time.perf_counter()
    toks = torch.stack(out, 1) if out else torch.empty(B, 0, dtype=torch.long)
    return GenerateOutput(toks, t1 - t0, steps, (t2 - t0) - (t1b - t1), all_logits if return_logits else None,
                          {"capture_s": capture_s})


@torch.no_grad()
def answer(model, tokenizer, question: str, max_new_tokens: int = 48, system: str | None = None) -> str:
    """Greedy answer of a transformers instruct model to one user message (the tokenizer's chat template)."""
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    if getattr(tokenizer, "chat_template", None):
        enc = tokenizer.apply_chat_template(msgs, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        ids, mask = enc["input_ids"], enc["attention_mask"]
    else:
        enc = tokenizer(question, return_tensors="pt")
        ids, mask = enc.input_ids, enc.attention_mask
    dev = next(model.parameters()).device
    out = model.generate(ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=max_new_tokens,
                         do_sample=False, pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
    return decode(tokenizer, out[0, ids.shape[1]:].tolist()).strip()   # never U+FFFD (see tokentext)
