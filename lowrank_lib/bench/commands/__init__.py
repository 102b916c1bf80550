"""CLI modules of ``python -m lowrank_lib.bench``: each parses its options and calls library code."""
