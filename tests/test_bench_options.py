"""ONE flag vocabulary across every bench command (:mod:`lowrank_lib.bench.options`): the parser of every
subcommand in ``cli.COMMANDS`` is walked; a second spelling of a concept, or a canonical flag of another shape
(not a space-separated list of its type), fails."""
from __future__ import annotations

import argparse
import re

import pytest

from lowrank_lib.bench import cli
from lowrank_lib.bench.options import VOCABULARY

CANONICAL = {flag: type_ for flag, type_, _ in VOCABULARY.values()}
#: shapes that spell a vocabulary concept (or a retired alias) another way
SECOND_SPELLING = re.compile(r"seq-len|context|lengths|prefill|max-new|tokens|keep|budget|thread|prompt-len|(^|-)gen|"
                             r"(^|-)(cont|new|step|len)($|-)")
#: flags that match a shape above but name another concept, each with its reason (options.py's second table)
ALLOWED = {
    "--calib-len": "tokens per calibration sample (quality), not an evaluated prompt",
    "--longctx-len": "prompt tokens of the long-context tasks, beside the quality windows' --prompt-len (attsvd)",
    "--longctx-budget": "the --budget of the long-context tasks, beside the quality windows' --budget (attsvd)",
    "--budget-s": "seconds of device time (gpu-session: the GPU guide's command line), not KV bytes",
}


def subparsers(ap: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices


def vocabulary_errors(ap: argparse.ArgumentParser) -> list[str]:
    """Every broken rule of the vocabulary in every subcommand of ``ap``."""
    errors = []
    for name, sub in subparsers(ap).items():
        flags = {s: a for a in sub._actions for s in a.option_strings if s.startswith("--")}
        if "--threads" not in flags:
            errors.append(f"{name}: no --threads")
        for flag, a in flags.items():
            if flag in CANONICAL:
                if a.nargs != "+" or a.type is not CANONICAL[flag]:
                    errors.append(f"{name} {flag}: nargs={a.nargs!r} type={a.type}, the vocabulary says "
                                  f"nargs='+' type={CANONICAL[flag].__name__}")
            elif flag == "--tasks":
                if a.type not in (None, str) or a.nargs not in ("+", "*"):
                    errors.append(f"{name} --tasks: task names are a list of str, got nargs={a.nargs!r} {a.type}")
            elif SECOND_SPELLING.search(flag[2:]) and flag not in ALLOWED:
                errors.append(f"{name} {flag}: a second spelling of a vocabulary concept")
    return errors


def test_every_command_speaks_the_one_vocabulary():
    errors = vocabulary_errors(cli.parser())
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("add, why", [
    (lambda p: p.add_argument("--contexts", type=int, nargs="+"), "second spelling"),
    (lambda p: p.add_argument("--prefill", type=int), "second spelling"),
    (lambda p: p.add_argument("--max-new", type=int), "second spelling"),
    (lambda p: p.add_argument("--cont", type=int), "second spelling"),
    (lambda p: p.add_argument("--keeps", type=float, nargs="+"), "second spelling"),
    (lambda p: p.add_argument("--count-tokens", type=int), "second spelling"),
    (lambda p: p.add_argument("--gen-len", type=int), "nargs=None"),
    (lambda p: p.add_argument("--budget", type=int, nargs="+"), "type=<class 'int'>"),
    (lambda p: p.add_argument("--tasks", type=int), "task names"),
])
def test_the_walk_fails_on_a_broken_parser(add, why):
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers().add_parser("x")
    sub.add_argument("--threads", type=int, nargs="+")
    add(sub)
    errors = vocabulary_errors(ap)
    assert len(errors) == 1 and why in errors[0], errors


def test_a_command_without_threads_fails():
    ap = argparse.ArgumentParser()
    ap.add_subparsers().add_parser("x")
    assert vocabulary_errors(ap) == ["x: no --threads"]


def test_lists_and_one_value(tmp_path):
    a = cli.parser().parse_args(["decode", "--systems", "engine", "engine_step", "--keep", "0.5"])
    assert a.systems == ["engine", "engine_step"] and a.keep == [0.5] and a.prompt_len == [512]
    assert cli.parser().parse_args(["kv-decode", "--budget", "0.5", "0.25"]).budget == [0.5, 0.25]
    with pytest.raises(SystemExit):                    # a value of the wrong type is a usage error
        cli.parser().parse_args(["decode", "--prompt-len", "x"])
    with pytest.raises(SystemExit, match="--keep takes one value"):
        cli.main(["decode", "--keep", "0.5", "0.6", "--model", "tiny-gqa", "--prompt-len", "4", "--gen-len", "2",
                  "--repeats", "1", "--systems", "engine", "--out", str(tmp_path)])


def test_threads_one_value_or_a_declared_sweep(monkeypatch, tmp_path):
    """A command outside cli.THREAD_SWEEPS runs at one thread count; a sweep takes several."""
    import torch

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    with pytest.raises(SystemExit, match="--threads takes one value"):
        cli.main(["layout", "--threads", "1", "2", "--model", "tiny-gqa", "--working-set-mb", "1", "--repeats", "1",
                  "--out", str(tmp_path)])
    assert calls == []
    assert cli.parser().parse_args(["kv-decode", "--threads", "1", "2"]).threads == [1, 2]
    assert cli.THREAD_SWEEPS <= set(cli.COMMANDS)
