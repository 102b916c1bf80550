"""The graph runner's bookkeeping on the CPU: what is captured per key, when captures are dropped, and what
a replay reads from device memory.

CUDA graphs are emulated (``tests/graph_emulator.py``: the ATen ops of a capture are recorded and replayed
on the same tensors, so host state baked at capture time is frozen as on a GPU); the CPU's own "graph",
the compiled whole step, is checked for the same properties across requests.
"""
from __future__ import annotations

import pytest
import torch

from graph_emulator import CaptureError, emulated_cuda_graphs, recorded_tensors
from helpers import rel_err
from lowrank_lib import models
from lowrank_lib.compress import compress_svd
from lowrank_lib.kv import make_method
from lowrank_lib.kv.engine_adapter import MethodStore
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.graphs import GraphRunner
from lowrank_lib.runtime.kv import DenseKV

STORES = {"dense": DenseKV, "attsvd": lambda: MethodStore(make_method("attsvd", rank=4, window=4)),
          "composed": lambda: MethodStore(make_method("composed-kvzip-q8", 0.4))}
ECFG = dict(max_batch=2, max_seq_len=96)
#: (prompt length, padded row, pad count): three requests of other lengths and padding, one capture key
#: for the dense store; a method store fits each request to its own shapes (one capture per request)
REQUESTS = ((30, 0, 0), (33, 1, 5), (50, 0, 3))


@pytest.fixture(scope="module")
def model():
    return compress_svd(models.tiny_model("tiny-gqa", seed=6), 0.7)


