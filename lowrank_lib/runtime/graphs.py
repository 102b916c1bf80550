"""Graph modes for the decode step, and the bookkeeping of what is captured.

CUDA (``torch.cuda.CUDAGraph``): every mode reads the live length / pad counts from device tensors
(the engine's cursor), so one capture per (batch size, store shape key) serves every step (no length
buckets); the step body never moves the cursor (``Engine.step`` advances it after the replay), so
warm-up runs leave the request's position untouched.

- ``whole-step``: embedding -> all layers -> final norm -> lm_head: ONE replay.
- ``per-layer``: a small prologue graph (embedding, RoPE gather, the store's step context), one graph
  per layer (attention + MLP), a small epilogue graph (final norm, lm_head): L + 2 replays.
- ``split``: as per-layer but attention and MLP are two graphs (the paper's "split graph").

CPU: there is no launch to save, only Python/dispatcher overhead. "Graph" on CPU means
``torch.compile(fullgraph=True, dynamic=False)`` of the WHOLE fixed-shape decode step (inductor
fuses the elementwise ops and calls the GEMMs directly). ``split`` and ``per-layer`` are refused on
CPU (compiling 2L regions would cost minutes of compile time on a 2-core machine for nothing a
whole-step compile does not already give). Capture/compile time is measured in ``capture_s``.

Captures are keyed by ``(B, store.shape_key())``. A store whose buffers change shape (the AttSVD
store across bulk buckets) reports a new shape key; the runner then drops every capture
(:meth:`GraphRunner.invalidate`: they read buffers that are gone) and captures again.
"""
from __future__ import annotations

import itertools
import time
from typing import Hashable

import torch

_captures = itertools.count()


def own_code(fn):
    """``fn`` with a code object of its own (a renamed copy of its code).

    Dynamo keys its compile cache, and its recompile limit (8 by default), by code object. With one
    shared function every engine of the process and every store shape key would be another recompile of
    the same code, and the 9th fails under ``fullgraph=True`` (an AttSVD store crossing 9 bulk buckets,
    say). With one code object per capture each is compiled once, and the compiled code goes when the
    runner drops the function (:meth:`GraphRunner.invalidate`)."""
    fn.__code__ = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_{next(_captures)}")
    return fn


class GraphRunner:
    """Owns the captured graphs (or compiled step) of one Engine, keyed by (batch size, store shape key)."""

    def __init__(self, engine, impl: str | None = None):
        """``impl``: None = by device (CUDA graphs on CUDA, torch.compile on CPU); ``"cuda-graph"`` forces
        the CUDA-graph bookkeeping whatever the device (CPU tests run it with ``torch.cuda``'s capture
        API replaced by an emulator that replays the recorded ATen ops: ``tests/graph_emulator.py``)."""
        self.eng = engine
        self.mode = engine.config.graph
        if impl not in (None, "cuda-graph"):
            raise ValueError(f"impl={impl!r}: use None (by device) or 'cuda-graph'")
        if impl == "cuda-graph" or engine.device.type == "cuda":
            self.impl = "cuda-graph"
        else:
            if self.mode != "whole-step":
                raise ValueError(f"graph={self.mode!r} is not available on CPU: CPU 'graphs' are a "
                                 f"torch.compile of the whole decode step; use graph='whole-step' or 'none'")
            self.impl = f"torch.compile(backend={engine.config.compile_backend!r}, fullgraph, static shapes)"
        self._state: dict[tuple, dict] = {}
        self._store_key: Hashable = None
        #: one record per CPU compile: seconds and the inductor / AOT-autograd cache hits and misses
        #: (a miss is a cold compile, a hit a warm one), apart from any decode time
        self.compiles: list[dict] = []

    # ------------------------------------------------------------------ public
    @property
    def captured(self) -> list[tuple]:
        """The (batch size, store shape key) pairs with a live capture."""
        return list(self._state)

    def invalidate(self) -> None:
        """Drop every capture; the next step captures again (after a store reallocated its buffers, or
        when weights were changed in place by the user)."""
        self._state.clear()

    def _key(self, B: int) -> tuple:
        sk = self.eng.kv.shape_key()
        if sk != self._store_key:          # new store buffers: captures of the old ones are stale
            self.invalidate()
            self._store_key = sk
        return (B, sk)

    def prepare(self, B: int) -> float:
        """Capture / compile for batch size B and the store's current shapes (once). Returns the seconds
        it took (0 if already captured)."""
        key = self._key(B)
        if key in self._state:
            return 0.0
        t0 = time.perf_counter()
        self._state[key] = self._capture_cuda(B) if self.impl == "cuda-graph" else self._compile_cpu(B)
        if self.eng.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        self.eng.capture_s += dt
        return dt

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        B = tokens.shape[0]
        key = self._key(B)
        if key not in self._state:
            self.prepare(B)
        st = self._state[key]
        if self.impl != "cuda-graph":
            return st["fn"](tokens)
        st["tokens"].copy_(tokens)
        for g in st["graphs"]:        # whole-step: 1 replay; per-layer: L + 2; split: 2L + 2
            g.replay()
        return st["out"]

    # ------------------------------------------------------------------ CPU
    def _compile_cpu(self, B: int) -> dict:
        """``torch.compile`` of the whole step for batch B, compiled here by one warm run.

        Guards (``EngineConfig.skip_guards``): the function has a code object of its own (``own_code``), so
        its compiled entry is called by this runner only, with the batch size and store shapes of its key;
        every tensor the step reads (weights, norms, RoPE table, cursor, store buffers) is owned by the
        engine and updated in place, never replaced while the capture lives (a store that reallocates
        reports a new shape key, and :meth:`invalidate` drops the capture). Nothing a guard would check
        can change, so none is evaluated per step."""
        eng, cfg = self.eng, self.eng.config

        def decode_step(t):
            return eng.decode_body(t, live=None)

        fn, options = compiled_region(decode_step, cfg,
                                      **({"cpp_wrapper": True} if cfg.cpp_wrapper and cfg.compile_backend == "inductor" else {}))
        dummy = torch.zeros(B, dtype=torch.long, device=eng.device)
        before = _cache_counters()
        t0 = time.perf_counter()
        with torch.no_grad():
            fn(dummy)            # compile + one warm run (writes slot `length`, overwritten by the real step)
        after = _cache_counters()
        self.compiles.append({"batch": B, "seconds": time.perf_counter() - t0, "backend": cfg.compile_backend,
                              "cpp_wrapper": "cpp_wrapper" in options, "skip_guards": "guard_filter_fn" in options,
                              **{k: after[k] - before[k] for k in after}})
        return {"fn": fn}

    # ------------------------------------------------------------------ CUDA
    def _capture_cuda(self, B: int) -> dict:
        eng, cfg = self.eng, self.eng.config
        tokens = torch.zeros(B, dtype=torch.long, device=eng.device)
        stages = decode_stages(eng, self.mode, B, tokens)
        if cfg.graph_compile:      # fused kernels inside the graph; compiled by the first warm-up run below
            stages = [compiled_region(f, cfg)[0] for f in stages]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():     # warm-up (allocator, lazy inits, Triton JIT)
            for _ in range(2):
                carry = None
                for f in stages:
                    carry = f(carry)
        torch.cuda.current_stream().wait_stream(side)
        pool = torch.cuda.graph_pool_handle()
        graphs, carries, carry = [], [], None
        with torch.no_grad():
            for f in stages:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    carry = f(carry)
                graphs.append(g)
                carries.append(carry)     # keep every region's outputs alive (static addresses)
        return {"tokens": tokens, "graphs": graphs, "out": carry, "carries": carries}


