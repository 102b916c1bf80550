"""Readable text from token ids, never the replacement character U+FFFD.

A byte-level BPE token can hold part of a UTF-8 character ("é" is two tokens in some vocabularies);
decoding it alone gives U+FFFD, and so does a generated sequence whose bytes are not valid UTF-8 (a
broken model's gibberish, or generation stopped inside a character).

* :func:`token_label`: one token's text, or its escaped bytes (``'\\xc3'``) when it holds part of a character;
* :func:`decode`: a whole sequence, decoded at once; a character cut at the end is dropped and invalid
  bytes inside are shown escaped (byte-level vocabularies) instead of as U+FFFD.
"""
from __future__ import annotations

from functools import lru_cache

REPLACEMENT = "\ufffd"


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character that stands for each byte -> byte."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def token_label(tok, token_id: int) -> str:
    """The text of one token; a token that is only part of a character is shown as its escaped bytes."""
    text = tok.decode([int(token_id)])
    if REPLACEMENT not in text:
        return text
    piece = tok.convert_ids_to_tokens(int(token_id))
    dec = _byte_decoder()
    if piece and all(ch in dec for ch in piece):                      # byte-level BPE piece
        return bytes(dec[ch] for ch in piece).decode("utf-8", errors="backslashreplace")
    return piece.replace(REPLACEMENT, "?") if piece else "?"         # e.g. SentencePiece byte fallback "<0xE2>"


def _escaped_bytes(tok, ids) -> str | None:
    """The sequence's bytes decoded with invalid parts escaped, for a byte-level BPE vocabulary (else None)."""
    pieces = tok.convert_ids_to_tokens([int(i) for i in ids], skip_special_tokens=True)
    dec = _byte_decoder()
    if not all(ch in dec for p in pieces for ch in p):
        return None
    return bytes(dec[ch] for p in pieces for ch in p).decode("utf-8", errors="backslashreplace")


def decode(tok, ids) -> str:
    """Decode ``ids`` as one sequence (special tokens skipped) without U+FFFD: a partial character at the
    end is dropped (at most the 3 trailing tokens of a 4-byte sequence), invalid bytes inside are escaped."""
    ids = [int(i) for i in ids]
    text = tok.decode(ids, skip_special_tokens=True)
    if REPLACEMENT not in text:
        return text
    if text.endswith(REPLACEMENT):
        for cut in range(1, min(3, len(ids) - 1) + 1):
            shorter = tok.decode(ids[:-cut], skip_special_tokens=True)
            if not shorter.endswith(REPLACEMENT):
                ids, text = ids[:-cut], shorter
                break
    if REPLACEMENT not in text:
        return text
    return _escaped_bytes(tok, ids) or text


def token_labels(tok, token_ids) -> list[str]:
    """:func:`token_label` of every id (a list, in order)."""
    return [token_label(tok, t) for t in token_ids]
