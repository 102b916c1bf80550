"""Evaluation: perplexity, keep-ratio sweeps, KV-cache quality and long-context tasks.

``ppl_vs_keep`` is resolved lazily (PEP 562) so that ``python -m lowrank_lib.eval.sweep`` does not
import its own module twice (runpy's "found in sys.modules" warning).
"""
from .perplexity import PerplexityResult, perplexity, wikitext_perplexity

__all__ = ["PerplexityResult", "perplexity", "ppl_vs_keep", "wikitext_perplexity"]


def __getattr__(name: str):
    if name == "ppl_vs_keep":
        from .sweep import ppl_vs_keep

        return ppl_vs_keep
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
