"""ik_llama.cpp, the second CPU peer (issue 30): a fork of llama.cpp tuned for CPUs, with its own kernels for the
same GGUF types, run on the SAME files as mainline (made by mainline's quantizer, :func:`.llamacpp.quantize`).

It comes through ``ik-llama-cpp-python`` (the optional ``ik`` extra: ``pip install "ik-llama-cpp-python==0.1.5"``,
a prebuilt AVX2 wheel, or its sdist with ``CMAKE_ARGS=-DGGML_NATIVE=ON`` for this CPU's own kernels; the sdist lacks
``common/cmake/build-info-gen-cpp.cmake``, a ``configure_file`` of ``common/build-info.cpp.in``). Its package ships
``libllama.so`` beside ``libggml.so`` with no run path between them, so :func:`_lib` loads ``libggml`` globally first.
Nothing here imports it before it is used; it must not share a process with ``llama_cpp`` (both define ggml's
symbols): the frontier and the peer runs time each system in its own child.

:class:`IkLlama` is both:

- a decode runner of the ONE decode loop (``prefill`` / ``step`` -> logits ``[1, V]``, ``eval_s``, ``perf()``,
  ``report()``, ``set_threads``), like :class:`~lowrank_lib.bench.llamacpp.LlamaCppRunner`: one ``llama_decode``
  per call, no BOS, no tokenizer; its API sets threads per context, so :meth:`IkLlama.set_threads` makes a new
  context (untimed; the caller warms it again);
- a causal LM callable (``model(x [B, T]).logits``: every position's logits, each row from an empty context), so
  :func:`ik_perplexity` scores it with exactly our protocol, as :func:`.llamacpp.gguf_perplexity` scores mainline.
"""
from __future__ import annotations

import collections
import ctypes
import importlib.util
import time
from pathlib import Path

import numpy as np
import torch

from ..runtime import Runner
from .llamacpp import KV_TYPES, dist_version, importable, isa_below_host

__all__ = ["IkLlama", "available", "bf16_cache_ok", "cache_type", "ik_perplexity", "system_info", "version"]


def available() -> tuple[bool, str]:
    """(importable, why not): ``ik-llama-cpp-python`` is the optional ``ik`` extra."""
    return importable("ik_llama_cpp", "ik-llama-cpp-python is not installed: pip install -e '.[ik]' (see "
                                      "lowrank_lib.eval.ik_llamacpp for a native build)")


def version() -> str | None:
    """ik-llama-cpp-python's version, ``None`` when it is not installed."""
    return dist_version("ik-llama-cpp-python")


def _lib():
    """The package's ctypes binding of ``llama.h`` (``ik_llama_cpp._ctypes_api``: its public ``IkLlama`` samples
    inside its own generate loop, so a per-token runner needs the C API, which is ik_llama.cpp's public interface),
    its ``libggml`` loaded globally first (its ``libllama`` has no run path to it)."""
    ok, why = available()
    if not ok:
        raise RuntimeError(why)
    spec = importlib.util.find_spec("ik_llama_cpp")
    ggml = Path(spec.origin).parent / "lib" / "libggml.so"
    if ggml.exists():
        ctypes.CDLL(str(ggml), mode=ctypes.RTLD_GLOBAL)
    from ik_llama_cpp import _ctypes_api

    _quiet(_ctypes_api)
    return _ctypes_api


#: the library's last log lines (its loader and context logs, kept here instead of on stderr: a few hundred lines
#: per model load), shown in the error when a load fails
LOG_TAIL: collections.deque[str] = collections.deque(maxlen=40)
_LOG_CALLBACK = None


def _quiet(C) -> None:
    """Route the library's log (``llama_log_set``) into :data:`LOG_TAIL` instead of stderr, once per process, as
    llama-cpp-python's ``verbose=False`` does for mainline. (An abort still prints: ggml writes it directly.)"""
    global _LOG_CALLBACK
    set_log = getattr(C._lib, "llama_log_set", None)
    if _LOG_CALLBACK is not None or set_log is None:
        return
    proto = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
    _LOG_CALLBACK = proto(lambda level, text, user: LOG_TAIL.append(text.decode(errors="replace")) if text else None)
    set_log.argtypes, set_log.restype = [proto, ctypes.c_void_p], None
    set_log(_LOG_CALLBACK, None)


def system_info() -> str:
    """Its build's CPU flags (``llama_print_system_info``: ``"AVX = 1 | AVX2 = 1 | AVX512_BF16 = 0 | ..."``)."""
    info = _lib()._lib.llama_print_system_info
    info.restype = ctypes.c_char_p
    return info().decode(errors="replace").strip()


