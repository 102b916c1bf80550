"""WikiText-2 from the repository's ``data/`` folder: calibration (valid) and evaluation (test).

The raw files are the tokenised release with ``<unk>``; lines are joined with "\\n\\n" as SVD-LLM,
ASVD and Basis Sharing do before tokenising. Nothing is downloaded.
"""
from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import torch

__all__ = ["calibration_batches", "chat_calibration_batches", "data_dir", "load_text", "random_token_batches",
           "SPLITS", "token_stream", "tokens"]

SPLITS = ("valid", "test")


def data_dir() -> Path:
    """``<checkout>/data/wikitext-2`` (shipped with the repository)."""
    from .models import repo_root

    root = repo_root()
    d = (root / "data" / "wikitext-2") if root else None
    if d is None or not d.is_dir():
        raise FileNotFoundError(f"WikiText-2 not found at {d}; lowrank_lib reads it from the source checkout's "
                                f"data/ folder (install with `pip install -e .`)")
    return d


def load_text(split: str = "test", path: str | Path | None = None) -> str:
    """The split's raw text, lines joined by "\\n\\n"."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    p = Path(path) if path else data_dir() / f"{split}.txt"
    lines = p.read_text(encoding="utf-8").splitlines()
    return "\n\n".join(lines)


@lru_cache(maxsize=8)
def tokens(tokenizer, split: str = "test") -> torch.Tensor:
    """The whole split as one 1-D LongTensor of token ids (cached per tokenizer object)."""
    return tokenizer(load_text(split), return_tensors="pt", add_special_tokens=False).input_ids[0]


def calibration_batches(tokenizer, n_samples: int = 32, seq_len: int = 512, seed: int = 0,
                        split: str = "valid") -> torch.Tensor:
    """``[n_samples, seq_len]`` random windows of the VALID split, reproducible from ``seed``.

    Window starts are drawn with a private ``torch.Generator`` so global RNG state is untouched.
    """
    ids = tokens(tokenizer, split)
    if ids.numel() <= seq_len:
        raise ValueError(f"{split} split has {ids.numel()} tokens, fewer than seq_len={seq_len}")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, ids.numel() - seq_len, (n_samples,), generator=g)
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


def chat_calibration_batches(tokenizer, n_samples: int = 8, seq_len: int = 512, seed: int = 0, turns: int = 3,
                             split: str = "valid") -> torch.Tensor:
    """``[n_samples, seq_len]`` calibration ids in the tokenizer's chat format (plain windows without one).

    Each sample is one random window of :func:`calibration_batches` (same ``seed``), its text cut into
    ``2 * turns`` consecutive pieces that become alternating user / assistant messages of one conversation,
    rendered with the chat template (default system prompt included) and cut to ``seq_len`` tokens. An
    instruct model's chat tokens (roles, turn ends) never occur in plain WikiText; activation-aware
    compressors calibrated on it lose the directions they use (SVD-LLM on SmolLM2-Instruct then answers
    with an immediate end of turn).
    """
    raw = calibration_batches(tokenizer, n_samples, seq_len, seed, split)
    if not getattr(tokenizer, "chat_template", None):
        return raw
    rows = []
    for window in raw:
        text = tokenizer.decode(window)
        at_space = [text.find(" ", round(i * len(text) / (2 * turns))) for i in range(1, 2 * turns)]
        cuts = [0, *[c if c >= 0 else len(text) for c in at_space], len(text)]   # never inside a word
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": text[a:b].strip()}
                for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
        ids = tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=True, return_tensors="pt")["input_ids"][0]
        while ids.numel() < seq_len:                    # re-tokenised text can come out shorter: repeat it
            ids = torch.cat([ids, window])
        rows.append(ids[:seq_len])
    return torch.stack(rows)


def random_token_batches(vocab_size: int, n_samples: int, seq_len: int, seed: int = 0) -> torch.Tensor:
    """Seeded random ids for tiny models without a tokenizer: ``[n_samples, seq_len]``."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (n_samples, seq_len), generator=g)


def token_stream(tokenizer, length: int, vocab_size: int, split: str = "test", seed: int = 0) -> torch.Tensor:
    """The first ``length`` token ids of ``split`` (1-D), or, without a tokenizer (a checkpoint alone), ``length``
    seeded random ids below ``vocab_size``: what a prompt of a timing or a recording is cut from."""
    if tokenizer is None:
        return random_token_batches(vocab_size, 1, length, seed)[0]
    ids = tokens(tokenizer, split)
    if ids.numel() < length:
        raise ValueError(f"{split} has {ids.numel()} tokens, fewer than the {length} asked for")
    return ids[:length]
