"""Benchmarks: ``python -m lowrank_lib.bench decode --help``."""
