"""CLI modules of ``python -m lowrank_lib.bench``: each parses its options and calls library code."""
from __future__ import annotations

import sys


def report(files, result: dict, **tables: str) -> int:
    """Write a run's result and its tables (``md=`` / ``txt=``: :class:`~lowrank_lib.bench.results.ResultFiles`),
    print the tables and where the files went; the command's exit status 0."""
    path = files.write(result, **tables)
    print(*tables.values(), f"\nwrote {path}", sep="\n")
    return 0


def sweep_failed(error, files) -> int:
    """A sweep task failed twice (``executor.SweepError``): say which and where the partial result is; status 1."""
    print(f"{error}\npartial results: {files.path}", file=sys.stderr)
    return 1
