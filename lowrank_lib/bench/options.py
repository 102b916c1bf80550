"""ONE flag vocabulary for every ``bench`` command: one spelling and one type per concept.

=================  =============  ===============================================================
flag               type           meaning
=================  =============  ===============================================================
``--prompt-len``   list of int    prompt (prefill / context / evaluation window) tokens
``--gen-len``      list of int    generated (decode / continuation / audit) tokens
``--threads``      list of int    torch / kernel thread counts (added by the CLI to every command)
``--keep``         list of float  fraction of the model's parameters kept
``--budget``       list of float  fraction of the dense KV bytes really held
=================  =============  ===============================================================

Every one of them is a list (``nargs="+"``, space-separated): a sweep takes several values of the same flag,
a command that runs one value takes the list and refuses more than one with :func:`one` (an error naming the
flag). There are no aliases. Concepts that are NOT one of the above have their own single name, the same in
every command that has them:

====================  =====================================================================================
``--calib-len``       tokens per calibration sample (quality), not an evaluated prompt
``--longctx-len``     prompt tokens of the long-context tasks beside the quality windows (attsvd)
``--longctx-budget``  ``--budget`` of the long-context tasks (attsvd)
``--feed``            teacher-forced continuation tokens fed per forward (attsvd), not a generated length
``--windows``         how many evaluation windows (every perplexity / KL protocol)
``--tasks``           task NAMES (long-context / RULER-style), never a count
``--parts``           how many sweep tasks a run is split into (kv-frontier, the executor)
``--budget-s``        seconds of device time of gpu-session (the GPU guide's command line), not KV bytes
====================  =====================================================================================

``tests/test_bench_options.py`` walks every subcommand's parser and fails on a second spelling of any concept
above or on a canonical flag of another shape.
"""
from __future__ import annotations

#: the canonical flags: dest -> (flag, element type, what it means)
VOCABULARY: dict[str, tuple[str, type, str]] = {
    "prompt_len": ("--prompt-len", int, "prompt tokens"),
    "gen_len": ("--gen-len", int, "generated (decode) tokens"),
    "threads": ("--threads", int, "thread counts"),
    "keep": ("--keep", float, "fraction of parameters kept"),
    "budget": ("--budget", float, "fraction of the dense KV bytes held"),
}


def add_list(p, flag: str, type_, default, help_: str) -> None:
    """A list option, space-separated (``nargs="+"``); ``default=None`` leaves it ``None`` when not given (the
    command picks, and ``help_`` says how); a value ``type_`` refuses is a usage error naming the flag."""
    shown = "" if default is None else f"; default {' '.join(map(str, default))}"
    p.add_argument(flag, nargs="+", type=type_, default=None if default is None else list(default),
                   help=f"{help_} (space-separated{shown})")


def _vocab(p, dest: str, default, help_: str | None) -> None:
    flag, type_, meaning = VOCABULARY[dest]
    if default is not None and not isinstance(default, (list, tuple)):
        default = [default]
    add_list(p, flag, type_, default, help_ or meaning)


def add_prompt_len(p, default=None, help_: str | None = None) -> None:
    _vocab(p, "prompt_len", default, help_)


def add_gen_len(p, default=None, help_: str | None = None) -> None:
    _vocab(p, "gen_len", default, help_)


def add_threads(p, default=None, help_: str | None = None) -> None:
    _vocab(p, "threads", default, help_)


def add_keep(p, default=None, help_: str | None = None) -> None:
    _vocab(p, "keep", default, help_)


def add_budget(p, default=None, help_: str | None = None) -> None:
    _vocab(p, "budget", default, help_)


def one(values, flag: str):
    """The single value of a list flag for a command that runs one (None stays None); more than one is an
    error naming the flag."""
    if values is None or not isinstance(values, (list, tuple)):
        return values
    if len(values) != 1:
        raise SystemExit(f"error: {flag} takes one value in this command, got {len(values)}: "
                         f"{' '.join(map(str, values))}")
    return values[0]
