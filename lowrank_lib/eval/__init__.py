"""Evaluation protocols: perplexity windowing, keep-ratio sweeps, the family quality table, the runtime
fidelity audit, KV-cache quality and budget sweeps, long-context tasks, the KV method registry.

Benchmarks (``python -m lowrank_lib.bench``) call these; so do the notebooks.
"""
from .perplexity import PerplexityResult, perplexity, wikitext_perplexity, windows
from .sweep import ppl_vs_keep, sensitivity_by_type

__all__ = ["PerplexityResult", "perplexity", "ppl_vs_keep", "sensitivity_by_type", "wikitext_perplexity", "windows"]
