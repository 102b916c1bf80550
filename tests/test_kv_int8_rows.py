"""The composed cache's control (``kvzip-int8``: KVzip's ranking, every kept row in int8, no low-rank tier): it
holds the composed cache's bytes (within one of its rows), really as int8, and keeps KVzip's ranking."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.kv import make_method
from lowrank_lib.kv.hf_adapter import KVCache, record
from lowrank_lib.kv.methods.int8_rows import Int8RowsLayer
from lowrank_lib.kv.tiers import descriptor_nbytes, quantize_rows

S = 300


@pytest.fixture(scope="module")
def setup():
    model = models.tiny_model("tiny-gqa", seed=0).eval()
    ids = torch.randint(3, 256, (1, S), generator=torch.Generator().manual_seed(1))
    return model, record(model, ids)


def row_bytes(rec) -> int:
    """One kept token of one KV head in the control: int8 key and value rows, a fp16 scale each, an int16 position."""
    return 2 * rec.keys[0].shape[-1] + 2 * 2 + 2


@pytest.mark.parametrize("budget", [0.25, 0.125, 0.0625])
def test_control_holds_the_composed_cache_bytes_within_one_row(setup, budget):
    model, rec = setup
    comp = KVCache.from_prefill(make_method("composed-kvzip-q8", budget), rec, model).describe()
    ctrl = KVCache.from_prefill(make_method("kvzip-int8", budget), rec, model).describe()
    cap = budget * ctrl["dense_bytes"]
    assert comp["bytes_held"] <= cap and comp["tokens_lowrank"] > 0
    assert cap - row_bytes(rec) < ctrl["bytes_held"] <= cap
    assert ctrl["bytes_held"] >= comp["bytes_held"] - row_bytes(rec)
    assert ctrl["tokens_lowrank"] == 0 and ctrl["exact_rows"] == "int8"


def test_a_budget_above_every_int8_row_keeps_every_token_and_holds_less(setup):
    model, rec = setup
    ctrl = KVCache.from_prefill(make_method("kvzip-int8", 0.5), rec, model)
    d = ctrl.describe()
    L, H = len(rec.keys), rec.keys[0].shape[1]
    assert d["tokens_exact"] == L * H * S
    assert d["bytes_held"] == L * (H * S * row_bytes(rec) + descriptor_nbytes(H, 0)) < 0.5 * d["dense_bytes"]


def test_rows_are_held_as_int8_and_follow_kvzips_ranking(setup):
    model, rec = setup
    ctrl = KVCache.from_prefill(make_method("kvzip-int8", 0.125), rec, model)
    comp = KVCache.from_prefill(make_method("composed-kvzip-q8", 0.125), rec, model)
    for i, (layer, ref) in enumerate(zip(ctrl.states, comp.states)):
        assert isinstance(layer, Int8RowsLayer)
        held = layer._stored()
        assert not any(t.dtype.is_floating_point and t.dim() == 2 for t in held)      # no float row is stored
        assert layer.__dict__["k_q"].dtype == torch.int8 == layer.__dict__["v_q"].dtype
        for h in range(layer.H):
            lo, hi = layer.host_e_off[h], layer.host_e_off[h + 1]
            pos = layer.pos_exact[lo:hi].long()
            q, s = quantize_rows(rec.keys[i][0, h][pos], torch.float16)
            torch.testing.assert_close(layer.k_exact[lo:hi], q.float() * s.float()[:, None])
            # the composed cache's exact tier is KVzip's top of the same ranking: a subset of what the control keeps
            rlo, rhi = ref.host_e_off[h], ref.host_e_off[h + 1]
            assert set(ref.pos_exact[rlo:rhi].tolist()) <= set(pos.tolist())
