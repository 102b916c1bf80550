"""Graph modes for the decode step.

CUDA (``torch.cuda.CUDAGraph``): every mode reads the live cache length / pad from device tensors,
so one capture per batch size serves every step (no length buckets).

- ``whole-step``: embedding -> all layers -> final norm -> lm_head -> ``length += 1``: ONE replay.
- ``per-layer``: an eager prologue (embedding, RoPE gather, slot mask into static buffers), one
  replay per layer (attention + MLP), an eager epilogue (final norm, lm_head, length += 1).
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
        if self.mode == "whole-step":
            st["graphs"][0].replay()
            return st["out"]
        eng = self.eng
        _, cs, mask, _, _ = eng._step_inputs(B, None)
        st["x"].copy_(torch.nn.functional.embedding(tokens, eng.embed))
        st["cs"].copy_(cs)
        if mask is not None:
            st["mask"].copy_(mask)
        for g in st["graphs"]:
            g.replay()
        logits = eng._head(st["out"])
        eng.cache.length.add_(1)
        return logits

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
        dev = eng.device
        tokens = torch.zeros(B, dtype=torch.long, device=dev)
        pool = torch.cuda.graph_pool_handle()
        if self.mode == "whole-step":
            bodies = [lambda: eng.decode_body(tokens, live=None)]
            st = {"tokens": tokens}
        else:
            pos, cs, mask, Ks, Vs = eng._step_inputs(B, None)
            x = torch.zeros(B, eng.hidden, dtype=eng.dtype, device=dev)
            st = {"tokens": tokens, "x": x, "cs": cs.clone(), "mask": mask.clone()}
            ctx = (c.length, st["cs"], st["mask"], Ks, Vs)
            bodies = []
            for i in range(eng.n_layers):
                attn = lambda inp, i=i: eng._attn_block(i, inp, ctx)
                mlp = lambda inp, i=i: eng._mlp_block(i, inp)
                if self.mode == "per-layer":
                    bodies.append(lambda inp, a=attn, m=mlp: m(a(inp)))
                else:
                    bodies += [attn, mlp]
        saved = c.length.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():     # warm-up (allocator, lazy inits, autotune)
            for _ in range(2):
                inp = st.get("x")
                for body in bodies:
                    inp = body() if self.mode == "whole-step" else body(inp)
                c.length.copy_(saved)
        torch.cuda.current_stream().wait_stream(side)
        graphs, inp = [], st.get("x")
        with torch.no_grad():
            for body in bodies:
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    inp = body() if self.mode == "whole-step" else body(inp)
                graphs.append(g)
        st["graphs"], st["out"] = graphs, inp
        return st
