"""Baselines on the SAME factors, all driven by the one loop (:func:`lowrank_lib.generation.run_generation`).

==================  ==========================================================================
system              what runs
==================  ==========================================================================
``engine``          our Engine, all mechanisms on, eager (no graph)
``engine_step``     + whole decode step as one graph (CUDA graph; torch.compile on CPU)
``engine_step_cpp`` ``engine_step`` on CPU with inductor's C++ wrapper (no Python between the step's kernel calls;
                    minutes of cold compile on a 2-core CPU)
``engine_layer``    + one CUDA graph per layer (CUDA only)
``engine_split``    + attention and MLP graphs per layer (CUDA only)
``engine_step_compiled`` ``engine_step`` whose captured step is first ``torch.compile``-d (``graph_compile``: inductor's
                    fused kernels replayed; CUDA only)
``dense_kv``        our dense cache, no packing, no RoPE folding, no graphs (paper: Dense KV + FA2)
``naive``           history kept as rank-space latents, dense K/V rebuilt every step (slow route)
``hf_dynamic``      transformers forward (eager Python, sdpa) with ``DynamicCache``
``hf_static``       transformers forward with ``StaticCache`` (max_cache_len = prompt + new)
``dense_hf_static`` the uncompressed model through ``hf_static``
``hf_compiled``     gpt-fast style: ``StaticCache``, fixed-shape decode forward under ``torch.compile``
                    (fullgraph; ``mode="reduce-overhead"``, i.e. CUDA graphs, on CUDA)
``dense_hf_compiled`` the uncompressed model through ``hf_compiled``: the dense baseline to beat
``dense_engine``    the uncompressed model through the engine
==================  ==========================================================================
"""
from __future__ import annotations

import copy

import torch

from ..compat import cache_kw, cache_kwarg
from ..generation import left_pad_counts
from .config import PRESETS, EngineConfig
from .engine import Engine
from .graphs import own_code
from .runner import Runner

__all__ = ["ENGINE_VARIANTS", "HFCompiledRunner", "HFRunner", "make_runner", "SYSTEMS"]

SYSTEMS = ("engine", "engine_step", "engine_step_cpp", "engine_step_compiled", "engine_layer", "engine_split", "dense_kv",
           "naive", "hf_dynamic", "hf_static", "dense_hf_static", "hf_compiled", "dense_hf_compiled", "dense_engine")
ENGINE_VARIANTS = {"engine": {}, "engine_step": dict(graph="whole-step"),
                   "engine_step_cpp": dict(graph="whole-step", cpp_wrapper=True), "engine_layer": dict(graph="per-layer"),
                   "engine_split": dict(graph="split"), "engine_step_compiled": dict(graph="whole-step", graph_compile=True),
                   "dense_engine": {}}


class HFRunner(Runner):
    """transformers forward with a DynamicCache or StaticCache: a :class:`~lowrank_lib.runtime.runner.Runner`
    (eager: nothing to prepare or invalidate; transformers' own head, ``lm_head_mode = "hf"``).

    Left padding is handled as ``generate`` does: position ids = cumsum(mask) - 1, the 2-D
    attention mask grows by one column per step.
    """

    lm_head_mode = "hf"

    def __init__(self, model, cache: str = "dynamic", max_cache_len: int | None = None):
        if cache not in ("dynamic", "static"):
            raise ValueError(f"cache={cache!r}: use 'dynamic' or 'static'")
        self.model, self.kind, self.max_cache_len = model, cache, max_cache_len
        self.device = next(model.parameters()).device

    def _new_cache(self, T: int):
        from transformers import DynamicCache, StaticCache

        if self.kind == "dynamic":
            return DynamicCache(config=self.model.config)
        n = self.max_cache_len or T
        return StaticCache(config=self.model.config, max_cache_len=n)

    @torch.no_grad()
    def prefill(self, input_ids, attention_mask=None):
        input_ids = input_ids.to(self.device)
        B, T = input_ids.shape
        pad = left_pad_counts(None if attention_mask is None else attention_mask.to(self.device), input_ids)
        self.mask = (torch.arange(T, device=self.device)[None] >= pad[:, None]).long()
        self.pos = (torch.arange(T, device=self.device)[None] - pad[:, None]).clamp_min(0)
        self.cache = self._new_cache(T)
        out = self.model(input_ids, attention_mask=self.mask, position_ids=self.pos,
                         **cache_kw(self.cache), use_cache=True, logits_to_keep=1)
        self.pos = self.pos[:, -1:]
        return out.logits[:, -1]

    @torch.no_grad()
    def step(self, tokens):
        B = tokens.shape[0]
        self.mask = torch.cat([self.mask, self.mask.new_ones(B, 1)], 1)
        self.pos = self.pos + 1
        out = self.model(tokens.to(self.device)[:, None], attention_mask=self.mask, position_ids=self.pos,
                         **cache_kw(self.cache), use_cache=True)
        return out.logits[:, -1]


    def layer_sections(self, mark):
        """Forward hooks on the transformers model's decoder layers call ``mark(i)`` / ``mark(None)`` around layer
        ``i`` until the returned undo removes them."""
        hooks = []
        for i, layer in enumerate(self.model.get_decoder().layers):
            hooks.append(layer.register_forward_pre_hook(lambda m, a, i=i: mark(i)))
            hooks.append(layer.register_forward_hook(lambda m, a, o: mark(None)))

        def undo():
            for h in hooks:
                h.remove()
        return undo


