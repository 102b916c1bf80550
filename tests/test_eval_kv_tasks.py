"""RULER-style tasks with the question left uncompressed (kvpress's protocol, ``eval.kv_tasks``): the split
samples, the protocol's exactness against plain full-prompt greedy decoding, question-agnostic scoring
(the scorers see only the context), and ``bench kv-tasks --quick`` writing its schema."""
from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache

from lowrank_lib.compat import cache_kw
from lowrank_lib.eval import kv_tasks
from lowrank_lib.eval.kv_tasks import (DEFAULT_POLICIES, build_task_samples, check_policies, evaluate_tasks,
                                       target_tokens)
from lowrank_lib.kv import METHODS
from lowrank_lib.eval.longctx import ByteTokenizer, Sample, stop_ids, greedy_decode, sample_ids

TOK = ByteTokenizer()


@pytest.fixture(scope="module")
def samples():
    return build_task_samples(TOK, lengths=(384,), n_per=1, seed=0, max_positions=512, max_new=8)


def test_samples_split_context_and_question(samples):
    assert [s.task for _, s in samples] == list(kv_tasks.TASKS)
    for L, s in samples:
        assert s.prompt == s.context + s.question and s.question.startswith("\n")
        assert all(a in s.context for a in s.answers)                 # the needles are in the context ...
        assert not any(a in s.question for a in s.answers)            # ... and the question does not leak them
        ctx, q = sample_ids(TOK, s)
        assert s.n_tokens == ctx.shape[1] + q.shape[1] and s.n_tokens + 8 <= 512
    with pytest.raises(ValueError, match="context \\+ question"):
        Sample("passkey", "ab", ["1"], context="a", question="c")


