"""A bounded look at a pickle's opcodes before anything unpickles it.

Why our own pass (with the standard library's :func:`pickletools.genops`, which only parses):

* detection needs the globals a pickle names without unpickling it;
* CPython's C unpickler sizes its memo from the index a ``PUT`` names: one ``LONG_BINPUT
  0xFFFFFFFF`` asks it for 64 GB. Real pickles number memo entries 0, 1, 2, ...; an index
  beyond the number of entries so far is refused here;
* a ``FRAME`` longer than the bytes left, an unknown opcode or a stream without ``STOP`` is
  refused with its byte position;
* the pass stops after :data:`MAX_OPS` opcodes (about a second of pure Python; a 30-layer model
  with its tokenizer is ~50 000), so a huge or endless opcode stream costs bounded time, and
  the unpickler that follows can build at most that many objects.

The globals found are exact for what ``torch.save`` writes (``GLOBAL`` opcodes, or two strings
then ``STACK_GLOBAL``, possibly through the memo); for a hand-made pickle they are a best
effort. That only affects detection: loading checks every global itself in ``find_class``.
"""
from __future__ import annotations

import pickletools
from dataclasses import dataclass, field

from .errors import CheckpointError, fail

#: Opcode budget of one pickle (see the module doc).
MAX_OPS = 2_000_000

_STRING_OPS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING",
               "STRING"}
_PUT_OPS = {"PUT", "BINPUT", "LONG_BINPUT"}
_GET_OPS = {"GET", "BINGET", "LONG_BINGET"}


@dataclass
class Scan:
    n_ops: int = 0
    protocol: int = 0
    end: int = 0                       # byte offset just past STOP (relative to the start)
    globals: set[tuple[str, str]] = field(default_factory=set)

    def names(self) -> set[str]:
        return {f"{m}.{n}" for m, n in self.globals}


def scan(stream, source, max_ops: int = MAX_OPS, length: int | None = None) -> Scan:
    """Walk one pickle in ``stream`` (a binary file object positioned at its first byte) up to STOP.

    ``length``: bytes available from the start (for the FRAME check); ``source`` names the file in errors.
    """
    start = stream.tell()
    out = Scan()
    memo: dict[int, object] = {}
    n_memo = 0
    strings: list[str] = []          # the last two string values pushed (STACK_GLOBAL operands)
    top_string: str | None = None    # the top of the stack, if the last push was a string
    try:
        for op, arg, pos in pickletools.genops(stream):
            out.n_ops += 1
            if out.n_ops > max_ops:
                fail(source, f"pickle has more than {max_ops} opcodes (stopped at byte {pos}); refusing to unpickle "
                             f"it (a real checkpoint has far fewer)")
            name = op.name
            pushed = None
            if name == "PROTO":
                out.protocol = arg
            elif name == "FRAME":
                if length is not None and (pos - start) + 9 + arg > length:
                    fail(source, f"pickle FRAME at byte {pos} claims {arg} bytes, more than the file holds")
            elif name in _STRING_OPS:
                pushed = arg.decode("latin-1") if isinstance(arg, bytes) else str(arg)
            elif name in _PUT_OPS or name == "MEMOIZE":     # memoize the top of the stack; pushes nothing
                idx = n_memo if name == "MEMOIZE" else int(arg)
                if idx > n_memo:
                    fail(source, f"pickle memo index {idx} at byte {pos} skips past the {n_memo} entries so far "
                                 f"(a memo-growth attack or corruption)")
                memo[idx] = top_string
                n_memo = max(n_memo, idx + 1)
                continue
            elif name in _GET_OPS:
                pushed = memo.get(int(arg))
            elif name == "GLOBAL":
                mod, _, nm = str(arg).partition(" ")
                out.globals.add((mod, nm))
            elif name == "STACK_GLOBAL":
                if len(strings) >= 2:
                    out.globals.add((strings[-2], strings[-1]))
            if isinstance(pushed, str):
                strings = (strings + [pushed])[-2:]
            top_string = pushed if isinstance(pushed, str) else None
            if name == "STOP":
                break
    except CheckpointError:
        raise
    except (ValueError, EOFError, TypeError, OverflowError, UnicodeDecodeError) as e:   # genops' parse errors
        fail(source, f"corrupt pickle ({e})")
    out.end = stream.tell() - start
    return out


__all__ = ["MAX_OPS", "Scan", "scan"]
