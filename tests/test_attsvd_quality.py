"""kv-quality protocol on a tiny model: dense scores KL 0 against itself, full rank ~0, KL grows as the
budget shrinks, attention-aware beats raw SVD on average, stream memory stays bounded."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import models
from lowrank_lib.eval.kv_sweep import sweep_method, table, targets
from lowrank_lib.eval.kvquality import continuation_quality


def test_continuation_quality_protocol():
    model = models.tiny_model("tiny-gqa", seed=0).eval()
    windows = torch.randint(0, 256, (3, 128))
    # window 4, stream chunk 24 (a block, l r + r d, must cost less than l d); budget 1.3 holds every token exactly (AttSVD at rank d holds S + d rows)
    specs = {f"{m}@{b:g}": sweep_method(m, b, 4, 24) for m in ("dense", "attsvd", "attsvd-stream", "svd", "h2o")
             for b in (1.3, 0.5, 0.25)}
    res = continuation_quality(model, windows, 64, specs, step=8, progress=False)
    assert res["dense@1.3"].kl < 1e-7 and res["dense@1.3"].ppl == pytest.approx(res["dense@1.3"].ppl_dense)
    assert res["attsvd@1.3"].kl < 1e-6 and res["h2o@1.3"].kl < 1e-7      # fp32 round-off of the tiered reads
    for m in ("attsvd", "svd", "h2o"):
        assert res[f"{m}@0.25"].kl > res[f"{m}@0.5"].kl > res[f"{m}@1.3"].kl - 1e-9
        assert len(res[f"{m}@0.5"].window_kl) == 3 and res[f"{m}@0.5"].tokens == 3 * 63
        assert res[f"{m}@0.5"].memory_ratio <= 0.5 + 0.01 and res[f"{m}@0.25"].memory_ratio <= 0.25 + 0.01
    # stream keeps the cache bounded: it ends smaller than accumulate after 63 continuation tokens
    assert res["attsvd-stream@0.5"].memory_ratio_end < res["attsvd@0.5"].memory_ratio_end
    # budget 0.5 at S = 64, w = 4, d = 16: the largest rank whose Eq. 6 bytes fit is 5 (152 r + 128 <= 32 * 32)
    assert res["attsvd@0.5"].memory["rank_k"] == [5, 5] and res["attsvd@0.5"].memory["r_over_d"] == 5 / 16
    q = {k: v.to_dict() for k, v in res.items()}
    t = targets(q, None, 0.5)
    assert t["kl_ratio_svd_over_attsvd"] == pytest.approx(q["svd@0.5"]["kl"] / q["attsvd@0.5"]["kl"])
    assert t["best_eviction"] == "h2o"
    assert "attsvd" in table({"quality": {"64": q}, "args": {"windows": 3, "cont": 32}, "targets": {"64": t}})


def test_caches_continued_together_equal_each_alone():
    """continuation_quality continues a window's caches in one batched forward (kvquality.StackedCache): every
    cache's numbers equal those of continuing it alone (batch=1), stream mode's reshaping appends included."""
    model = models.tiny_model("tiny-gqa", seed=0).eval()
    windows = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(3))
    specs = {f"{m}@{b:g}": sweep_method(m, b, 4, 24) for m in ("dense", "attsvd", "attsvd-stream", "svd", "h2o")
             for b in (0.5, 0.25)}
    alone = continuation_quality(model, windows, 48, specs, step=8, progress=False, batch=1)
    for batch in (None, 3):                                  # every cache in one forward; groups of 3
        together = continuation_quality(model, windows, 48, specs, step=8, progress=False, batch=batch)
        for k, a in alone.items():
            t = together[k]
            assert t.window_kl == pytest.approx(a.window_kl, rel=1e-4, abs=1e-7), k
            assert t.window_nll == pytest.approx(a.window_nll, rel=1e-6), k
            assert (t.memory_ratio, t.memory_ratio_end, t.memory, t.attention_calls) == \
                   (a.memory_ratio, a.memory_ratio_end, a.memory, a.attention_calls), k
