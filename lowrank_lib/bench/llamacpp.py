"""llama.cpp (through ``llama-cpp-python``, the optional ``peer`` extra) as a runner of the ONE decode loop.

:class:`LlamaCppRunner` exposes ``prefill(input_ids, attention_mask) -> logits [1, V]`` and
``step(tokens [1]) -> logits [1, V]`` like the engine, so ``runtime.run_generation`` times both
runtimes with the same code: same prompt token ids (no BOS added, no tokenizer involved), same
greedy argmax, same per-step clock. Inside, ``prefill`` is one ``Llama.eval`` of the whole prompt
and ``step`` one ``Llama.eval`` of one token; the runner also keeps its own clock of each bare
``eval`` (``eval_s``) and reads llama.cpp's perf counters (``perf()``), so the Python around it
is visible. The quantizer and the llama.cpp names (``available``, ``version``, ``quantize``, ``QUANT_TYPES``,
``KV_TYPES``) live in :mod:`lowrank_lib.eval.llamacpp` (the frontier uses them without the bench) and are
re-exported here.

    >>> r = LlamaCppRunner(path, n_ctx=576, threads=1, kv_type="f32")
    >>> out = run_generation(r, ids, 64)          # ids [1, T]; out.step_s, out.prefill_s
"""
from __future__ import annotations

import time

import numpy as np
import torch

from ..eval.llamacpp import KV_TYPES, QUANT_TYPES, available, quantize, version
from ..runtime import Runner

__all__ = ["KV_TYPES", "LlamaCppRunner", "QUANT_TYPES", "available", "quantize", "version"]


class LlamaCppRunner(Runner):
    """One llama.cpp context on a GGUF, batch 1, greedy-compatible logits.

    Parameters
    ----------
    path : the GGUF file.
    n_ctx : KV cache slots (prompt + new tokens); llama.cpp rounds it up to its padding.
    threads : ``n_threads`` and ``n_threads_batch`` (change later with :meth:`set_threads`).
    kv_type : ``"f32"``, ``"f16"`` or ``"bf16"`` for both K and V.
    flash_attn : llama.cpp's fused attention (what ``llama-bench`` picks on CPU by default).
    """

    device = torch.device("cpu")
    lm_head_mode = "exact"          # llama.cpp's whole head every step (the Runner protocol's eager defaults)

    def __init__(self, path, n_ctx: int, threads: int = 1, kv_type: str = "f32", flash_attn: bool = True):
        ok, why = available()
        if not ok:
            raise RuntimeError(why)
        from llama_cpp import Llama

        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type={kv_type!r}: use one of {sorted(KV_TYPES)}")
        self.path, self.kv_type, self.flash_attn = str(path), kv_type, flash_attn
        self.llm = Llama(model_path=self.path, n_ctx=n_ctx, n_batch=max(n_ctx, 512), n_ubatch=max(n_ctx, 512),
                         n_threads=threads, n_threads_batch=threads, type_k=KV_TYPES[kv_type],
                         type_v=KV_TYPES[kv_type], flash_attn=flash_attn, logits_all=False, verbose=False,
                         use_mmap=True)
        self.threads = threads
        self.n_vocab = self.llm.n_vocab()
        self.eval_s: list[float] = []
        self.prefill_eval_s: float | None = None

    def set_threads(self, threads: int) -> None:
        import llama_cpp

        llama_cpp.llama_set_n_threads(self.llm.ctx, threads, threads)      # the public context handle
        self.threads = threads

    def _logits(self) -> torch.Tensor:
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return torch.from_numpy(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy())[None]

    def _eval(self, toks: list[int]) -> float:
        t0 = time.perf_counter()
        self.llm.eval(toks)
        return time.perf_counter() - t0

    def prefill(self, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """input_ids [1, T] -> logits [1, V]; resets the context first (a new request)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"llama.cpp runner serves batch 1, got input_ids of shape {tuple(input_ids.shape)}")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("llama.cpp runner: padding is not supported (batch 1, no mask)")
        import llama_cpp

        self.llm.reset()
        llama_cpp.llama_perf_context_reset(self.llm.ctx)
        self.eval_s = []
        self.prefill_eval_s = self._eval(input_ids[0].tolist())
        return self._logits()

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [1] -> logits [1, V] (one ``eval`` of one token)."""
        self.eval_s.append(self._eval([int(tokens.reshape(-1)[0])]))
        return self._logits()

    def perf(self) -> dict:
        """llama.cpp's own counters since the last prefill: prompt and generation ms, token counts."""
        import llama_cpp

        p = llama_cpp.llama_perf_context(self.llm.ctx)
        return {"t_p_eval_ms": p.t_p_eval_ms, "n_p_eval": p.n_p_eval, "t_eval_ms": p.t_eval_ms, "n_eval": p.n_eval,
                "eval_ms_per_token": p.t_eval_ms / p.n_eval if p.n_eval else float("nan")}

    def report(self) -> dict:
        import llama_cpp

        return {"runner": "llama.cpp", "llama_cpp_python": version(), "gguf": self.path, "kv_type": self.kv_type,
                "flash_attn": self.flash_attn, "threads": self.threads,
                # llama.cpp's own build and CPU features (AVX2 / AVX512 / ... = 1, the backends compiled in)
                "system_info": llama_cpp.llama_print_system_info().decode(errors="replace").strip()}

    def close(self) -> None:
        self.llm.close()
