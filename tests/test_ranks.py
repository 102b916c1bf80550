"""Canonical keep ratio and each family's native ratio."""
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowrank_lib.ranks import basis_sharing_num_basis, keep_rank, native_to_keep, rank_keep


def test_keep_rank_matches_papers():
    # SVD-LLM: LLaMA-7B at keep 0.8 -> 1638 (attention 4096x4096), 2388 (MLP 11008x4096)
    assert keep_rank(4096, 4096, 0.8) == 1638
    assert keep_rank(11008, 4096, 0.8) == 2388
    # ASVD: 4096^2 at p=0.9 -> 1843
    assert keep_rank(4096, 4096, 0.9) == 1843
    # Basis Sharing, 7B, cr 20, group of 2: q/k/v 2184, up/gate 2762
    assert basis_sharing_num_basis(4096, 4096, 2, 0.8) == 2184
    assert basis_sharing_num_basis(4096, 11008, 2, 0.8) == 2762


@given(out=st.integers(1, 5000), inn=st.integers(1, 5000), keep=st.floats(0.01, 1.0))
def test_keep_rank_never_exceeds_budget_or_full_rank(out, inn, keep):
    r = keep_rank(out, inn, keep)
    assert 1 <= r <= min(out, inn)
    if r > 1:
        assert rank_keep(out, inn, r) <= keep + 1e-12
        # the next rank would exceed the budget (floor), unless capped at full rank
        assert r == min(out, inn) or rank_keep(out, inn, r + 1) > keep - 1e-12


def test_native_ratios():
    assert math.isclose(native_to_keep("svdllm", 0.2), 0.8)
    assert native_to_keep("asvd", 0.9) == 0.9
    assert math.isclose(native_to_keep("basis_sharing", 20), 0.8)
    assert native_to_keep("dobi", 0.4) == 0.4
    assert native_to_keep("palu", 0.5) == 0.5
    with pytest.raises(ValueError, match="unknown family"):
        native_to_keep("nope", 0.5)
    with pytest.raises(ValueError, match="keep ratio must be in"):
        keep_rank(10, 10, 0.0)
