"""Evaluation: perplexity (and, in later modules, long-context tasks and fidelity audits)."""
from .perplexity import PerplexityResult, perplexity, wikitext_perplexity
from .sweep import ppl_vs_keep

__all__ = ["PerplexityResult", "perplexity", "ppl_vs_keep", "wikitext_perplexity"]
