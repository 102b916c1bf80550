"""llama.cpp's side of the quality frontier: its quantizer, its logits on OUR windows, and its own perplexity protocol.

llama.cpp comes through ``llama-cpp-python`` (the optional ``peer`` extra); nothing here imports it before it is
used. The bench's peer runs and the frontier both use it:

- :func:`quantize`: ``llama-quantize`` (the C function ``llama_model_quantize`` that the tool calls) from an F32 /
  BF16 GGUF to any type of :data:`QUANT_TYPES` (F32, BF16, Q8_0, Q6_K, Q5_K_M, Q4_K_M, Q3_K_M, Q2_K, Q4_1);
- :class:`GGUFLogits`: a GGUF as a callable ``model(x [B, T]).logits -> [B, T, V]`` (fp32, llama.cpp's logits of
  every position, each row a fresh context), so :func:`lowrank_lib.eval.perplexity.perplexity` scores llama.cpp
  with exactly our protocol: same windows, same token ids (no BOS, no tokenizer), same scored positions, same
  NLL code. :func:`gguf_perplexity` is that call.
- :class:`LlamaCppRunner`: llama.cpp as a runner of the ONE decode loop (``prefill`` / ``step`` -> logits
  ``[1, V]`` like the engine, one ``Llama.eval`` per call; ``runtime.run_generation`` times both runtimes with the
  same code: same prompt ids, same greedy argmax, same per-step clock; ``eval_s``: its bare evals, ``perf()``: its own
  counters), used by the bench's peer runs and the frontier's speed phase;
- :func:`llama_perplexity`: ``llama-perplexity``'s own protocol (tools/perplexity: chunks of ``n_ctx`` tokens, the
  first token of a chunk replaced by BOS when the vocabulary adds one, only the second half of each chunk
  scored), to cross-check our numbers against the ones the tool prints.

    >>> quantize("m.F32.gguf", "m.Q4_K_M.gguf", "q4_k_m")
    >>> gguf_perplexity("m.Q4_K_M.gguf", ids, seq_len=2048, max_windows=4).ppl
"""
from __future__ import annotations

import importlib.util
import math
import os
import time
from pathlib import Path

import numpy as np
import torch

from ..runtime import Runner

__all__ = ["GGML_ISA", "GGUFLogits", "KV_TYPES", "LlamaCppRunner", "QUANT_TYPES", "available", "dist_version", "gguf_perplexity", "importable",
           "llama_perplexity", "quantize", "version"]

#: KV cache element types by name (ggml type ids, see ggml.h)
KV_TYPES = {"f32": 0, "f16": 1, "bf16": 30, "q8_0": 8}   # ggml_type values (q8_0: 8-bit cache, needs flash_attn)

#: llama.cpp's file types by ``llama-quantize``'s names, lower case: ``llama_ftype`` values of llama.h
#: (``LLAMA_FTYPE_ALL_F32``, ``LLAMA_FTYPE_MOSTLY_Q4_K_M``, ...)
QUANT_TYPES = {"f32": 0, "bf16": 32, "q8_0": 7, "q6_k": 18, "q5_k_m": 17, "q4_k_m": 15, "q3_k_m": 12, "q2_k": 10,
               "q4_1": 3}


#: ggml's names of the x86 features its ``system_info`` reports -> Linux's /proc/cpuinfo flag for the same feature
GGML_ISA = {"SSE3": "pni", "SSSE3": "ssse3", "AVX": "avx", "AVX2": "avx2", "F16C": "f16c", "FMA": "fma",
            "BMI2": "bmi2", "AVX_VNNI": "avx_vnni", "AVX512": "avx512f", "AVX512_VBMI": "avx512vbmi",
            "AVX512_VNNI": "avx512_vnni", "AVX512_BF16": "avx512_bf16", "AMX_INT8": "amx_int8"}


