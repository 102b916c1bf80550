"""eval.kv_claims: notebook 05's claims computed from per-window results (exact point, paired verdicts, losses)."""
import pytest
import torch

from lowrank_lib import models
from lowrank_lib.eval.kv_claims import budget_claims, energy_claims, exact_method, failed_targets, frontier_pairs
from lowrank_lib.geometry import geometry
from lowrank_lib.kv import make_method
from lowrank_lib.kv.hf_adapter import KVCache, record

S = 80


def res_of(kl: dict) -> dict:
    """Results keyed like continuation_quality's: name -> per-window KL, or (per-window KL, memory ratio)."""
    out = {}
    for k, v in kl.items():
        vals, mem = v if isinstance(v, tuple) else (v, 0.5)
        out[k] = {"kl": sum(vals) / len(vals), "window_kl": vals, "memory_ratio": mem}
    return out


@pytest.mark.parametrize("name", ["h2o", "streamingllm", "kvzip", "attsvd", "svd", "attsvd-ext"])
def test_the_exact_point_holds_every_prompt_row_and_no_more(name):
    model = models.tiny_model("tiny-gqa", seed=0).eval()
    ids = torch.randint(3, 256, (1, S), generator=torch.Generator().manual_seed(0))
    rec = record(model, ids)
    g = geometry(model)
    m = exact_method(name, g, torch.float32, S, window=4, chunk=8)
    d = KVCache.from_prefill(m, rec, model).describe()
    assert d["tokens_exact"] + d["tokens_lowrank"] == g.n_layers * g.n_kv_heads * S
    if m.kind == "eviction":
        assert d["tokens_lowrank"] == 0 and d["bytes_held"] <= m.budget * d["dense_bytes"]
        tighter = make_method(name, m.budget - 1.0 / d["dense_bytes"], window=4)   # one byte less drops a row
        assert KVCache.from_prefill(tighter, rec, model).describe()["tokens_exact"] < d["tokens_exact"]
    else:
        assert m.rank == g.head_dim
    with pytest.raises(ValueError, match="composed"):
        exact_method("composed-kvzip-q8", g, torch.float32, S, 4, 8)


def test_budget_claims_name_the_eviction_policy_that_beats_attsvd_and_noise_stays_noise():
    base = [0.30, 0.35, 0.28, 0.40, 0.33, 0.31]
    res = res_of({"attsvd@0.25": base, "svd@0.25": [x * 1.3 for x in base],
                  "h2o@0.25": [x * 0.4 for x in base],                                       # consistently lower
                  "snapkv@0.25": [x * f for x, f in zip(base, [0.5, 1.6, 0.6, 1.5, 0.7, 1.4])]})  # no consistent sign
    c = budget_claims(res, "0.25", ["attsvd", "svd"], ["h2o", "snapkv", "keydiff"])
    assert c["best"] == "h2o" and c["best_lowrank"] == "attsvd" and c["best_eviction"] == "h2o"
    assert c["lowrank_vs_eviction"].verdict == "b better"
    assert c["vs_attsvd"]["h2o"].better == "h2o@0.25"
    assert c["vs_attsvd"]["snapkv"].verdict == "within noise"
    assert "keydiff" not in c["vs_attsvd"]


def test_energy_rule_is_dominated_only_by_a_fixed_rank_holding_no_more_bytes():
    e = [0.6, 0.7, 0.5, 0.65]
    res = res_of({"energy@x": (e, 0.42), "fixed@small": ([x * 0.5 for x in e], 0.25),
                  "fixed@big": ([x * 0.1 for x in e], 0.50), "fixed@same": ([x * 1.5 for x in e], 0.42)})
    c = energy_claims(res, "energy@x", ["fixed@small", "fixed@big", "fixed@same"])
    assert c["dominated_by"] == ["fixed@small"]
    assert set(c["comparisons"]) == {"fixed@small", "fixed@same"}          # fixed@big holds more bytes
    assert c["comparisons"]["fixed@same"].verdict == "b better"


def test_failed_targets_and_frontier_pairs_use_the_data():
    assert failed_targets({"pass_a": True, "pass_b": False, "kl": 0.0, "pass_c": False}) == ["pass_b", "pass_c"]
    row = lambda pol, ids, kl: {"prefill": 64, "budget": 0.5, "policy": pol, "window_ids": ids, "window_kl": kl}
    fr = {"rows": [row("ours", [0, 1, 2, 3], [0.1, 0.2, 0.3, 0.4]), row("ev", [3, 2, 1, 0], [0.8, 0.6, 0.4, 0.2])],
          "best": [{"prefill": 64, "budget": 0.5, "best_ours": "ours", "best_eviction": "ev"}]}
    (p,) = frontier_pairs(fr, [64])
    # aligned by window id: ours is half of eviction on every window (a misaligned pairing would not be)
    assert p["paired"].a_lower == 4 and p["paired"].mean_diff == pytest.approx(-0.6931, abs=1e-3)
    assert frontier_pairs(fr, [128]) == []