def bf16_cache_ok(info: str) -> bool:
    """Whether a build with these flags (:func:`system_info`) takes a bf16 K / V cache under its fused attention on
    the CPU. Only one compiled with AVX512_BF16 does (its ``iqk_flash_attn`` lists bf16 among the supported cache
    types only then); any other build aborts the whole process at the first decode ("K cache bf16 coupled with V cache
    bf16 is not a supported combination on the CPU backend", then ``GGML_ABORT``): the prebuilt AVX2 wheel, and a
    native build on a CPU without AVX512_BF16 (AMD Zen 3, most Intel client CPUs)."""
    return "AVX512_BF16 = 1" in info


def cache_type(info: str | None = None) -> str:
    """The cache a peer run gives ik_llama.cpp (both K and V): ``"bf16"``, our engine's, where its build takes it
    (:func:`bf16_cache_ok`), else ``"f16"``: the same two bytes a value, so the rows read the same KV bytes (it has no
    f32 cache). ``info``: :func:`system_info`'s string (default: this installation's)."""
    return "bf16" if bf16_cache_ok(system_info() if info is None else info) else "f16"


class _Out:
    def __init__(self, logits):
        self.logits = logits


class IkLlama(Runner):
    """One ik_llama.cpp context on a GGUF, batch 1.

    Parameters
    ----------
    path : the GGUF file.
    n_ctx : KV cache slots (the longest prompt + new tokens, or the longest scored row).
    threads : ``n_threads`` and ``n_threads_batch``.
    kv_type : ``"f16"``, ``"bf16"`` or ``"q8_0"`` for both K and V (it has no f32 cache: its context refuses one),
        or ``None``: :func:`cache_type`. ``"bf16"`` with ``flash_attn`` is refused where the build lacks it
        (:func:`bf16_cache_ok`; it would abort the process at the first decode).
    flash_attn : its fused attention.
    """

    device = torch.device("cpu")
    lm_head_mode = "exact"

    def __init__(self, path, n_ctx: int, threads: int = 1, kv_type: str | None = None, flash_attn: bool = True):
        if kv_type is not None and (kv_type not in KV_TYPES or kv_type == "f32"):
            raise ValueError(f"kv_type={kv_type!r}: ik_llama.cpp's caches are f16, bf16 and q8_0 (no f32)")
        if not Path(path).is_file():
            raise FileNotFoundError(f"ik_llama.cpp: no GGUF at {path}")
        self.C = C = _lib()
        info = system_info()
        if kv_type is None:
            kv_type = cache_type(info)
        if kv_type == "bf16" and flash_attn and not bf16_cache_ok(info):
            raise ValueError("kv_type='bf16' with flash_attn: this ik_llama.cpp build has no AVX512_BF16, and its "
                             "fused attention would abort the process at the first decode; use kv_type='f16' (the "
                             f"same bytes) or None. Its flags: {info}")
        self.path, self.kv_type, self.flash_attn, self.n_ctx = str(path), kv_type, flash_attn, int(n_ctx)
        self.system_info = info                 # its build's flags, read once
        C.llama_backend_init()
        mp = C.llama_model_default_params()
        mp.use_mmap, mp.n_gpu_layers = True, 0
        self.model = C.llama_model_load_from_file(self.path.encode(), mp)
        if not self.model:
            raise RuntimeError(f"ik_llama.cpp could not load {self.path}; its log ends:\n" + "".join(LOG_TAIL)[-2000:])
        self.n_vocab = C.llama_vocab_n_tokens(C.llama_model_get_vocab(self.model))
        self.ctx, self.pos = None, 0
        self.eval_s: list[float] = []
        self.prefill_eval_s: float | None = None
        self.set_threads(threads)

    # --------------------------------------------------------------- context
    def set_threads(self, threads: int) -> None:
        """A new context with ``threads`` (its API has no per-context thread setter); the cache starts empty."""
        C = self.C
        if self.ctx:
            C.llama_free(self.ctx)
        p = C.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch = self.n_ctx, self.n_ctx, self.n_ctx
        p.n_threads = p.n_threads_batch = int(threads)
        p.type_k = p.type_v = KV_TYPES[self.kv_type]
        p.flash_attn = self.flash_attn
        self.ctx = C.llama_init_from_model(self.model, p)
        if not self.ctx:
            raise RuntimeError(f"ik_llama.cpp: no context for {self.path} ({threads} threads, kv {self.kv_type})")
        self.threads, self.pos = int(threads), 0

    def _decode(self, toks: list[int], all_logits: bool) -> float:
        """One ``llama_decode`` of ``toks`` after the cache's ``pos`` tokens; returns its wall seconds."""
        C, n = self.C, len(toks)
        if self.pos + n > self.n_ctx:
            raise ValueError(f"ik_llama.cpp: {self.pos} + {n} tokens do not fit n_ctx={self.n_ctx}")
        batch = C.llama_batch_init(n, 0, 1)
        try:
            batch.n_tokens = n
            for i, t in enumerate(toks):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = int(t), self.pos + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = 1 if all_logits or i == n - 1 else 0
            t0 = time.perf_counter()
            rc = C.llama_decode(self.ctx, batch)
            dt = time.perf_counter() - t0
        finally:
            C.llama_batch_free(batch)
        if rc != 0:
            raise RuntimeError(f"ik_llama.cpp: llama_decode returned {rc} at position {self.pos} ({n} tokens)")
        self.pos += n
        return dt

    def _row(self, i: int) -> np.ndarray:
        ptr = self.C.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).copy()

    def _reset(self) -> None:
        self.C.llama_kv_cache_clear(self.ctx)
        self.pos = 0

    # --------------------------------------------------------------- the runner
    def prefill(self, input_ids: torch.Tensor, attention_mask=None) -> torch.Tensor:
        """input_ids [1, T] -> logits [1, V]; resets the context first (a new request)."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"ik_llama.cpp runner serves batch 1, got input_ids of shape {tuple(input_ids.shape)}")
        if attention_mask is not None and not bool(attention_mask.all()):
            raise ValueError("ik_llama.cpp runner: padding is not supported (batch 1, no mask)")
        self._reset()
        self.C.llama_reset_timings(self.ctx)
        self.eval_s = []
        self.prefill_eval_s = self._decode(input_ids[0].tolist(), False)
        return torch.from_numpy(self._row(-1))[None]

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [1] -> logits [1, V] (one ``llama_decode`` of one token)."""
        self.eval_s.append(self._decode([int(tokens.reshape(-1)[0])], False))
        return torch.from_numpy(self._row(-1))[None]

    def perf(self) -> dict:
        """Its own counters since the last prefill: prompt and generation ms, token counts."""
        p = self.C.llama_get_timings(self.ctx)
        return {"t_p_eval_ms": p.t_p_eval_ms, "n_p_eval": p.n_p_eval, "t_eval_ms": p.t_eval_ms, "n_eval": p.n_eval,
                "eval_ms_per_token": p.t_eval_ms / p.n_eval if p.n_eval else float("nan")}

    def report(self) -> dict:
        return {"runner": "ik_llama.cpp", "ik_llama_cpp_python": version(), "gguf": self.path,
                "kv_type": self.kv_type, "flash_attn": self.flash_attn, "threads": self.threads,
                "system_info": self.system_info, "isa_below_host": isa_below_host(self.system_info)}

    # --------------------------------------------------------------- the causal LM
    def parameters(self):
        """Where the logits live (``eval.perplexity`` asks the device of the first parameter)."""
        yield torch.empty(0)

    def row_logits(self, toks: list[int]) -> np.ndarray:
        """Logits ``[len(toks), V]`` (float32) of one sequence from an empty context."""
        self._reset()
        self._decode(list(map(int, toks)), True)
        return np.stack([self._row(i) for i in range(len(toks))])

    def __call__(self, x: torch.Tensor) -> _Out:
        if x.dim() != 2:
            raise ValueError(f"input ids must be [B, T], got shape {tuple(x.shape)}")
        return _Out(torch.stack([torch.from_numpy(self.row_logits(row.tolist())) for row in x.cpu()]))

    def close(self) -> None:
        if self.ctx:
            self.C.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            self.C.llama_free_model(self.model)
            self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def ik_perplexity(path, ids: torch.Tensor, seq_len: int = 2048, max_windows: int | None = None, threads: int = 1,
                  kv_type: str | None = None, progress: bool = False, desc: str = "ik_llama.cpp ppl"):
    """:func:`lowrank_lib.eval.perplexity.perplexity` of a GGUF through ik_llama.cpp's logits on the 1-D token ids
    ``ids``: the windows, scored positions and NLL of every other frontier point (its cache 16-bit, :func:`cache_type`
    by default: it has no f32 one, where mainline's frontier points use f32)."""
    from .perplexity import perplexity

    with IkLlama(path, n_ctx=seq_len, threads=threads, kv_type=kv_type) as m:
        return perplexity(m, ids, seq_len=seq_len, max_windows=max_windows, progress=progress, desc=desc)
