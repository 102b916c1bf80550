"""Compressors against what their papers guarantee (issue 31): SVD-LLM v2's truncation and allocation, ASVD's STRS."""
from __future__ import annotations

import math

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.compress import collect_stats, compress_asvd, compress_svdllm_v2
from lowrank_lib.compress.asvd import asvd_sensitivity, param_ratio, strs_ratios
from lowrank_lib.compress.common import leaf
from lowrank_lib.compress.svdllm import (truncation_loss_table, v2_allocate, v2_keep_ratios, v2_truncation_losses)
from lowrank_lib.data import random_token_batches
from lowrank_lib.factorized import account, iter_linears


@pytest.fixture(scope="module")
def gqa():
    m = models.tiny_model("tiny-gqa", seed=0)
    ids = random_token_batches(m.config.vocab_size, 4, 48, seed=1)
    return m, collect_stats(m, ids, progress=False), ids


# ------------------------------------------------------------------ SVD-LLM v2
def test_v2_truncation_reaches_the_theoretical_minimum_per_matrix(gqa):
    """v2's loss-optimised truncation is optimal for ||W X - W_r X||_F (its theorem): per matrix it reaches
    ||sigma_{r+1:}(W S)|| and is never above v1's Cholesky whitening on the same X^T X."""
    m, stats, _ = gqa
    for keep in (0.7, 0.4):
        table = truncation_loss_table(m, stats, keep)
        assert len(table) == 14
        for name, row in table.items():
            assert row["v2"] <= row["minimum"] * (1 + 1e-9) + 1e-12, (name, row)
            assert row["v2"] <= row["v1"] * (1 + 1e-9) + 1e-12, (name, row)


def test_v2_allocation_is_the_papers_formula_and_meets_the_budget():
    losses = {f"model.layers.{i}.self_attn.q_proj": L for i, L in enumerate([20.0, 50.0, 400.0, 3000.0])}
    losses.update({f"model.layers.{i}.mlp.down_proj": L for i, L in enumerate([90.0, 90.0, 90.0, 90.0])})
    keeps = v2_allocate(losses, 0.6)
    inv = [1 / math.log(v) for v in [20.0, 50.0, 400.0, 3000.0]]
    for i, x in enumerate(inv):
        assert keeps[f"model.layers.{i}.self_attn.q_proj"] == pytest.approx(1 - 4 * 0.4 * x / sum(inv))
        assert keeps[f"model.layers.{i}.mlp.down_proj"] == pytest.approx(0.6)
    # equal shapes within a type: the parameter budget of each type is exactly the uniform one
    q = [keeps[f"model.layers.{i}.self_attn.q_proj"] for i in range(4)]
    assert sum(q) / 4 == pytest.approx(0.6)
    assert q == sorted(q)       # a larger truncation loss -> fewer removed ranks


def test_v2_allocation_on_a_model_follows_the_losses_and_the_budget(gqa):
    m, stats, _ = gqa
    losses = v2_truncation_losses(m, stats, 0.6)
    keeps = v2_keep_ratios(m, stats, 0.6)
    for typ in {leaf(n) for n in losses}:
        names = sorted((n for n in losses if leaf(n) == typ), key=losses.get)
        ks = [keeps[n] for n in names]
        assert ks == sorted(ks), typ
        assert sum(ks) / len(ks) == pytest.approx(0.6, abs=1e-9), typ
    cm = compress_svdllm_v2(m, stats, 0.6, progress=False)
    dense = sum(lin.weight.numel() for _, lin in iter_linears(m))
    assert account(cm).linear_params <= 0.6 * dense * 1.02


