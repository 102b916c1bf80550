"""``python -m lowrank_lib.bench kv-frontier --quick`` end to end on a tiny model: the JSON schema the issue
asks for, every kind of cache, bytes within budget, the target summary, and sharded runs merging exactly."""
from __future__ import annotations

import json

import pytest

from lowrank_lib.bench.cli import COMMANDS, main
from lowrank_lib.eval.kv_sweep import FRONTIER_COMPOSED, FRONTIER_EVICTION, FRONTIER_LOWRANK
from lowrank_lib.kv.methods.attsvd import rank_for_budget

FIELDS = {"policy", "kind", "prefill", "budget", "bytes_ratio", "kl_mean", "kl_std", "ppl", "ppl_dense", "windows"}
ARGS = ["kv-frontier", "--quick", "--windows", "2", "--budget", "0.5", "0.25"]


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    out = tmp_path_factory.mktemp("frontier")
    assert main([*ARGS, "--out", str(out)]) == 0
    return out, json.loads((out / "kv_frontier.json").read_text())


def test_frontier_rows_cover_every_policy_and_budget(full):
    out, res = full
    assert "kv-frontier" in COMMANDS
    rows = res["rows"]
    assert all(FIELDS <= set(r) for r in rows)
    names = {(r["policy"], r["kind"]) for r in rows}
    assert names == ({(p, "eviction") for p in FRONTIER_EVICTION} | {(p, "lowrank") for p in FRONTIER_LOWRANK}
                     | {(p, "composed") for p in FRONTIER_COMPOSED})
    assert {(r["budget"], r["windows"], r["prefill"]) for r in rows} == {(0.5, 2, 128), (0.25, 2, 128)}
    for r in rows:
        assert r["kl_mean"] >= 0 and r["ppl"] > 1 and r["ppl_dense"] > 1
        if r["budget"] == 0.5:       # tiny prompts: forced windows and the rank-1 floor may exceed 0.25; the
            assert r["bytes_ratio"] <= r["budget"] * 1.02, r    # segment descriptors are ~1 % of 128 tokens' bytes
    assert {(b["prefill"], b["budget"]) for b in res["best"]} == {(128, 0.5), (128, 0.25)}
    assert (out / "kv_frontier.txt").read_text().count("target") == 2


def test_sharded_runs_merge_to_the_full_run(full, tmp_path):
    _, res = full
    for k in (0, 1):
        assert main([*ARGS, "--shard", f"{k}/2", "--out", str(tmp_path)]) == 0
    shards = [str(tmp_path / f"kv_frontier_shard{k}of2.json") for k in (0, 1)]
    assert main(["kv-frontier", "--merge", *shards, "--out", str(tmp_path)]) == 0
    merged = json.loads((tmp_path / "kv_frontier.json").read_text())
    key = lambda r: (r["policy"], r["budget"])
    a, b = sorted(res["rows"], key=key), sorted(merged["rows"], key=key)
    assert [key(r) for r in a] == [key(r) for r in b]
    for x, y in zip(a, b):
        assert x["kl_mean"] == pytest.approx(y["kl_mean"], rel=1e-6) and x["windows"] == y["windows"] == 2
    with pytest.raises(ValueError, match="two shards"):
        main(["kv-frontier", "--merge", shards[0], shards[0], "--out", str(tmp_path)])


def test_windows_as_sweep_tasks_equal_the_single_run(full, tmp_path):
    """--parts 2 (the executor: serial here; Ray with --executor ray) merges to the one-task result."""
    _, res = full
    assert main([*ARGS, "--parts", "2", "--out", str(tmp_path)]) == 0
    split = json.loads((tmp_path / "kv_frontier.json").read_text())
    assert split["parts"] == 2
    key = lambda r: (r["policy"], r["budget"])
    a, b = sorted(res["rows"], key=key), sorted(split["rows"], key=key)
    assert [key(r) for r in a] == [key(r) for r in b]
    for x, y in zip(a, b):
        assert x["kl_mean"] == pytest.approx(y["kl_mean"], rel=1e-6) and y["windows"] == 2


def test_attsvd_rank_fits_the_bytes():
    # Eq. 6 bytes / dense = (2r (2016 + 64) + 2 * 32 * 64) / (2 * 64 * 2048) <= 0.25  <=>  r <= 14.77
    assert rank_for_budget(0.25, 2048, 64, 32) == 14
    assert rank_for_budget(0.5, 2048, 64, 32) == 30
    assert rank_for_budget(0.001, 2048, 64, 32) == 1         # never below rank 1