class HFCompiledRunner(HFRunner):
    """gpt-fast style: transformers' model, a ``StaticCache`` of ``max_cache_len`` slots, and ONE
    fixed-shape decode forward under ``torch.compile(fullgraph=True, dynamic=False)``.

    Shapes never change between steps: the 2-D attention mask is the whole ``[B, max_cache_len]``
    (zeros only on left-pad slots; future slots are hidden by causality), tokens ``[B, 1]``, position
    ids ``[B, 1]``. On CUDA the mode is ``"reduce-overhead"`` (inductor's CUDA graphs), the baseline
    gpt-fast measures; on CPU the default mode. Prefill runs eagerly. ``prepare`` compiles (and
    records the graphs) with warm-up steps at the next position, whose K/V slot the first real step
    overwrites; its seconds are reported as capture time, apart from decode time.
    """

    def __init__(self, model, max_cache_len: int, backend: str = "inductor", mode: str | None = None):
        super().__init__(model, "static", max_cache_len)
        if mode is None:
            mode = "reduce-overhead" if self.device.type == "cuda" else "default"
        self.backend, self.mode = backend, mode

        self._cache_kwarg = cache_kwarg()    # resolved here, outside the traced function
        self._caches: dict[int, object] = {}
        self.capture_s = 0.0
        self._compiles: list[dict] = []
        self.invalidate()

    compiled = True

    def invalidate(self) -> None:
        """Drop the compiled step (a fresh code object: the next :meth:`prepare` compiles again)."""
        model, name = self.model, self._cache_kwarg

        def hf_decode(tokens, mask, pos, cache):
            return model(tokens, attention_mask=mask, position_ids=pos, use_cache=True, **{name: cache}).logits

        kw = {} if self.backend != "inductor" else {"mode": self.mode}
        self._fn = torch.compile(own_code(hf_decode), fullgraph=True, dynamic=False, backend=self.backend, **kw)
        self._prepared: set[int] = set()

    def counters(self) -> dict:
        """No head of ours (``lm_head`` empty); one record per :meth:`prepare` that compiled."""
        return {"lm_head": {}, "compiles": list(self._compiles)}

    def reset_counters(self) -> None:
        self._compiles.clear()

    def _new_cache(self, T: int):
        """ONE StaticCache per batch size, reset between requests: its tensors keep their addresses, so
        the compiled step (and its CUDA graphs) is reused, not re-recorded, by every request."""
        B = self._batch
        if B not in self._caches:
            self._caches[B] = super()._new_cache(T)
        else:
            self._caches[B].reset()
        return self._caches[B]

    @torch.no_grad()
    def prefill(self, input_ids, attention_mask=None):
        self._batch = input_ids.shape[0]
        logits = super().prefill(input_ids, attention_mask)
        B, T = input_ids.shape
        pad = T - self.mask.sum(1)
        self.mask = (torch.arange(self.max_cache_len, device=self.device)[None] >= pad[:, None]).long()
        return logits

    @torch.no_grad()
    def prepare(self, B: int) -> float:
        if B in self._prepared:
            return 0.0
        import time

        self._prepared.add(B)
        t0 = time.perf_counter()
        dummy = torch.zeros(B, 1, dtype=torch.long, device=self.device)
        # a StaticCache layer writes at its own device-side counter (``cumulative_length``, advanced in
        # place by every forward): the warm-up steps must leave it where the prefill put it
        counters = [(layer, getattr(layer, "cumulative_length", None)) for layer in self.cache.layers]
        if not all(isinstance(n, torch.Tensor) for _, n in counters):
            self.warmup = "skipped: this transformers' StaticCache has no device-side write counter"
            return 0.0                  # compiled in the first timed step instead (the median absorbs it)
        counters = [(layer, n.clone()) for layer, n in counters]
        self.warmup = "done"
        for _ in range(3 if self.mode == "reduce-overhead" else 1):     # cudagraph trees record on a later call
            self._fn(dummy, self.mask, self.pos + 1, self.cache)
            for layer, n in counters:
                layer.cumulative_length.copy_(n)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.capture_s += dt
        self._compiles.append({"batch": B, "seconds": dt, "backend": self.backend, "mode": self.mode})
        return dt

    @torch.no_grad()
    def step(self, tokens):
        self.pos = self.pos + 1
        return self._fn(tokens.to(self.device)[:, None], self.mask, self.pos, self.cache)[:, -1].clone()


def _as_dtype(model, dtype):
    p = next(model.parameters())
    if dtype is None or p.dtype == dtype:
        return model
    return copy.deepcopy(model).to(dtype)


def make_runner(system: str, model, dense_model=None, dtype=None, max_seq_len: int = 2048, max_batch: int = 1,
                **engine_kw):
    """Build a :class:`~lowrank_lib.runtime.runner.Runner` for a system name; see the module table.

    ``dense_model`` is the uncompressed model (needed by ``dense_*`` systems); ``dtype`` casts a copy
    of the model when it differs. Extra keywords go to :class:`EngineConfig` for engine systems.
    """
    if system.startswith("dense_") and system != "dense_kv":
        if dense_model is None:
            raise ValueError(f"system {system!r} needs the uncompressed model (dense_model=...)")
        model = dense_model
    if system in ("hf_compiled", "dense_hf_compiled"):
        return HFCompiledRunner(_as_dtype(model, dtype), max_seq_len, backend=engine_kw.get("compile_backend", "inductor"))
    if system in ("hf_dynamic", "hf_static", "dense_hf_static"):
        kind = "dynamic" if system == "hf_dynamic" else "static"
        return HFRunner(_as_dtype(model, dtype), kind, max_cache_len=max_seq_len)
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; use one of {SYSTEMS}")
    if system in ENGINE_VARIANTS:
        kw = {**engine_kw, **ENGINE_VARIANTS[system]}
    else:
        kw = {**engine_kw, **PRESETS[system]}
    return Engine(model, EngineConfig(max_batch=max_batch, max_seq_len=max_seq_len, dtype=dtype, **kw))