def _batch(T, row, pad, seed):
    ids = torch.randint(3, 256, (2, T), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[row, :pad] = 0
    return ids, mask


def _emulated(model, store, mode):
    """An engine whose decode runs the CUDA-graph runner (emulated) in ``mode``; build inside the emulator."""
    eng = Engine(model, EngineConfig(**ECFG, graph="whole-step"), kv=store)     # store allocated for graphs
    eng.config.graph = mode
    eng.graphs = GraphRunner(eng, impl="cuda-graph")
    return eng


@pytest.mark.parametrize("name", list(STORES))
@pytest.mark.parametrize("mode", ["whole-step", "per-layer", "split"])
def test_replays_equal_eager_across_requests_and_captures_once_per_key(model, name, mode):
    eager = Engine(model, EngineConfig(**ECFG), kv=STORES[name]())
    with emulated_cuda_graphs():
        eng = _emulated(model, STORES[name](), mode)
        keys, regions = [], {"whole-step": 1, "per-layer": 2 + 2, "split": 2 * 2 + 2}[mode]
        for i, (T, row, pad) in enumerate(REQUESTS):
            ids, mask = _batch(T, row, pad, seed=i)
            a = eager.generate(ids, 7, mask, return_logits=True)
            b = eng.generate(ids, 7, mask, return_logits=True)
            assert torch.equal(a.tokens, b.tokens), (name, mode, T)
            assert rel_err(torch.stack(b.logits, 1), torch.stack(a.logits, 1)) < 1e-5
            (key,) = eng.graphs.captured                   # only the live key is kept
            keys.append(key)
            st = eng.graphs._state[key]
            assert len(st["graphs"]) == regions
            assert (b.info["capture_s"] > 0) == (i == 0 or keys[-1] != keys[-2])   # capture only on a new key
    if name == "dense":
        assert keys == [(2, ())] * 3                        # one capture serves every request
    else:
        assert len(set(keys)) == 3                          # each request's fit has its shapes: re-captured


def test_replay_reads_the_cursor_and_the_token_from_device_memory(model):
    """The captured step depends on the cursor's device tensors (length, pad) and the static token buffer,
    never on host values: replaying after moving the cursor by hand moves the written slot."""
    with emulated_cuda_graphs():
        eng = _emulated(model, DenseKV(), "whole-step")
        ids, mask = _batch(12, 1, 4, seed=0)
        eng.generate(ids, 3, mask)
        st = eng.graphs._state[(2, ())]
        (g,) = st["graphs"]
        read = {id(t) for t in recorded_tensors(g)}
        assert {id(eng.cursor.length), id(eng.cursor.pad), id(st["tokens"])} <= read
        # the token written at the cursor's slot: put the cursor at slot 20 and replay
        eng.kv.kv.zero_()
        eng.cursor.length.fill_(20)
        st["tokens"].copy_(torch.tensor([5, 6]))
        g.replay()
        written = eng.kv.k[0].abs().sum(-1)[0, 0]           # [Smax] of row 0, head 0, layer 0
        assert written.nonzero().flatten().tolist() == [20]


class HostBakedKV(DenseKV):
    """A planted bug: under graphs it slices the live prefix with the HOST length (frozen at capture)."""

    name = "host-baked"

    def step_context(self, B, live, rope):
        return super().step_context(B, self.cursor.host + 1 if live is None else live, rope)


class HostSyncKV(DenseKV):
    """A planted bug: reads a device value on the host inside the step (a sync CUDA refuses while capturing)."""

    name = "host-sync"

    def step_context(self, B, live, rope):
        if live is None and int(self.cursor.length) < 0:
            raise AssertionError("unreachable")
        return super().step_context(B, live, rope)


def test_the_emulator_catches_host_state_baked_into_a_capture(model):
    """Without this the tests above could not fail: host-side lengths frozen at capture give wrong results
    (or an out-of-range write) on replay, a host sync inside a capture is refused."""
    eager = Engine(model, EngineConfig(**ECFG))
    ids, mask = _batch(30, 0, 0, seed=1)
    ref = eager.generate(ids, 7, mask, return_logits=True)
    with emulated_cuda_graphs():
        eng = _emulated(model, HostBakedKV(), "whole-step")
        try:
            out = eng.generate(ids, 7, mask, return_logits=True)
            wrong = not torch.equal(out.tokens, ref.tokens) or rel_err(torch.stack(out.logits, 1),
                                                                       torch.stack(ref.logits, 1)) > 1e-3
        except (RuntimeError, IndexError):
            wrong = True
        assert wrong
        eng = _emulated(model, HostSyncKV(), "per-layer")
        with pytest.raises(CaptureError, match="host while capturing"):
            eng.generate(ids, 3, mask)


def test_invalidate_and_batch_sizes_under_emulated_cuda_graphs(model):
    with emulated_cuda_graphs():
        eng = _emulated(model, DenseKV(), "per-layer")
        ids, mask = _batch(10, 1, 2, seed=2)
        first = eng.generate(ids, 4, mask)
        assert eng.graphs.captured == [(2, ())]
        eng.graphs.invalidate()
        assert eng.graphs.captured == []
        again = eng.generate(ids, 4, mask)
        assert again.info["capture_s"] > 0 and torch.equal(again.tokens, first.tokens)
        one = eng.generate(ids[:1], 4)                     # another batch size: its own capture beside
        assert sorted(eng.graphs.captured) == [(1, ()), (2, ())]
        assert torch.equal(one.tokens, Engine(model, EngineConfig(**ECFG)).generate(ids[:1], 4).tokens)


@pytest.mark.parametrize("name", list(STORES))
def test_compiled_step_serves_requests_with_and_without_padding(model, name):
    """The CPU graph (compiled whole step) across requests that switch padding on and off and change
    length: host-side request state (any padding?, host length) never changes what the step computes."""
    eager = Engine(model, EngineConfig(**ECFG), kv=STORES[name]())
    comp = Engine(model, EngineConfig(**ECFG, graph="whole-step", compile_backend="aot_eager"), kv=STORES[name]())
    for i, (T, row, pad) in enumerate(((31, 0, 0), (31, 1, 6), (33, 0, 0), (31, 0, 3))):
        ids, mask = _batch(T, row, pad, seed=10 + i)
        a = eager.generate(ids, 6, mask, return_logits=True)
        b = comp.generate(ids, 6, mask, return_logits=True)
        assert torch.equal(a.tokens, b.tokens), (name, i)
        assert rel_err(torch.stack(b.logits, 1), torch.stack(a.logits, 1)) < 1e-5


def test_compiled_step_replays_equal_eager(model):
    """``graph_compile``: the whole step is torch.compile-d before its capture (aot_eager here: the traced ATen
    graph runs, so the emulator records it as CUDA records inductor's kernels); the replays equal eager
    decoding across requests of other lengths and padding, from one capture."""
    from torch._dynamo.utils import counters

    eager = Engine(model, EngineConfig(**ECFG, kernels="portable"))     # ATen only, as on CUDA (the Triton op aside)
    graphs_before = counters["stats"]["unique_graphs"]
    with emulated_cuda_graphs():
        eng = Engine(model, EngineConfig(**ECFG, kernels="portable", graph="whole-step", graph_compile=True,
                                         compile_backend="aot_eager"))
        eng.graphs = GraphRunner(eng, impl="cuda-graph")
        for i, (T, row, pad) in enumerate(REQUESTS):
            ids, mask = _batch(T, row, pad, seed=i)
            a, b = eager.generate(ids, 6, mask, return_logits=True), eng.generate(ids, 6, mask, return_logits=True)
            assert torch.equal(a.tokens, b.tokens) and rel_err(torch.stack(b.logits, 1), torch.stack(a.logits, 1)) < 1e-5
        assert eng.graphs.captured == [(2, ())]             # one capture served every request
    assert counters["stats"]["unique_graphs"] == graphs_before + 1      # the step was compiled, once


def test_graph_compile_needs_a_graph_mode():
    for graph in ("none", "per-layer"):
        with pytest.raises(ValueError, match="graph_compile"):
            EngineConfig(graph_compile=True, graph=graph)