def test_target_tokens_keep_prompt_and_answer_in_the_context():
    assert target_tokens(4096, 8192, 24) == 4096
    t = target_tokens(8192, 8192, 24)
    assert t + max(8, 8192 // 50) + 24 <= 8192 and t > 7900
    assert target_tokens(8192, None, 24) == 8192


@pytest.mark.smollm2
def test_question_tokens_are_the_tail_of_the_full_prompt(smollm2):
    """With SmolLM2's BPE the separately tokenised question equals the tail of the full prompt's tokenisation."""
    _, tok = smollm2
    for L, s in build_task_samples(tok, lengths=(512,), n_per=1, seed=1):
        ctx, q = sample_ids(tok, s)
        full = tok(s.prompt, add_special_tokens=False).input_ids
        assert full[-q.shape[1]:] == q[0].tolist()
        assert full == ctx[0].tolist() + q[0].tolist()


def _plain_greedy(model, ids, max_new, stop):
    """Greedy decoding of the whole prompt with a plain DynamicCache (the reference)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        logits = model(ids, **cache_kw(cache)).logits[:, -1]
        return greedy_decode(model, cache, logits, max_new, stop)


def test_budget_one_equals_plain_full_prompt_decoding(tiny_gqa, samples):
    """At budget 1.3 every policy (eviction keeps every row, low-rank at full rank: S + d rows' bytes, composed all
    exact) answers with exactly the tokens of plain greedy decoding of context + question; so does dense."""
    model = tiny_gqa.eval()
    res = evaluate_tasks(model, TOK, samples, budgets=[1.3], policies=DEFAULT_POLICIES, max_new=8, progress=False)
    stop = stop_ids(TOK)
    refs = [_plain_greedy(model, torch.cat(sample_ids(TOK, s), 1), 8, stop) for _, s in samples]
    assert len(res["per_sample"]) == len(samples) * len(DEFAULT_POLICIES)
    for r in res["per_sample"]:
        assert r["tokens"] == refs[r["sample"]], (r["policy"], r["task"])
        assert r["same_as_dense"] == 1.0
    assert {r["policy"] for r in res["rows"]} == set(DEFAULT_POLICIES)


def test_compression_changes_answers(tiny_gqa, samples):
    """The comparison is not vacuous: at budget 0.05 some policy answers differently from dense."""
    res = evaluate_tasks(tiny_gqa.eval(), TOK, samples[:2], budgets=[0.05], policies=["dense", "streamingllm", "kvzip"],
                         max_new=8, progress=False)
    assert any(r["same_as_dense"] == 0.0 for r in res["per_sample"])


def test_scorers_see_only_the_context(tiny_gqa, samples, monkeypatch):
    """KVzip reconstructs the context ids alone; SnapKV's observation window ends at the context's last query."""
    from lowrank_lib.eviction import SCORERS

    seen = {"kvzip": [], "snapkv": []}
    kvzip, snap = SCORERS["kvzip"], SCORERS["snapkv"]
    orig_ctx, orig_snap = kvzip.score_prefill, snap.score

    def spy_ctx(self, prefill):
        seen["kvzip"].append((prefill.ids.clone(), prefill.length))
        return orig_ctx(self, prefill)

    def spy_snap(self, K, V, obs):
        seen["snapkv"].append((K.shape[-2], int(obs.q_pos.max())))
        return orig_snap(self, K, V, obs)

    monkeypatch.setattr(kvzip, "score_prefill", spy_ctx)
    monkeypatch.setattr(snap, "score", spy_snap)
    _, s = samples[0]
    res = evaluate_tasks(tiny_gqa.eval(), TOK, [samples[0]], budgets=[0.5],
                         policies=["dense", "kvzip", "snapkv", "composed-kvzip-q8"], max_new=4, progress=False)
    ctx, q = sample_ids(TOK, s)
    assert len(seen["kvzip"]) == 1                          # scored once, shared by kvzip and composed-kvzip-q8
    ids, n = seen["kvzip"][0]
    assert torch.equal(ids.cpu(), ctx) and n == ctx.shape[1] < s.n_tokens
    assert seen["snapkv"] and all(S == ctx.shape[1] and last == S - 1 for S, last in seen["snapkv"])
    assert {r["n_question"] for r in res["per_sample"]} == {q.shape[1]}


def test_unknown_policy_is_refused():
    assert check_policies(["kvzip", "dense"]) == ["dense", "kvzip"]
    with pytest.raises(ValueError, match="unknown policies"):
        check_policies(["dense", "pyramidkv"])
    assert set(DEFAULT_POLICIES) <= set(METHODS)


def test_the_engine_adapter_answers_as_the_transformers_adapter(tiny_gqa, samples):
    """Served by the runtime engine (the context prefilled and fitted inside it, KVzip's reconstruction run by the
    engine, the question as decode steps), every policy answers with the transformers adapter's tokens."""
    pols = ["dense", "kvzip", "snapkv", "attsvd-ext", "composed-kvzip-q8"]
    kw = dict(budgets=[0.5, 0.25], policies=pols, max_new=6, progress=False)
    hf = evaluate_tasks(tiny_gqa.eval(), TOK, samples[:2], **kw)
    en = evaluate_tasks(tiny_gqa.eval(), TOK, samples[:2], adapter="engine", **kw)
    key = lambda r: (r["sample"], r["policy"], r["budget"])
    assert [key(r) for r in hf["per_sample"]] == [key(r) for r in en["per_sample"]]
    for a, b in zip(hf["per_sample"], en["per_sample"]):
        assert a["tokens"] == b["tokens"], key(a)
        assert a["bytes_ratio"] == pytest.approx(b["bytes_ratio"], rel=1e-12)


def test_quick_command_writes_the_schema(tmp_path):
    from lowrank_lib.bench.cli import COMMANDS, main

    assert "kv-tasks" in COMMANDS
    pols = ["dense", "kvzip", "snapkv", "attsvd-ext", "composed-kvzip-q8"]
    assert main(["kv-tasks", "--quick", "--prompt-len", "384", "--budget", "0.5", "0.25", "--policies", *pols,
                 "--tasks", "needle_single", "variable_tracking", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "kv_tasks_tiny-gqa_L384_n1.json").read_text())
    fields = {"policy", "kind", "length", "budget", "bytes_ratio", "task", "exact", "partial", "n"}
    assert all(fields <= set(r) for r in res["rows"])
    keys = {(r["policy"], r["budget"], r["task"]) for r in res["rows"]}
    tasks = ("needle_single", "variable_tracking")
    assert keys == {("dense", 1.0, t) for t in tasks} | {(p, b, t) for p in pols[1:] for b in (0.5, 0.25) for t in tasks}
    for r in res["rows"]:
        assert r["length"] == 384 and r["n"] == 1 and 0 <= r["exact"] <= r["partial"] <= 1
        assert r["bytes_ratio"] <= r["budget"] * 1.01, r           # + the segment descriptors (tiny prompts)
    assert len(res["per_sample"]) == 2 * (1 + 4 * 2) and all("output" in r for r in res["per_sample"])
    assert res["command"].startswith("python -m lowrank_lib.bench kv-tasks --quick")
    assert "budget 0.25" in (tmp_path / "kv_tasks_tiny-gqa_L384_n1.txt").read_text()


def test_merge_tasks_counts_every_sample_once_and_refuses_a_sample_twice():
    import pytest

    from lowrank_lib.eval.kv_tasks import merge_tasks

    def rec(sample, task, answers, policy, exact):
        return dict(sample=sample, task=task, length=4096, n_tokens=4100 + sample, n_context=4080, n_question=20,
                    policy=policy, kind="dense" if policy == "dense" else "eviction",
                    budget=1.0 if policy == "dense" else 0.5, bytes_ratio=1.0 if policy == "dense" else 0.5,
                    exact=exact, partial=exact, same_as_dense=1.0, output="", tokens=[], answers=answers)

    a = {"per_sample": [rec(0, "needle_single", ["111"], "dense", 1.0), rec(0, "needle_single", ["111"], "kvzip", 1.0)]}
    b = {"per_sample": [rec(0, "needle_single", ["222"], "dense", 1.0), rec(0, "needle_single", ["222"], "kvzip", 0.0),
                        rec(1, "needle_multikey", ["333"], "dense", 0.0), rec(1, "needle_multikey", ["333"], "kvzip", 0.0)]}
    m = merge_tasks([a, b])
    assert sorted({(r["source"], r["sample"]) for r in m["per_sample"]}) == [(0, 0), (1, 1), (1, 2)]
    row = next(r for r in m["rows"] if r["policy"] == "kvzip" and r["task"] == "needle_single")
    assert row["n"] == 2 and row["exact"] == 0.5
    with pytest.raises(ValueError, match="needle_single sample at length 4096"):
        merge_tasks([a, b, a])
