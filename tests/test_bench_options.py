"""One flag vocabulary across the bench commands: --prompt-len / --gen-len / --threads, space-separated lists (a
comma-separated value still splits), old spellings kept as deprecated aliases that warn and set the new option."""
from __future__ import annotations

import pytest

from lowrank_lib.bench.cli import COMMANDS, parser


def _parse(*argv):
    return parser().parse_args(list(argv))


def test_lists_take_both_styles():
    a = _parse("decode", "--systems", "engine", "engine_step")
    b = _parse("decode", "--systems", "engine,engine_step")
    assert a.systems == b.systems == ["engine", "engine_step"]
    assert _parse("fidelity", "--dtypes", "fp32").dtypes == ["fp32"]
    assert _parse("kv-decode", "--budgets", "0.5", "0.25").budgets == [0.5, 0.25]


@pytest.mark.parametrize("argv,dest,value", [
    (("kv-decode", "--new", "7"), "gen_len", 7),
    (("fidelity", "--tokens", "9"), "gen_len", 9),
    (("factor-space", "--gen", "3"), "gen_len", 3),
    (("kv-tasks", "--max-new", "5"), "gen_len", 5),
    (("kv-tasks", "--lengths", "256", "512"), "prompt_len", [256, 512]),
    (("kv-frontier", "--prefill", "128"), "prompt_len", [128]),
    (("attsvd", "--prefill", "64", "96"), "prompt_len", [64, 96]),
])
def test_old_spellings_warn_and_set_the_new_option(capsys, argv, dest, value):
    assert getattr(_parse(*argv), dest) == value
    assert "deprecated" in capsys.readouterr().err


def test_every_command_has_threads_and_new_names_only_in_help():
    p = parser()
    sub = next(a for a in p._actions if a.dest == "command")
    for name in COMMANDS:
        text = sub.choices[name].format_help()
        assert "--threads" in text, name
        for old in ("--new ", "--tokens ", "--max-new", "--prefill "):
            assert old not in text, (name, old)
