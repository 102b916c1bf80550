"""Readable labels for single tokens.

A byte-level BPE token can hold part of a UTF-8 character ("é" is two tokens in some vocabularies);
decoding it alone gives U+FFFD. :func:`token_label` shows such a token as its bytes instead
(``'\\xc3'``), so tables and axis labels never print the replacement character.
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


def token_labels(tok, token_ids) -> list[str]:
    """:func:`token_label` of every id (a list, in order)."""
    return [token_label(tok, t) for t in token_ids]
