"""Long-context tasks: scoring rules, deterministic prompts at the target length with the needles inside,
and an end-to-end passkey run through the record/replay + manual decode loop on SmolLM2."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib.eval.longctx import TASKS, build_samples, evaluate, make_sample, score


def test_score_exact_and_partial():
    assert score(" 12345. Remember", ["12345"]) == (1.0, 1.0)
    assert score(" 12399", ["12345"]) == (0.0, 0.6)
    assert score("nothing", ["12345"]) == (0.0, 0.0)
    ex, pa = score("ABCDE, FGHIJ and KLMNO", ["ABCDE", "FGHIJ", "KLMNO", "PQRST"])
    assert ex == 0.0 and pa == 0.75


class _CharTok:
    """A stand-in tokenizer (one token per 4 characters) for prompt-construction tests."""

    def __call__(self, text, add_special_tokens=False, return_tensors=None):
        class R:
            input_ids = list(range((len(text) + 3) // 4))
        return R()


@pytest.mark.parametrize("task", TASKS)
def test_samples_have_needles_and_target_length(task):
    text = "lorem ipsum dolor sit amet " * 5000
    s = make_sample(task, _CharTok(), text, 1000, seed=3)
    assert abs(s.n_tokens - 1000) <= 20
    assert all(a in s.prompt for a in s.answers)
    assert s == make_sample(task, _CharTok(), text, 1000, seed=3)            # deterministic
    assert s.prompt != make_sample(task, _CharTok(), text, 1000, seed=4).prompt
    with pytest.raises(ValueError, match="unknown task"):
        make_sample("freq_words", _CharTok(), text, 100, 0)


@pytest.mark.smollm2
def test_passkey_end_to_end_dense_and_attsvd(smollm2):
    from lowrank_lib.kv import make_method

    model, tok = smollm2
    samples = build_samples(tok, tasks=("passkey",), lengths=(384,), n_per=1, seed=0)
    assert abs(samples[0].n_tokens - 384) <= 16
    methods = {"dense": make_method("dense"), "attsvd": make_method("attsvd", 0.5, window=16)}
    with torch.no_grad():
        res = evaluate(model, tok, samples, methods, max_new=8, progress=False)
    assert res["summary"]["dense"]["passkey"]["exact"] == 1.0     # SmolLM2 finds the key at this length
    assert set(res["summary"]) == {"dense", "attsvd"} and len(res["per_sample"]) == 2
