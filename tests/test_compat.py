"""transformers' calling convention across the supported range (runs on the oldest too: ``make test-oldest``)."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from transformers import DynamicCache

from lowrank_lib import models
from lowrank_lib.compat import cache_kw, cache_kwarg

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.compat


def _version(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


def _declared_range() -> tuple[str, str]:
    spec = re.search(r'^\s*"(transformers[^"]*)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    lo, hi = re.search(r">=([\d.]+)", spec), re.search(r"<([\d.]+)", spec)
    assert lo and hi, f"pyproject.toml declares {spec!r}: needs a lower and an upper bound"
    return lo.group(1), hi.group(1)


def test_installed_transformers_is_in_the_declared_range():
    lo, hi = _declared_range()
    assert _version(lo) <= _version(transformers.__version__) < _version(hi)


def test_keyword_matches_the_installed_forward():
    """The detected keyword is the one the model's forward names (not a version guess)."""
    import inspect

    from transformers import LlamaForCausalLM

    params = inspect.signature(LlamaForCausalLM.forward).parameters
    assert cache_kwarg() in params
    assert cache_kwarg() == ("cache" if "cache" in params else "past_key_values")
    if _version(transformers.__version__) >= (5, 24):
        assert cache_kwarg() == "cache"


def test_the_cache_we_pass_is_the_cache_the_model_fills():
    """With the wrong keyword an old transformers silently builds its own cache: ours must be filled."""
    m = models.tiny_model("tiny-gqa", seed=0)
    ids = torch.randint(0, m.config.vocab_size, (2, 7))
    cache = DynamicCache(config=m.config)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        a = m(ids[:, :5], **cache_kw(cache)).logits
        assert cache.get_seq_length() == 5
        b = m(ids[:, 5:], **cache_kw(cache)).logits
        assert cache.get_seq_length() == 7
        full = m(ids).logits
    torch.testing.assert_close(torch.cat([a, b], 1), full, atol=1e-5, rtol=1e-4)


def test_generate_uses_our_cache():
    m = models.tiny_model("tiny-gqa", seed=0)
    ids = torch.randint(0, m.config.vocab_size, (1, 6))
    cache = DynamicCache(config=m.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        out = m.generate(ids, **cache_kw(cache), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert out.shape[1] == 10
    assert cache.get_seq_length() == 9          # the last token is sampled, never fed back


def test_a_deprecated_call_from_our_code_is_an_error():
    """The pytest set-up (tests/deprecations.py + pyproject filters): transformers' FutureWarning, which it
    attributes to torch's Module._call_impl, is re-attributed to this frame and fails the test."""
    if cache_kwarg() != "cache":
        pytest.skip(f"transformers {transformers.__version__} has no deprecated cache keyword")
    m = models.tiny_model("tiny-gqa", seed=0)
    ids = torch.randint(0, m.config.vocab_size, (1, 4))
    with pytest.raises(FutureWarning, match="past_key_values"):
        m(ids, past_key_values=DynamicCache(config=m.config))


def test_deprecations_inside_third_party_code_keep_their_origin():
    """Only plumbing is skipped: a warning named at a third-party frame that is not plumbing stays there."""
    import deprecations

    ns: dict = {}
    exec(compile("import warnings\ndef lib():\n    warnings.warn('old', FutureWarning, stacklevel=1)\n",
                 "/site-packages/somelib/core.py", "exec"), ns)
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        ns["lib"]()
    assert got and got[0].filename == "/site-packages/somelib/core.py"
    assert deprecations._plumbing(None) is False