def test_v2_losses_are_in_the_papers_token_units(gqa):
    """L^2 sums over tokens: the allocation takes the loss at the paper's 256 x 2048 tokens, whatever we calibrated on."""
    m, stats, ids = gqa
    raw = v2_truncation_losses(m, stats, 0.6, loss_tokens=None)
    paper = v2_truncation_losses(m, stats, 0.6)
    n = stats["model.layers.0.self_attn.q_proj"].tokens
    assert n == ids.numel()
    for name in raw:
        assert paper[name] == pytest.approx(raw[name] * math.sqrt(256 * 2048 / n))
    # twice the same data = twice the tokens: raw losses grow by sqrt(2), the paper-unit losses do not move
    doubled = collect_stats(m, torch.cat([ids, ids]), progress=False)
    again = v2_truncation_losses(m, doubled, 0.6)
    for name in paper:
        assert again[name] == pytest.approx(paper[name], rel=1e-6)


# ------------------------------------------------------------------ ASVD STRS
def test_strs_meets_the_target_tightly():
    sens = {"a": {0.3: 50.0, 0.6: 12.0, 0.9: 10.5}, "b": {0.3: 11.0, 0.6: 10.2, 0.9: 10.1},
            "c": {0.3: 1e9, 0.6: 400.0, 0.9: 30.0}}
    numels = {"a": 100, "b": 300, "c": 100}
    for target in (0.95, 0.8, 0.7, 0.5, 0.45):
        r = strs_ratios(sens, numels, target)
        assert param_ratio(r, numels) <= target + 1e-12
        # tight: the next less-compressed threshold (one entry fewer allowed) misses the target
        entries = sorted(((n, p, v) for n, d in sens.items() for p, v in d.items()), key=lambda e: -e[2])
        allowed = [e for e in entries if r[e[0]] <= e[1]]
        i = len(entries) - len(allowed)
        fewer = {n: 1.0 for n in sens}
        for n, p, _ in entries[i + 1:]:
            fewer[n] = min(fewer[n], p)
        assert param_ratio(fewer, numels) > target
    assert strs_ratios(sens, numels, 0.8)["c"] == 1.0      # the sensitive one stays dense


def test_asvd_sensitivity_is_the_full_forward_perplexity(gqa, tmp_path):
    """The cached-prefix sensitivity equals a full forward of the model with only that Linear truncated."""
    m, stats, ids = gqa
    calib = ids[:2, :32]
    sens = asvd_sensitivity(m, stats, calib, candidates=(0.3, 0.9), cache_dir=tmp_path, progress=False)
    for name in ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj"):
        cm = compress_asvd(m, stats, 0.5, ratios={name: 0.3}, progress=False)
        with torch.no_grad():
            lg = cm(calib).logits
        nll = torch.nn.functional.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]), calib[:, 1:].reshape(-1))
        assert sens[name][0.3] == pytest.approx(float(torch.exp(nll)), rel=1e-5)
    # cached: a second call reads the file; other calibration tokens are another entry
    assert len(list(tmp_path.glob("*.json"))) == 1
    assert asvd_sensitivity(m, stats, calib, candidates=(0.3, 0.9), cache_dir=tmp_path, progress=False) == sens
    asvd_sensitivity(m, stats, ids[2:4, :32], candidates=(0.3, 0.9), cache_dir=tmp_path, progress=False)
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_asvd_strs_beats_uniform_on_calibration_loss(gqa, tmp_path):
    m, stats, ids = gqa
    calib = ids[:2, :32]

    def ppl(model):
        with torch.no_grad():
            lg = model(calib).logits
        return float(torch.exp(torch.nn.functional.cross_entropy(lg[:, :-1].reshape(-1, lg.shape[-1]),
                                                                 calib[:, 1:].reshape(-1))))

    sens = asvd_sensitivity(m, stats, calib, candidates=(0.2, 0.4, 0.6, 0.8), cache_dir=tmp_path, progress=False)
    dense = sum(lin.weight.numel() for _, lin in iter_linears(m))
    for keep in (0.8, 0.6):
        strs = compress_asvd(m, stats, keep, sensitivity=sens, progress=False)
        uni = compress_asvd(m, stats, keep, search="uniform", progress=False)
        assert account(strs).linear_params <= keep * dense
        assert ppl(strs) < ppl(uni)
