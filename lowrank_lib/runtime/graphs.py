"""Graph modes for the decode step.

CUDA (``torch.cuda.CUDAGraph``): every mode reads the live cache length / pad from device tensors,
so one capture per batch size serves every step (no length buckets).

- ``whole-step``: embedding -> all layers -> final norm -> lm_head -> ``length += 1``: ONE replay.
- ``per-layer``: a small prologue graph (embedding, RoPE gather, slot mask), one graph per layer
  (attention + MLP), a small epilogue graph (final norm, lm_head, length += 1): L + 2 replays.
- ``split``: as per-layer but attention and MLP are two graphs (the paper's "split graph").

CPU: there is no launch to save, only Python/dispatcher overhead. "Graph" on CPU means
``torch.compile(fullgraph=True, dynamic=False)`` of the WHOLE fixed-shape decode step (inductor
fuses the elementwise ops and calls the GEMMs directly). ``split`` and ``per-layer`` are refused on
CPU (compiling 2L regions would cost minutes of compile time on a 2-core machine for nothing a
whole-step compile does not already give). Capture/compile time is measured in ``capture_s``.
"""
from __future__ import annotations

import time

import torch


class GraphRunner:
    """Owns the captured graphs (or compiled step) of one Engine, keyed by batch size."""

    def __init__(self, engine):
        self.eng = engine
        self.mode = engine.config.graph
        if engine.device.type == "cuda":
            self.impl = "cuda-graph"
        else:
            if self.mode != "whole-step":
                raise ValueError(f"graph={self.mode!r} is not available on CPU: CPU 'graphs' are a "
                                 f"torch.compile of the whole decode step; use graph='whole-step' or 'none'")
            self.impl = f"torch.compile(backend={engine.config.compile_backend!r}, fullgraph, static shapes)"
        self._state: dict[int, dict] = {}

    # ------------------------------------------------------------------ public
    def prepare(self, B: int) -> float:
        """Capture / compile for batch size B (once). Returns the seconds it took (0 if cached)."""
        if B in self._state:
            return 0.0
        c = self.eng.cache
        saved, host = c.length.clone(), c.host_len
        t0 = time.perf_counter()
        if self.impl == "cuda-graph":
            self._state[B] = self._capture_cuda(B)
        else:
            self._state[B] = self._compile_cpu(B)
        if self.eng.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        c.length.copy_(saved)   # warm-up runs wrote slot `length` (overwritten by the real step)
        c.host_len = host
        self.eng.capture_s += dt
        return dt

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        B = tokens.shape[0]
        if B not in self._state:
            self.prepare(B)
        st = self._state[B]
        if self.impl != "cuda-graph":
            return st["fn"](tokens)
        st["tokens"].copy_(tokens)
        for g in st["graphs"]:        # whole-step: 1 replay; per-layer: L + 2; split: 2L + 2
            g.replay()
        return st["out"]

    # ------------------------------------------------------------------ CPU
    def _compile_cpu(self, B: int) -> dict:
        eng = self.eng
        fn = torch.compile(lambda t: eng.decode_body(t, live=None), fullgraph=True, dynamic=False,
                           backend=eng.config.compile_backend)
        dummy = torch.zeros(B, dtype=torch.long, device=eng.device)
        with torch.no_grad():
            fn(dummy)            # compile + one warm run
        return {"fn": fn}

    # ------------------------------------------------------------------ CUDA
    def _capture_cuda(self, B: int) -> dict:
        eng, c = self.eng, self.eng.cache
        tokens = torch.zeros(B, dtype=torch.long, device=eng.device)
        stages = decode_stages(eng, self.mode, B, tokens)
        saved = c.length.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():     # warm-up (allocator, lazy inits, Triton JIT)
            for _ in range(2):
                carry = None
                for f in stages:
                    carry = f(carry)
                c.length.copy_(saved)
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


def decode_stages(eng, mode: str, B: int, tokens: torch.Tensor) -> list:
    """The decode step cut into graph regions; stage k maps stage k-1's carry (the first gets None).

    ``whole-step``: [step]; ``per-layer``: [prologue, layer_0, ..., layer_{L-1}, epilogue];
    ``split``: [prologue, attn_0, mlp_0, ..., epilogue]. Running the stages in order IS one decode
    step (CPU tests check this against ``decode_body``); on CUDA each stage is captured as a graph.
    """
    if mode == "whole-step":
        return [lambda _: eng.decode_body(tokens, live=None)]

    def prologue(_):        # embedding + RoPE gather + slot mask: one small graph
        return torch.nn.functional.embedding(tokens, eng.embed), eng.step_context(B, None)

    def epilogue(carry):    # final norm + lm_head + length += 1: one small graph
        logits = eng._head(carry[0])
        eng.cache.length.add_(1)
        return logits

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