def compiled_region(fn, cfg, **options):
    """``torch.compile`` of one decode region, as every graph mode compiles it: a code object of its own
    (``own_code``), fullgraph, static shapes, ``cfg.compile_backend``; no guard evaluated per call where
    ``cfg.skip_guards`` asks and torch has the filter (>= 2.8). ``options``: more compile options.
    Returns (compiled fn, the options passed)."""
    skip = getattr(torch.compiler, "skip_all_guards_unsafe", None)
    options = {**({"guard_filter_fn": skip} if cfg.skip_guards and skip is not None else {}), **options}
    return torch.compile(own_code(fn), fullgraph=True, dynamic=False, backend=cfg.compile_backend,
                         options=options or None), options


def _cache_counters() -> dict[str, int]:
    """Inductor's FX-graph cache and AOT-autograd cache hit / miss counters of this process."""
    from torch._dynamo.utils import counters

    ind, aot = counters["inductor"], counters["aot_autograd"]
    return {"fxgraph_cache_hit": ind["fxgraph_cache_hit"], "fxgraph_cache_miss": ind["fxgraph_cache_miss"],
            "autograd_cache_hit": aot["autograd_cache_hit"], "autograd_cache_miss": aot["autograd_cache_miss"]}


def decode_stages(eng, mode: str, B: int, tokens: torch.Tensor) -> list:
    """The decode step cut into graph regions; stage k maps stage k-1's carry (the first gets None).

    ``whole-step``: [step]; ``per-layer``: [prologue, layer_0, ..., layer_{L-1}, epilogue];
    ``split``: [prologue, attn_0, mlp_0, ..., epilogue]. Running the stages in order IS one decode
    step (CPU tests check this against ``decode_body``); on CUDA each stage is captured as a graph.
    None of them moves the cursor.
    """
    if mode == "whole-step":
        return [lambda _: eng.decode_body(tokens, live=None)]

    def prologue(_):        # embedding + RoPE gather + the store's step context: one small graph
        return torch.nn.functional.embedding(tokens, eng.embed), eng.step_context(B, None)

    def epilogue(carry):    # final norm + lm_head: one small graph
        return eng._head(carry[0])

    stages = [prologue]
    for i in range(eng.n_layers):
        attn = lambda carry, i=i: (eng._attn_block(i, carry[0], carry[1]), carry[1])
        mlp = lambda carry, i=i: (eng._mlp_block(i, carry[0]), carry[1])
        if mode == "per-layer":
            stages.append(lambda carry, a=attn, m=mlp: m(a(carry)))
        elif mode == "split":
            stages += [attn, mlp]
        else:
            raise ValueError(f"graph mode {mode!r}")
    return stages + [epilogue]
