"""Every Triton kernel of the project, run on the CPU by Triton's interpreter (``TRITON_INTERPRET=1``).

The interpreter executes the kernel's Python body with numpy semantics on CPU tensors: the same
indexing, masks, loop bounds and dtype conversions the GPU compiler would lower. These tests check the
kernel against the portable path on tiny shapes, through the engine end to end, and under the CUDA-graph
emulator (``tests/graph_emulator.py``), so the device-side length/pad reads are what a replay sees.
The GPU itself (speed, real capture) is checked by ``python -m lowrank_lib.bench gpu-session``.

The interpreter must be switched on before triton compiles anything, so each check runs in a fresh
Python process with the variable set.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (extra 'triton'); the Triton kernels are untested here")

HERE = Path(__file__).resolve().parent


def _run(code: str, timeout: int = 600) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join([str(HERE.parent), str(HERE),
                                                                                  os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


KERNEL_GRID = r"""
import itertools, json, torch
from lowrank_lib.runtime.attention import sdpa_decode, triton_decode
from lowrank_lib.runtime.kv import Cursor, slot_mask
g = torch.Generator().manual_seed(0)
rows = []
# head dims, GQA group sizes, lengths around the kernel's 64-slot block, dtypes: every PAIR of two factors' values
# (15 cases where the full product is 90; the interpreter runs each launch in Python), left pads (0, 7)
Ds, Gs, ns, dts = (16, 64, 128), (1, 3), (1, 63, 64, 65, 130), (torch.float32, torch.bfloat16, torch.float16)
cases = [(Ds[(i + j) % 3], Gs[(i + j) % 2], n, dt) for i, n in enumerate(ns) for j, dt in enumerate(dts)]
for (a, va), (b, vb) in itertools.combinations(enumerate((Ds, Gs, ns, dts)), 2):
    assert {(c[a], c[b]) for c in cases} == set(itertools.product(va, vb)), (a, b)
for D, G, n, dt in cases:
    pads = (0, 7)                                     # row 0 unpadded
    B, Hkv, S = 2, 2, 136
    pads = tuple(min(p, n - 1) for p in pads)
    c = Cursor(B, S, "cpu")
    c.reset(torch.tensor(pads))
    c.advance(n - 1)                                  # the token being decoded was written at slot n - 1
    K = torch.randn(B, Hkv, S, D, generator=g).to(dt)
    V = torch.randn(B, Hkv, S, D, generator=g).to(dt)
    q = torch.randn(B, Hkv, G, D, generator=g).to(dt)
    K[:, :, n:] = float("nan")                        # slots past the length must never be read
    V[:, :, n:] = float("nan")
    ref = sdpa_decode(q.float(), K[:, :, :n].float(), V[:, :, :n].float(), c, slot_mask(c, torch.arange(S), B, n, torch.float32))
    out = triton_decode(q, K, V, c, None)
    rows.append({"D": D, "G": G, "n": n, "pads": pads, "dtype": str(dt), "dtype_out": str(out.dtype),
                 "err": float((out.float() - ref).abs().max())})
# a long buffer: chunks of two blocks (triton_splits), lengths around the chunk edges and the last chunk
from lowrank_lib.runtime.attention import triton_splits
assert triton_splits(136) == (64, 3) and triton_splits(2112) == (128, 17)
for n, pads in itertools.product((128, 129, 2100), ((0, 100),)):
    B, Hkv, S, D, G = 2, 1, 2112, 16, 2
    pads = tuple(min(p, n - 1) for p in pads)
    c = Cursor(B, S, "cpu")
    c.reset(torch.tensor(pads))
    c.advance(n - 1)
    K, V = (torch.randn(B, Hkv, S, D, generator=g) for _ in "kv")
    q = torch.randn(B, Hkv, G, D, generator=g)
    K[:, :, n:] = float("nan")
    V[:, :, n:] = float("nan")
    ref = sdpa_decode(q, K[:, :, :n], V[:, :, :n], c, slot_mask(c, torch.arange(S), B, n, torch.float32))
    out = triton_decode(q, K, V, c, None)
    rows.append({"D": D, "G": G, "n": n, "pads": pads, "dtype": "torch.float32", "dtype_out": str(out.dtype),
                 "err": float((out - ref).abs().max()), "S": S})
