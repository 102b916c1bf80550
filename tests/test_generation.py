"""The decode loop's greedy pick (``lowrank_lib.generation.greedy``): ``torch.argmax``'s indices, on every input.

``greedy`` reads ``max(-1).indices`` instead of ``argmax(-1)`` (4x faster on bf16 logits on the CPU); these tests
hold it to argmax's contract where the two could differ: ties (the first index), NaN (the largest, first NaN),
infinities, rows that are all -inf, every floating dtype a runner returns, batched and 1-D logits, and the width
of a real vocabulary, where the reduction is vectorised and split.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowrank_lib.generation import greedy, sample_next

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _logits(seed: int, shape: tuple[int, ...], dtype: torch.dtype, levels: int, nans: int, infs: int) -> torch.Tensor:
    """Few distinct values (many ties), with NaN / +inf / -inf planted at random positions of random rows."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-levels, levels + 1, shape, generator=g).to(dtype)
    flat = x.view(-1, shape[-1])
    for value, count in ((float("nan"), nans), (float("inf"), infs), (float("-inf"), infs)):
        for _ in range(count):
            r = int(torch.randint(0, flat.shape[0], (), generator=g))
            flat[r, int(torch.randint(0, shape[-1], (), generator=g))] = value
    return x


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), dtype=st.sampled_from(DTYPES),
       shape=st.sampled_from([(7,), (1, 5), (3, 33), (2, 1, 257), (4, 1000)]),
       levels=st.integers(0, 3), nans=st.integers(0, 3), infs=st.integers(0, 2))
def test_greedy_is_argmax(seed, dtype, shape, levels, nans, infs):
    x = _logits(seed, shape, dtype, levels, nans, infs)
    assert torch.equal(greedy(x), x.argmax(-1))
    assert greedy(x).dtype == torch.long


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_greedy_is_argmax_at_vocabulary_width(dtype, threads):
    """SmolLM2's 49152 and Llama 3's 128256 columns: ties across the vectorised / threaded reduction's pieces."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _vocabulary_rows(dtype)
    finally:
        torch.set_num_threads(before)


def _vocabulary_rows(dtype):
    for V in (49152, 128256):
        for seed in range(3):
            x = _logits(seed, (2, V), dtype, levels=2, nans=0, infs=0)
            assert torch.equal(greedy(x), x.argmax(-1))
            x[0, V - 1] = x[0, 0] = x[0].max() + 1                  # the same maximum at both ends: the first wins
            x[1, V // 2] = float("nan")
            x[1, V // 3] = float("nan")                             # two NaN: the first NaN wins
            assert greedy(x).tolist() == x.argmax(-1).tolist() == [0, V // 3]
    rows = torch.full((2, 49152), float("-inf"), dtype=dtype)       # nothing finite: index 0, as argmax
    assert greedy(rows).tolist() == rows.argmax(-1).tolist() == [0, 0]


def test_sample_next_without_sampling_is_greedy():
    x = _logits(0, (3, 4096), torch.bfloat16, levels=1, nans=1, infs=1)
    assert torch.equal(sample_next(x, do_sample=False), x.argmax(-1))
