"""The weight arena (``runtime/kernels/arena.cpp``): packed matrices in mappings advised as 2 MB huge pages.

What must hold: a matrix packed in the arena is byte for byte the one packed by torch's allocator and every kernel
gives the same bits on it; allocations are 64-byte aligned and never overlap; every mapping goes back when its last
matrix is freed (small matrices share a chunk, large ones own a mapping); switched off, nothing goes to it; an
engine's packed weights live in it and ``Engine.report()`` says how many bytes the kernel backed by huge pages.
"""
from __future__ import annotations

import gc

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.kernels import build

from kernel_isa import LIB

pytestmark = pytest.mark.skipif(not LIB.available, reason=f"the kernel library cannot run here: {LIB.reason}")

LARGE = 8 << 20          # arena.cpp: requests this big get their own mapping


def _ops():
    from lowrank_lib.runtime.kernels import ops

    return ops


def _live():
    gc.collect()
    return build.arena_info()


def test_arena_and_torch_allocator_pack_the_same_bytes_and_the_kernels_agree():
    ops = _ops()
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for out, inp in [(1, 1), (17, 33), (209, 576), (1536, 2048 + 7)]:        # the last one above LARGE in fp32
            W = torch.randn(out, inp, generator=g).to(dtype)
            before = _live()["live"]
            P = ops.pack(W)
            assert _live()["live"] == before + 1, "pack did not allocate from the arena"
            with build.arena(False):
                Q = ops.pack(W)
                assert _live()["live"] == before + 1, "pack allocated from the arena while it was off"
            assert torch.equal(P.view(torch.uint8), Q.view(torch.uint8))
            assert P.data_ptr() % 64 == 0
            x = torch.randn(3, inp, generator=g).to(dtype)
            assert torch.equal(ops.gemv(x, [P], [out], [inp], [0]), ops.gemv(x, [Q], [out], [inp], [0]))
            assert torch.equal(ops.unpack(P, out, inp), W)
            del P, Q


