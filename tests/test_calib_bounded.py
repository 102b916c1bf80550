"""Calibration in bounded memory: statistics gathered one decoder layer at a time (equal, bit for bit, to hooks on a
whole-model forward), spilled to memory-mapped files, and the compressors' derived matrices kept in a byte budget
(the same factors when every entry is dropped and made again)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from lowrank_lib import models
from lowrank_lib.compress import (collect_stats, compress_dobi, compress_palu, compress_svdllm, compress_svdllm_v2)
from lowrank_lib.compress import calib as calib_mod
from lowrank_lib.compress import common
from lowrank_lib.compress.common import BoundedCache
from lowrank_lib.compress.svdllm import truncation_loss_table
from lowrank_lib.compress.whitened import WhitenedSpectra
from lowrank_lib.data import random_token_batches
from lowrank_lib.factorized import iter_linears
from mapped import mapping_name


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LOWRANK_LIB_CACHE", str(tmp_path))          # spills go under the model cache: this one


@pytest.fixture(scope="module")
def gqa():
    return models.tiny_model("tiny-gqa", seed=0)


@torch.no_grad()
def _oracle(m, ids, batch_size):
    """Every target's (X^T X, sum of per-sample mean |x|, tokens) from hooks on the whole model's forward."""
    acc = {}

    def hook(name):
        def f(mod, inp, out):
            x = inp[0]
            xs = x.reshape(-1, x.shape[-1]).float()
            a = acc.setdefault(name, [torch.zeros(xs.shape[1], xs.shape[1], dtype=torch.float64),
                                      torch.zeros(xs.shape[1], dtype=torch.float64), 0])
            a[0] += (xs.T @ xs).double()
            a[1] += x.abs().double().mean(dim=1).sum(0)
            a[2] += xs.shape[0]
        return f

    hs = [mod.register_forward_hook(hook(n)) for n, mod in iter_linears(m)]
    for i in range(0, ids.shape[0], batch_size):
        m(ids[i:i + batch_size], use_cache=False)
    for h in hs:
        h.remove()
    return acc


@pytest.mark.parametrize("spill", [False, True])
def test_layer_by_layer_statistics_equal_the_whole_forward(gqa, spill):
    ids = random_token_batches(256, 5, 40, seed=3)          # batches of 2, 2, 1: two shapes of layer arguments
    want = _oracle(gqa, ids, 2)
    got = collect_stats(gqa, ids, batch_size=2, progress=False, spill=spill)
    for name, (xtx, am, tokens) in want.items():
        st = got[name]
        assert torch.equal(st.xtx, xtx), name
        assert torch.equal(st.abs_mean, am), name
        assert st.tokens == tokens == 200 and st.samples == 5
    # shared inputs are one statistic: k / v read q's, up reads gate's
    assert got["model.layers.0.self_attn.k_proj"] is got["model.layers.0.self_attn.q_proj"]
    assert got["model.layers.1.mlp.up_proj"] is got["model.layers.1.mlp.gate_proj"]


def test_spilled_statistics_are_file_mappings_not_anonymous_memory(gqa, tmp_path, monkeypatch):
    seen = []
    real = calib_mod._spill

    def spy(acc, owners, path):
        real(acc, owners, path)
        seen.append([acc[o].xtx for o in owners])
    monkeypatch.setattr(calib_mod, "_spill", spy)
    st = collect_stats(gqa, random_token_batches(256, 2, 16, seed=1), progress=False, spill=True)
    assert len(seen) == gqa.config.num_hidden_layers and all(len(s) == 4 for s in seen)   # q, o, gate, down
    for layer in seen:
        for t in layer:
            # a mapping of the spill file, unlinked at once: "<cache>/calib_spill/stats-*/layer<i>.pt (deleted)"
            name = mapping_name(t)
            assert name and name.startswith(str(tmp_path / "calib_spill")) and name.endswith(" (deleted)"), name
    assert list((tmp_path / "calib_spill").iterdir()) == []          # nothing left on disk; the mappings stay valid
    assert float(st["model.layers.0.mlp.down_proj"].xtx.diagonal().min()) >= 0


def test_spill_is_chosen_by_the_memory_available(gqa, monkeypatch):
    made = []
    monkeypatch.setattr(calib_mod, "available_memory", lambda: 1 << 10)     # 1 KB: the stats cannot fit
    real = calib_mod._spill
    monkeypatch.setattr(calib_mod, "_spill", lambda *a: (made.append(a[2]), real(*a)))
    collect_stats(gqa, random_token_batches(256, 1, 8), progress=False)
    assert len(made) == gqa.config.num_hidden_layers
    made.clear()
    monkeypatch.setattr(calib_mod, "available_memory", lambda: 1 << 40)
    collect_stats(gqa, random_token_batches(256, 1, 8), progress=False)
    assert made == []


def test_models_without_decoder_layers_are_refused_clearly():
    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj = nn.Linear(4, 4)

        def forward(self, ids, use_cache=False):
            return self.q_proj(ids.float())
    with pytest.raises(ValueError, match="decoder layers"):
        collect_stats(Flat(), torch.zeros(1, 4, dtype=torch.long), progress=False)


def test_bounded_cache_drops_the_least_recently_used_past_its_budget():
    c = BoundedCache(budget=3 * 400)                        # three 10 x 10 float32 matrices
    make = {k: (lambda k=k: torch.full((10, 10), float(k))) for k in range(5)}
    for k in range(3):
        c.get(k, make[k])
    assert len(c) == 3 and c.bytes == 1200 and c.made == 3
    c.get(0, make[0])                                       # a hit: 0 becomes the most recent
    assert c.made == 3
    c.get(3, make[3])                                       # evicts 1, the least recently used
    assert 1 not in c and 0 in c and 2 in c and 3 in c and c.bytes == 1200
    assert float(c.get(1, make[1])[0, 0]) == 1.0 and c.made == 5
    big = BoundedCache(budget=10)
    big.put("x", (torch.zeros(100), torch.zeros(3)))        # one entry over the budget is still held
    assert len(big) == 1 and big.bytes == 412


def test_compressors_give_the_same_factors_when_nothing_fits(gqa, monkeypatch):
    stats = collect_stats(gqa, random_token_batches(256, 4, 64, seed=1), progress=False)
    runs = {
        "svdllm": lambda: compress_svdllm(gqa, stats, 0.6, progress=False),
        "svdllm_v2": lambda: compress_svdllm_v2(gqa, stats, 0.6, progress=False),
        "dobi": lambda: compress_dobi(gqa, stats, 0.6, progress=False),
        "palu": lambda: compress_palu(gqa, stats, 0.5, head_group_size=1, align=1, progress=False),
        "whitened": lambda: WhitenedSpectra(gqa, stats, progress=False).compress(gqa, 0.6),
    }
    roomy = {k: dict(f().named_parameters()) for k, f in runs.items()}
    table = truncation_loss_table(gqa, stats, 0.6)
    counts = []
    real_init = BoundedCache.__init__

    def tiny(self, budget=None):
        real_init(self, budget=1)                          # every entry but the newest is dropped at once
        counts.append(self)
    monkeypatch.setattr(BoundedCache, "__init__", tiny)
    for k, f in runs.items():
        tight = dict(f().named_parameters())
        assert tight.keys() == roomy[k].keys()
        for n, p in tight.items():
            assert torch.equal(p, roomy[k][n]), (k, n)
    assert truncation_loss_table(gqa, stats, 0.6) == table
    # v2 takes X^T X's roots once in its allocation, then again in its factors' pass once they were dropped
    assert any(c.made > len({id(stats[n]) for n, _ in iter_linears(gqa)}) for c in counts)
    assert common.available_memory() > 0


def test_compressors_copy_what_they_keep_and_leave_the_dense_model_alone(gqa):
    from lowrank_lib.compress import compress_asvd, compress_basis_sharing
    from lowrank_lib.factorized import LowRankLinear

    stats = collect_stats(gqa, random_token_batches(256, 2, 32, seed=2), progress=False)
    before = {n: p.clone() for n, p in gqa.named_parameters()}
    for cm in (compress_svdllm(gqa, stats, 0.6, progress=False),
               compress_basis_sharing(gqa, stats, 0.6, progress=False), compress_asvd(gqa, stats, 0.6, progress=False)):
        assert not any(isinstance(m, LowRankLinear) for m in gqa.modules())
        emb, mine = cm.model.embed_tokens.weight, gqa.model.embed_tokens.weight
        assert torch.equal(emb, mine) and emb.data_ptr() != mine.data_ptr()       # copied, not shared
        norm = cm.model.layers[0].input_layernorm.weight
        assert norm.data_ptr() != gqa.model.layers[0].input_layernorm.weight.data_ptr()
        assert all(0 not in p.stride() for p in cm.parameters())             # no placeholder (stride 0) left
    assert all(torch.equal(p, before[n]) for n, p in gqa.named_parameters())