def isa_below_host(system_info: str, flags: set[str] | None = None) -> list[str]:
    """The CPU features this host has (``flags``: :func:`lowrank_lib.host.cpu_flags` by default) that a llama.cpp or
    ik_llama.cpp build's ``system_info`` does not say it was built with (``NAME = 1``; llama.cpp lists only what it
    has, ik_llama.cpp writes ``NAME = 0`` for what it lacks and leaves out what it does not check), in ggml's names: a non-empty list means that build is not the
    peer's best on this CPU (the prebuilt ``ik-llama-cpp-python`` wheel is AVX2-only). Features ggml does not report
    are not judged."""
    from ..host import cpu_flags

    have = cpu_flags() if flags is None else flags
    said = {k.strip(): v.strip() for k, _, v in (p.rpartition(":")[2].partition("=") for p in system_info.split("|"))
            if v.strip() in ("0", "1")}
    explicit = "0" in said.values()          # ik_llama.cpp's format: a feature it does not name is not judged
    return [name for name, flag in GGML_ISA.items()
            if flag in have and said.get(name) != "1" and (name in said or not explicit)]


def importable(module: str, why: str) -> tuple[bool, str]:
    """(``module`` can be imported, ``why`` when it cannot); nothing is imported. The peers are optional extras."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    return (True, "") if spec is not None else (False, why)


def dist_version(dist: str) -> str | None:
    """The installed version of the distribution ``dist`` (its metadata), ``None`` when it is not installed."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as _version

    try:
        return _version(dist)
    except PackageNotFoundError:
        return None


def available() -> tuple[bool, str]:
    """(importable, why not): llama-cpp-python is the optional ``peer`` extra."""
    return importable("llama_cpp", "llama-cpp-python is not installed: pip install -e '.[peer]' (builds llama.cpp "
                                   "from source, a few minutes; CMAKE_ARGS='-DGGML_NATIVE=ON -DLLAMA_CURL=OFF')")


def _require():
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    import llama_cpp

    return llama_cpp


def version() -> str | None:
    """llama-cpp-python's version, ``None`` when it is not installed."""
    return dist_version("llama-cpp-python")


def quantize(src, dst, qtype: str, threads: int = 0, allow_requantize: bool = False):
    """``llama-quantize src dst TYPE``: llama.cpp's own quantizer on a GGUF, written through a temporary name.

    ``qtype``: a key of :data:`QUANT_TYPES`; ``threads``: 0 = llama.cpp's default; ``allow_requantize``: accept a
    source that is already quantized (``--allow-requantize``). Returns ``dst``.
    """
    llama_cpp = _require()
    if qtype not in QUANT_TYPES:
        raise ValueError(f"qtype={qtype!r}: use one of {sorted(QUANT_TYPES)}")
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
    llama_cpp.llama_backend_init()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_TYPES[qtype]
    params.nthread = threads
    params.allow_requantize = allow_requantize
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), params)
    if rc != 0 or not tmp.exists():
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"llama_model_quantize({src} -> {qtype}) failed with code {rc}")
    os.replace(tmp, dst)
    return dst


class _Out:
    def __init__(self, logits: torch.Tensor):
        self.logits = logits


