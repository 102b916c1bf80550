"""llama.cpp (mainline, through ``llama-cpp-python``, the optional ``peer`` extra) and ik_llama.cpp (the optional
``ik`` extra) as runners of the ONE decode loop, for the bench's peer runs: :class:`LlamaCppRunner` and
:class:`IkLlama` live in :mod:`lowrank_lib.eval.llamacpp` / :mod:`lowrank_lib.eval.ik_llamacpp` (the frontier uses
them without the bench), with the quantizer and the llama.cpp names, and are re-exported here.

    >>> r = LlamaCppRunner(path, n_ctx=576, threads=1, kv_type="f32")
    >>> out = run_generation(r, ids, 64)          # ids [1, T]; out.step_s, out.prefill_s
"""
from __future__ import annotations

from ..eval.ik_llamacpp import IkLlama
from ..eval.llamacpp import KV_TYPES, QUANT_TYPES, LlamaCppRunner, available, quantize, version

__all__ = ["IkLlama", "KV_TYPES", "LlamaCppRunner", "QUANT_TYPES", "available", "quantize", "version"]
