"""ONE flag vocabulary for every ``bench`` command: ``--prompt-len``, ``--gen-len``, ``--threads`` and lists as
space-separated values (``--budgets 0.5 0.25``). Old spellings stay as deprecated aliases for one release: they
still work and warn (on stderr) with the new name.
"""
from __future__ import annotations

import argparse
import sys


class Deprecated(argparse.Action):
    """Store like the new flag and warn that the old spelling will go."""

    def __init__(self, option_strings, dest, new: str = "", split_commas: bool = False, **kw):
        self.new, self.split_commas = new, split_commas
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"warning: {option_string} is deprecated and will be removed in the next release; use {self.new}",
              file=sys.stderr)
        if self.split_commas:
            values = [v for x in (values if isinstance(values, list) else [values]) for v in str(x).split(",") if v]
            values = [self.type(v) if self.type else v for v in values] if self.type else values
        setattr(namespace, self.dest, values)


def add_list(p, flag: str, type_, default, help_: str, old: str | None = None) -> None:
    """A list option, space-separated (``nargs="+"``); a comma-separated value is split too (the old style).

    ``default=None`` leaves the option ``None`` when not given (the command picks, and ``help_`` says how); a
    value ``type_`` refuses is a usage error naming the flag."""
    class Split(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None):
            vals = [v for x in values for v in str(x).split(",") if v]
            try:
                setattr(namespace, self.dest, [type_(v) for v in vals])
            except ValueError as e:
                parser.error(f"{option_string}: {e}")

    dest = flag.lstrip("-").replace("-", "_")
    shown = "" if default is None else f"; default {' '.join(map(str, default))}"
    p.add_argument(flag, nargs="+", action=Split, default=None if default is None else list(default), dest=dest,
                   help=f"{help_} (space-separated{shown})")
    if old:
        p.add_argument(old, nargs="+", dest=dest, action=Deprecated, new=flag, split_commas=True, type=type_,
                       help=argparse.SUPPRESS)


def _int_option(p, flag: str, default, help_: str, old: str | None) -> None:
    dest = flag.lstrip("-").replace("-", "_")
    p.add_argument(flag, type=int, default=default, dest=dest, help=f"{help_} (default {default})")
    if old:
        p.add_argument(old, type=int, dest=dest, action=Deprecated, new=flag, help=argparse.SUPPRESS)


def add_prompt_len(p, default: int, help_: str = "prompt tokens", old: str | None = None) -> None:
    _int_option(p, "--prompt-len", default, help_, old)


def add_gen_len(p, default: int, help_: str = "generated (decode) tokens", old: str | None = None) -> None:
    _int_option(p, "--gen-len", default, help_, old)
