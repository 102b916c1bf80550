"""The KVStore seam: every store through the same engine matrix (reference equality, compiled step ==
eager, bytes held, the one append and the one advance), graph-runner invalidation, a third-party store."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.compat import cache_kw
from lowrank_lib.compress import compress_svd
from lowrank_lib.kv import make_method
from lowrank_lib.kv.engine_adapter import MethodStore
from lowrank_lib.kv.hf_adapter import KVCache
from lowrank_lib.generation import run_generation
from lowrank_lib.runtime import Engine, EngineConfig
from lowrank_lib.runtime.baselines import HFRunner
from lowrank_lib.runtime.kv import DenseKV, KVStore, RebuildKV
from lowrank_lib.runtime.profiling import DispatchCounter

from helpers import rel_err

ATTSVD = dict(rank=8, window=6)          # r/d = 0.5 at d = 16
STORES = {"dense": DenseKV, "rebuild": RebuildKV, "attsvd": lambda: MethodStore(make_method("attsvd", **ATTSVD))}
ECFG = dict(max_batch=2, max_seq_len=64)


@pytest.fixture(scope="module")
def model():
    return compress_svd(models.tiny_model("tiny-gqa", seed=1), 0.6)


def _batch(T=40, pad=5, seed=3):
    ids = torch.randint(3, 256, (2, T), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[1, :pad] = 0
    return ids, mask


def _reference(name, model, ids, mask, new):
    """dense / rebuild: transformers' DynamicCache; attsvd: the same method through the transformers adapter."""
    if name != "attsvd":
        ref = run_generation(HFRunner(model, "dynamic"), ids, new, mask, return_logits=True)
        return ref.tokens, torch.stack(ref.logits, 1)
    cache = KVCache(make_method("attsvd", **ATTSVD), model)
    with cache.serving(model):
        o = model.generate(ids, attention_mask=mask, **cache_kw(cache), max_new_tokens=new, do_sample=False,
                           pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    return o.sequences[:, ids.shape[1]:], torch.stack(o.scores, 1)


@pytest.mark.compat
@pytest.mark.parametrize("name", list(STORES))
def test_every_store_equals_its_reference_and_moves_the_cursor_once(model, name):
    store = STORES[name]()
    assert isinstance(store, KVStore)                                   # the protocol, structurally
    eng = Engine(model, EngineConfig(**ECFG), kv=store)
    ids, mask = _batch()
    ref_tok, ref_logits = _reference(name, model, ids, mask, 10)
    out = eng.generate(ids, 10, attention_mask=mask, return_logits=True)
    assert torch.equal(out.tokens, ref_tok)
    assert rel_err(torch.stack(out.logits, 1), ref_logits) < 1e-5
    # one advance per step: prompt + 9 fed tokens; device and host counters agree
    assert eng.cursor.host == int(eng.cursor.length) == 40 + 9
    assert eng.report()["kv"] == store.name and eng.report()["kv_cache_bytes"] == store.nbytes
    # a decode step does not move the position by itself; Engine.step does, once
    before = int(eng.cursor.length)
    with torch.no_grad():
        eng.decode_body(out.tokens[:, -1], live=eng.cursor.host + 1)
    assert int(eng.cursor.length) == before


@pytest.mark.parametrize("name", ["dense", "attsvd"])
def test_compiled_step_equals_eager_for_every_capturable_store(model, name):
    ids, mask = _batch()
    eager = Engine(model, EngineConfig(**ECFG), kv=STORES[name]()).generate(ids, 8, mask, return_logits=True)
    eng = Engine(model, EngineConfig(**ECFG, graph="whole-step", compile_backend="aot_eager"), kv=STORES[name]())
    comp = eng.generate(ids, 8, mask, return_logits=True)
    assert torch.equal(comp.tokens, eager.tokens)
    assert rel_err(torch.stack(comp.logits, 1), torch.stack(eager.logits, 1)) < 1e-5
    assert comp.info["capture_s"] > 0 and eng.graphs.captured == [(2, eng.kv.shape_key())]


def test_rebuild_store_refuses_graphs(model):
    with pytest.raises(ValueError, match="eagerly"):
        Engine(model, EngineConfig(**ECFG, graph="whole-step"), kv=RebuildKV())


def test_bytes_held_per_store(model):
    """nbytes is what each store's buffers really hold (fp32, tiny-gqa: 2 layers, 2 KV heads, d = 16)."""
    L, H, D, B, S, e = 2, 2, 16, 2, 64, 4
    dense = Engine(model, EngineConfig(**ECFG)).kv
    assert dense.nbytes == 2 * L * B * H * S * D * e
    reb = Engine(model, EngineConfig(**ECFG), kv=RebuildKV()).kv
    lat = [(eng_l.qkv.latent_dim(1), eng_l.qkv.latent_dim(2)) for eng_l in Engine(model, EngineConfig(**ECFG)).layers]
    assert reb.nbytes == sum(B * S * (rk + rv) * e for rk, rv in lat) < dense.nbytes
    eng = Engine(model, EngineConfig(**ECFG), kv=STORES["attsvd"]())
    assert eng.kv.nbytes == 0                                          # nothing before the first prefill
    ids, mask = _batch()                                               # row 1: 5 pad slots, never stored
    eng.prefill(ids, mask)
    r, w, i64 = 8, 6, 8
    tiers = sum(H * e * 2 * (n_b * r + r * D + w * D) for n_b in (40 - w, 40 - 5 - w))   # per layer, both rows
    desc = 2 * (B * H + 1) * i64 + B * H * 9 * i64                                       # e_off, r_off, runs
    assert eng.kv.nbytes == L * (tiers + desc) < dense.nbytes
    fit = eng.kv.report()["fit"]
    assert fit["bytes_held"] == eng.kv.nbytes and fit["dense_bytes"] == L * H * e * 2 * (40 + 35) * D
    # allocated: + the bucket padding (fused kernel: at most 1/8 of each buffer, zeros no descriptor reaches) + room
    # for the decode (S - 40 = 24 rows, rounded up to 32)
    pad = sum(layer.pad_nbytes for layer in eng.kv.layers)
    assert 0 <= pad <= eng.kv.nbytes / 8
    assert eng.kv.allocated_nbytes == eng.kv.nbytes + pad + L * 2 * B * H * 32 * D * e
    eng.step(eng.prefill(ids, mask).argmax(-1))
    assert eng.kv.nbytes == L * (tiers + desc + 2 * B * H * D * e)                          # + one appended row


def test_kv_is_appended_in_one_place(model):
    """One decode step writes each layer's k and v exactly once (the store), never again in a kernel; with the fused
    decode layer (``runtime/kernels/layer.cpp``, where it runs) inside its call instead: on the dense store one
    decode_stack call for every layer, else one decode_layer call per layer."""
    for store, fused in ((DenseKV(), "off"), (DenseKV(), "auto"), (STORES["attsvd"](), "auto")):
        eng = Engine(model, EngineConfig(**ECFG, fused_layer=fused), kv=store)
        ids, mask = _batch()
        tok = eng.prefill(ids, mask).argmax(-1)
        with DispatchCounter() as c:
            eng.step(tok)
        if eng._stack is not None:
            assert c.counts["lowrank_lrk.decode_stack.default"] == 1, c.counts
            assert not c.counts["lowrank_lrk.decode_layer.default"] and not c.counts["aten.index_copy_.default"], c.counts
        elif eng.fused.enabled:
            assert c.counts["lowrank_lrk.decode_layer.default"] == 2 and not c.counts["aten.index_copy_.default"], c.counts
        else:
            assert c.counts["aten.index_copy_.default"] == 2 * 2, (store.name, c.counts)   # k + v, 2 layers


def test_invalidate_drops_captures_and_the_next_step_recaptures(model):
    ids, mask = _batch()
    eng = Engine(model, EngineConfig(**ECFG, graph="whole-step", compile_backend="aot_eager"))
    first = eng.generate(ids, 5, mask)
    again = eng.generate(ids, 5, mask)
    assert again.info["capture_s"] == 0.0 and eng.graphs.captured == [(2, ())]
    eng.graphs.invalidate()
    assert eng.graphs.captured == []
    third = eng.generate(ids, 5, mask)
    assert third.info["capture_s"] > 0 and torch.equal(third.tokens, first.tokens)
    one = eng.generate(ids[:1], 5)                                   # another batch size: its own capture
    assert one.info["capture_s"] > 0 and sorted(eng.graphs.captured) == [(1, ()), (2, ())]


class TraceKV(DenseKV):
    """A third-party store: the dense store plus a trace of the protocol calls (no engine change needed)."""

    name = "trace"

    def __init__(self):
        super().__init__()
        self.calls = []

    def reset(self, B, T, ids=None):
        self.calls.append(("reset", B, T, tuple(ids.shape)))

    def store_prefill(self, layer, q, k, v):
        self.calls.append(("prefill", layer, tuple(q.shape), tuple(k.shape)))
        super().store_prefill(layer, q, k, v)

    def end_prefill(self):
        self.calls.append(("end_prefill",))

    def append(self, layer, k, v, ctx):
        self.calls.append(("append", layer, int(ctx.pos)))
        super().append(layer, k, v, ctx)


def test_a_new_store_plugs_in_through_the_protocol(model):
    store = TraceKV()
    eng = Engine(model, EngineConfig(**ECFG), kv=store)
    ids, mask = _batch(T=7)
    out = eng.generate(ids, 3, mask)
    ref = Engine(model, EngineConfig(**ECFG)).generate(ids, 3, mask)
    assert torch.equal(out.tokens, ref.tokens) and eng.report()["kv"] == "trace"
    assert store.calls == [("reset", 2, 7, (2, 7)), ("prefill", 0, (2, 4, 7, 16), (2, 2, 7, 16)),
                           ("prefill", 1, (2, 4, 7, 16), (2, 2, 7, 16)), ("end_prefill",),
                           ("append", 0, 7), ("append", 1, 7), ("append", 0, 8), ("append", 1, 8)]


TRITON_CHECK = """
import torch
from lowrank_lib.runtime.attention import sdpa_decode, triton_decode
from lowrank_lib.runtime.kv import Cursor, slot_mask
B, Hkv, G, S, D = 2, 2, 3, 40, 16
c = Cursor(B, S, "cpu")
c.reset(torch.tensor([0, 5]))
c.advance(20)                                   # the token being decoded was written at slot 20
g = torch.Generator().manual_seed(0)
K, V, q = torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, S, D, generator=g), torch.randn(B, Hkv, G, D, generator=g)
ref = sdpa_decode(q, K[:, :, :21], V[:, :, :21], c, slot_mask(c, torch.arange(S), B, 21, torch.float32))
print(float((triton_decode(q, K, V, c, None) - ref).abs().max()))
"""


def test_triton_decode_kernel_reads_the_stores_slots_in_the_interpreter():
    """The graph-safe Triton kernel (run on the CPU by Triton's interpreter) attends over slots
    [pad, length] that the store wrote, as the portable sdpa path does."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", TRITON_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert float(r.stdout.strip().splitlines()[-1]) < 1e-5


def test_every_capture_compiles_apart_past_dynamos_recompile_limit(model):
    """A method store fitting 10 requests of different lengths on one compiled engine: 10 captures (dynamo's
    per-code recompile limit is 8; each capture has its own code object), each equal to eager, only the live
    capture kept."""
    ecfg = dict(max_batch=1, max_seq_len=120)
    method = lambda: MethodStore(make_method("attsvd", rank=4, window=4))
    comp = Engine(model, EngineConfig(**ecfg, graph="whole-step", compile_backend="aot_eager"), kv=method())
    eager = Engine(model, EngineConfig(**ecfg), kv=method())
    keys = set()
    for i in range(10):
        ids = torch.randint(3, 256, (1, 12 + 8 * i), generator=torch.Generator().manual_seed(i))
        a, b = eager.generate(ids, 2, return_logits=True), comp.generate(ids, 2, return_logits=True)
        assert b.info["capture_s"] > 0 and comp.kv.shape_key() not in keys
        keys.add(comp.kv.shape_key())
        assert torch.equal(a.tokens, b.tokens) and rel_err(torch.stack(b.logits), torch.stack(a.logits)) < 1e-5
        assert comp.graphs.captured == [(1, comp.kv.shape_key())]
