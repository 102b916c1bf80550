"""The installed transformers' calling convention, detected once: how a cache is passed to a model.

transformers 5.24 renamed the ``past_key_values`` argument of every model ``forward`` and of ``generate``
to ``cache`` (the old name still works until 5.40, with a ``FutureWarning``); before 5.24 a ``cache=``
keyword is NOT an error: it falls into ``**kwargs`` and is silently ignored, so the model builds its own
cache. Every call of ours that hands a model a cache goes through :func:`cache_kw`::

    from lowrank_lib.compat import cache_kw
    out = model(ids, **cache_kw(cache))                          # cache= or past_key_values=
    out = model.generate(ids, **cache_kw(cache), max_new_tokens=32)

The keyword is read from the signature of ``GenerationMixin.prepare_inputs_for_generation`` (the
model-agnostic function that builds every generative model's forward arguments), once per process.
The supported range is declared in ``pyproject.toml`` (``transformers>=5.15,<5.40``); ``make test-oldest``
runs the Cache-API tests on the oldest release of it.

A leaf module (nothing of lowrank_lib imported, transformers only on first use): ``runtime/`` (which may
not import ``hf/``) and ``hf/`` both use it.
"""
from __future__ import annotations

import functools
import inspect

__all__ = ["cache_kw", "cache_kwarg"]

NEW, OLD = "cache", "past_key_values"


@functools.cache
def cache_kwarg() -> str:
    """``"cache"`` on transformers >= 5.24, ``"past_key_values"`` before (from the installed signature)."""
    from transformers.generation.utils import GenerationMixin

    params = inspect.signature(GenerationMixin.prepare_inputs_for_generation).parameters
    if NEW in params:
        return NEW
    if OLD in params:
        return OLD
    import transformers

    raise RuntimeError(f"transformers {transformers.__version__}: prepare_inputs_for_generation takes neither "
                       f"{NEW!r} nor {OLD!r}; lowrank_lib supports the range declared in pyproject.toml")


def cache_kw(cache) -> dict:
    """``{keyword: cache}`` for a model ``forward`` / ``generate`` call of the installed transformers."""
    return {cache_kwarg(): cache}
