"""Evaluation: perplexity (and, in later modules, long-context tasks and fidelity audits)."""
from .perplexity import PerplexityResult, perplexity, wikitext_perplexity

__all__ = ["PerplexityResult", "perplexity", "wikitext_perplexity"]