print(json.dumps(rows))
"""


def test_triton_decode_kernel_matches_sdpa_on_a_grid():
    """Head dims 16/64/128, GQA groups 1 and 3, lengths 1..130 across the 64-slot block and the split-K
    chunks (3 of 64 slots), left padding, fp32/bf16/fp16 (every pair of these values in some case: a covering
    design, checked in the child), and a 2112-slot buffer (17 chunks of 128) with lengths at the chunk edges: the
    kernels equal sdpa over the live slots, never read slots past the length (they hold NaN), and return the input
    dtype."""
    rows = _run(KERNEL_GRID)
    assert len(rows) == 5 * 3 + 3
    for r in rows:
        tol = 1e-5 if r["dtype"] == "torch.float32" else 2e-2
        assert r["err"] < tol, r
        assert r["dtype_out"] == r["dtype"], r


ENGINE = r"""
import json, torch
from graph_emulator import emulated_cuda_graphs
from lowrank_lib import models
from lowrank_lib.compress import compress_svd
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.graphs import GraphRunner
res = {}
for preset in ("tiny-gqa", "tiny-smol"):              # head_dim 16 (2:1 GQA) and 64 (3:1, SmolLM2's heads)
    model = compress_svd(models.tiny_model(preset, seed=3), 0.6)
    g = torch.Generator().manual_seed(1)
    ref = Engine(model, EngineConfig(max_batch=2, max_seq_len=48, attention="sdpa"))
    eng = Engine(model, EngineConfig(max_batch=2, max_seq_len=48, attention="triton"))
    graphs = {}
    for mode in ("whole-step", "per-layer"):          # the CUDA-graph bookkeeping, emulated, over the Triton op
        e = Engine(model, EngineConfig(max_batch=2, max_seq_len=48, attention="triton", graph="whole-step"))
        e.config.graph = mode
        graphs[mode] = e
    out = []
    with emulated_cuda_graphs():
        for e in graphs.values():
            e.graphs = GraphRunner(e, impl="cuda-graph")
        for T, padrow in ((9, 1), (14, 0)):           # two requests, other lengths and pads: one capture serves both
            ids = torch.randint(0, 256, (2, T), generator=g)
            mask = torch.ones(2, T, dtype=torch.long)
            mask[padrow, :4] = 0
            a = ref.generate(ids, 6, mask, return_logits=True)
            row = {}
            for name, e in [("eager", eng), *graphs.items()]:
                b = e.generate(ids, 6, mask, return_logits=True)
                row[name] = [bool(torch.equal(a.tokens, b.tokens)),
                             max(float((x - y).abs().max()) for x, y in zip(a.logits, b.logits))]
            out.append(row)
    res[preset] = {"rows": out, "backend": eng.report()["backend"], "reason": eng.report()["backend_reason"],
                   "captures": {m: len(e.graphs.captured) for m, e in graphs.items()}}
print(json.dumps(res))
"""


def test_engine_with_the_triton_backend_equals_sdpa_eager_and_under_emulated_cuda_graphs():
    """The engine's Triton route end to end (the store's buffers, length + 1, left-pad counts), eagerly
    and replayed from ONE emulated capture per graph mode across two requests of other lengths and
    padding: greedy tokens equal the sdpa engine's, logits within 1e-5."""
    res = _run(ENGINE)
    for preset, r in res.items():
        assert r["backend"] == "triton" and "interpreter" in r["reason"], r
        assert r["captures"] == {"whole-step": 1, "per-layer": 1}, r
        for row in r["rows"]:
            for name, (equal, err) in row.items():
                assert equal and err < 1e-5, (preset, name, row)


def test_triton_needs_the_interpreter_or_cuda_on_cpu():
    """Without TRITON_INTERPRET, attention='triton' on CPU is refused with the reason; 'auto' never picks it."""
    import torch

    from lowrank_lib.runtime.attention import select_backend

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("this process runs the interpreter")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1 on CPU"):
        select_backend("triton", torch.device("cpu"), 64, torch.float32)
    assert select_backend("auto", torch.device("cpu"), 64, torch.float32).name in ("sdpa", "lrk_attend")   # never triton
