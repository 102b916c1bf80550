"""Small text-generation helpers for notebooks and examples (greedy, chat template when present)."""
from __future__ import annotations

import torch

from .tokentext import decode


@torch.no_grad()
def answer(model, tokenizer, question: str, max_new_tokens: int = 48, system: str | None = None) -> str:
    """Greedy answer of an instruct model to one user message (uses the tokenizer's chat template)."""
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