class GGUFLogits:
    """A GGUF run by llama.cpp as a causal LM callable: ``m(x [B, T]).logits`` is ``[B, T, V]`` fp32, every
    position's logits, each row evaluated from an empty context (rows are independent windows).

    ``n_ctx``: the longest row (one batch holds a whole row, so a row is one ``llama_decode``); ``threads``: both
    thread counts; ``kv_type``: K and V cache type (f32 by default: the cache adds no rounding of its own);
    ``flash_attn``: llama.cpp's fused attention. Close it (or use it as a context manager) to free the context.
    """

    def __init__(self, path, n_ctx: int, threads: int = 1, kv_type: str = "f32", flash_attn: bool = True):
        _require()
        from llama_cpp import Llama

        if kv_type not in KV_TYPES:
            raise ValueError(f"kv_type={kv_type!r}: use one of {sorted(KV_TYPES)}")
        self.path, self.n_ctx = str(path), int(n_ctx)
        self.llm = Llama(model_path=self.path, n_ctx=self.n_ctx, n_batch=self.n_ctx, n_ubatch=self.n_ctx,
                         n_threads=threads, n_threads_batch=threads, type_k=KV_TYPES[kv_type],
                         type_v=KV_TYPES[kv_type], flash_attn=flash_attn, logits_all=True, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def parameters(self):
        """Where the logits live (``eval.perplexity`` asks the device of the first parameter)."""
        yield torch.empty(0)

    def row_logits(self, toks: list[int]) -> np.ndarray:
        """Logits ``[len(toks), V]`` (float32) of one sequence from an empty context."""
        if len(toks) > self.n_ctx:
            raise ValueError(f"{len(toks)} tokens do not fit n_ctx={self.n_ctx}")
        self.llm.reset()
        self.llm.eval(list(map(int, toks)))
        return np.array(self.llm.scores[:len(toks)], dtype=np.float32, copy=True)

    def __call__(self, x: torch.Tensor) -> _Out:
        if x.dim() != 2:
            raise ValueError(f"input ids must be [B, T], got shape {tuple(x.shape)}")
        return _Out(torch.stack([torch.from_numpy(self.row_logits(row.tolist())) for row in x.cpu()]))

    def bos(self) -> int | None:
        """The BOS id when the file's vocabulary says a BOS is added (``tokenizer.ggml.add_bos_token``)."""
        import llama_cpp

        vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        return int(llama_cpp.llama_vocab_bos(vocab)) if llama_cpp.llama_vocab_get_add_bos(vocab) else None

    def close(self) -> None:
        self.llm.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def gguf_perplexity(path, ids: torch.Tensor, seq_len: int = 2048, max_windows: int | None = None, threads: int = 1,
                    kv_type: str = "f32", progress: bool = False, desc: str = "llama.cpp ppl"):
    """:func:`lowrank_lib.eval.perplexity.perplexity` of a GGUF (llama.cpp's logits) on the 1-D token ids ``ids``:
    the windows, scored positions and NLL of every other point of the frontier."""
    from .perplexity import perplexity

    with GGUFLogits(path, n_ctx=seq_len, threads=threads, kv_type=kv_type) as m:
        return perplexity(m, ids, seq_len=seq_len, max_windows=max_windows, progress=progress, desc=desc)


def llama_perplexity(path, ids: torch.Tensor, n_ctx: int = 512, chunks: int | None = None, threads: int = 1,
                     kv_type: str = "f16", bos: int | None | str = "auto") -> dict:
    """``llama-perplexity -c n_ctx --chunks chunks`` on the token ids ``ids`` (the tool tokenises the whole file
    itself; pass the same ids): chunk ``i`` is ``ids[i*n_ctx:(i+1)*n_ctx]``, its first token replaced by ``bos``
    (``"auto"``: the file's BOS when its vocabulary adds one, else none), the logits of positions ``n_ctx/2`` ..
    ``n_ctx - 2`` scored against the next token, ``exp(mean NLL)`` over every scored token (the tool's final
    estimate). ``kv_type`` f16: the tool's default cache type.

    Returns ``{"ppl", "nll", "tokens", "chunks", "n_ctx", "chunk_ppl"}`` (``chunk_ppl``: the running estimate the
    tool prints after each chunk)."""
    ids = ids.reshape(-1).tolist()
    n_chunk = len(ids) // n_ctx if chunks is None else min(chunks, len(ids) // n_ctx)
    if n_chunk < 1:
        raise ValueError(f"{len(ids)} tokens do not fill one chunk of {n_ctx}")
    first = n_ctx // 2
    total, count, running = 0.0, 0, []
    with GGUFLogits(path, n_ctx=n_ctx, threads=threads, kv_type=kv_type) as m:
        b = m.bos() if bos == "auto" else bos
        for i in range(n_chunk):
            toks = ids[i * n_ctx:(i + 1) * n_ctx]
            if b is not None:
                toks = [b] + toks[1:]
            logits = torch.from_numpy(m.row_logits(toks)[first:n_ctx - 1]).double()
            target = torch.tensor(ids[i * n_ctx + first + 1:(i + 1) * n_ctx])
            total += float(torch.nn.functional.cross_entropy(logits, target, reduction="sum"))
            count += len(target)
            running.append(math.exp(total / count))
    return {"ppl": running[-1], "nll": total / count, "tokens": count, "chunks": n_chunk, "n_ctx": n_ctx,
            "bos": b, "chunk_ppl": running}


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
                # llama.cpp's own build and CPU features (AVX2 / AVX512 / ... = 1, the backends compiled in), and
                # what this CPU has that the build lacks
                "system_info": (info := llama_cpp.llama_print_system_info().decode(errors="replace").strip()),
                "isa_below_host": isa_below_host(info)}

    def close(self) -> None:
        self.llm.close()