def test_qpack_in_the_arena_round_trips():
    ops = _ops()
    g = torch.Generator().manual_seed(1)
    out, inp, group = 300, 256, 64
    data = torch.randint(-128, 128, (out, inp), generator=g, dtype=torch.int8)
    scale = torch.rand(out, inp // group, generator=g).to(torch.float16)
    before = _live()["live"]
    P = ops.qpack(data, scale, 8, group, out, inp)
    assert _live()["live"] == before + 1 and P.data_ptr() % 64 == 0
    with build.arena(False):
        Q = ops.qpack(data, scale, 8, group, out, inp)
    assert torch.equal(P, Q)
    d2, s2 = ops.qunpack(P, 8, group, out, inp)
    assert torch.equal(d2, data) and torch.equal(s2.view(torch.int16), scale.view(torch.int16))


def test_allocations_do_not_overlap_and_every_mapping_goes_back():
    ops = _ops()
    base = _live()
    small = [ops.pack(torch.full((64, 40 + i), float(i + 1))) for i in range(50)]       # carved from one chunk
    big = [ops.pack(torch.full((LARGE // 4 // 1024 + 64 * i, 1024), -1.0 - i)) for i in range(2)]  # own mappings
    mid = _live()
    assert mid["live"] == base["live"] + 52
    assert mid["mappings"] >= base["mappings"] + 2
    assert mid["bytes_live"] >= base["bytes_live"] + sum(p.nbytes for p in small + big)
    spans = sorted((p.data_ptr(), p.data_ptr() + p.nbytes) for p in small + big)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:])), "two packed matrices share memory"
    # writing every matrix left every other intact
    for i, p in enumerate(small):
        assert torch.all(ops.unpack(p, 64, 40 + i) == float(i + 1))
    del p
    del big
    assert _live()["mappings"] == mid["mappings"] - 2, "a large matrix's mapping outlived it"
    del small[:-1]
    assert _live()["live"] == base["live"] + 1            # one small matrix keeps its chunk
    del small
    end = _live()
    assert (end["live"], end["mappings"], end["bytes_mapped"], end["bytes_live"]) == (
        base["live"], base["mappings"], base["bytes_mapped"], base["bytes_live"])


def test_hugepages_off_by_environment_is_torch_memory(tmp_path):
    """``$LOWRANK_LIB_HUGEPAGES=0`` (read once per process): pack never allocates from the arena."""
    import subprocess
    import sys

    code = ("import torch; from lowrank_lib.runtime.kernels import build, ops; build.load(); "
            "P = ops.pack(torch.randn(300, 300)); i = build.arena_info(); print(i['on'], i['live'])")
    env = {**__import__("os").environ, "LOWRANK_LIB_HUGEPAGES": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-2:] == ["False", "0"]


def test_engine_weights_live_in_the_arena_and_the_report_says_so():
    model = models.tiny_model("tiny-gqa", seed=0).to(torch.bfloat16)
    before = _live()["live"]
    eng = Engine(model, EngineConfig(max_seq_len=32, kernels="lrk", graph="none"))
    if not eng.report()["gemv"].startswith("lrk"):
        pytest.skip(f"the packed GEMV does not run here: {eng.report()['gemv_reason']}")
    arena = eng.report()["kernels"]["arena"]
    assert arena["on"] and arena["live"] >= before + len(model.model.layers) * 4
    del eng
    assert _live()["live"] == before, "the engine's packed weights outlived it"


def test_dense_kv_buffer_lives_in_the_arena_zeroed_and_goes_with_its_engine():
    """The dense store's buffer (which our attention streams every token) is arena memory when our native attention
    reads it: zeros, 64-byte aligned, handed out of the arena (its bytes counted), released with the engine; with the
    portable kernels it is torch memory. arena_zeros refuses a negative size."""
    ops = _ops()
    model = models.tiny_model("tiny-gqa", seed=0)
    base = _live()
    eng = Engine(model, EngineConfig(max_seq_len=48, kernels="lrk", graph="none"))
    if not eng.kv.backend.caps.native:
        pytest.skip(f"our attention does not run here: {eng.kv.backend.reason}")
    kv = eng.kv.kv
    info = _live()
    assert info["bytes_live"] - base["bytes_live"] >= kv.numel() * kv.element_size()
    assert kv.data_ptr() % 64 == 0 and not kv.any()
    eng.generate(torch.randint(0, 100, (1, 5)), 3)
    assert kv.any()                                                  # the engine wrote its cache there
    del eng, kv
    assert _live()["live"] == base["live"], "the KV buffer outlived its engine"
    port = Engine(model, EngineConfig(max_seq_len=48, kernels="portable", graph="none"))
    assert _live()["bytes_live"] == base["bytes_live"] and not port.kv.kv.any()
    with build.arena(False):
        z = ops.arena_zeros((3, 5), torch.bfloat16)
        assert _live()["live"] == base["live"] and z.shape == (3, 5) and z.dtype == torch.bfloat16 and not z.any()
    with pytest.raises(RuntimeError, match="numel"):
        ops.arena_zeros((-1,), torch.float32)


def test_tiered_store_buffers_live_in_the_arena_and_decode_the_same_bits():
    """A method's tiered layers (composed cache: exact rows, int8 runs, scales, appended rows), which the fused kernel
    streams every token, are moved into the arena after the fit (``TieredLayer.place``) when our kernel reads them:
    every streamed buffer handed out of the arena, the decode's logits the same bits as with the arena off (torch
    memory), and every byte back when the engine goes."""
    from lowrank_lib.kv import MethodStore, make_method
    from lowrank_lib.kv.tiers import TieredLayer

    model = models.tiny_model("tiny-gqa", seed=0).eval()
    g = torch.Generator().manual_seed(0)
    ids, nxt = torch.randint(3, 256, (1, 48), generator=g), torch.randint(3, 256, (3, 1), generator=g)

    def run():
        eng = Engine(model, EngineConfig(max_seq_len=56, graph="none"),
                     kv=MethodStore(make_method("composed-kvzip-q8", budget=0.5)))
        with torch.no_grad():
            out = [eng.prefill(ids)] + [eng.step(t) for t in nxt]
        return eng, torch.stack([o.float() for o in out])

    base = _live()
    dense = Engine(model, EngineConfig(max_seq_len=56, graph="none"))      # the packed weights + the dense KV buffer
    weights = _live()["bytes_live"] - base["bytes_live"] - dense.kv.kv.numel() * dense.kv.kv.element_size()
    del dense
    eng, logits = run()
    if eng.kv.backend.name != "lrk_tiers":
        pytest.skip(f"the fused tier kernel does not run here: {eng.kv.backend.reason}")
    layers = eng.kv.layers
    streamed = [getattr(l, n) for l in layers for n in TieredLayer.STREAMED if getattr(l, n) is not None]
    assert any(l.counts()["mid"] for l in layers) and any(l.counts()["exact"] for l in layers)
    held = sum(t.numel() * t.element_size() for t in streamed)
    assert _live()["bytes_live"] - base["bytes_live"] >= weights + held
    assert all(t.data_ptr() % 64 == 0 for t in streamed if t.numel())
    del eng, layers, streamed
    assert _live()["live"] == base["live"], "the tiered buffers outlived their engine"
    with build.arena(False):
        eng_off, logits_off = run()
        assert _live()["bytes_live"] == base["bytes_live"]
    assert torch.equal(logits, logits_off)
