"""runtime.profiling: THE dispatch count (notebooks 02 / 03) and its per-layer breakdown, measured per layer."""
import pytest
import torch

from lowrank_lib import models
from lowrank_lib.compress import compress_svd
from lowrank_lib.runtime.baselines import make_runner
from lowrank_lib.runtime.profiling import DISPATCH_TOKENS, per_token_counts


@pytest.fixture(scope="module")
def pair():
    dense = models.tiny_model("tiny-gqa", seed=3)
    return dense, compress_svd(dense, 0.5)


@pytest.mark.parametrize("system", ["naive", "dense_kv", "engine", "hf_static", "hf_dynamic", "dense_engine"])
def test_per_layer_counts_are_measured_and_add_up(pair, system):
    dense, comp = pair
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    c = per_token_counts(make_runner(system, comp, dense, max_seq_len=32), ids)
    L = comp.config.num_hidden_layers
    assert len(c["per_layer"]) == L
    assert sum(c["per_layer"]) + c["outside_layers"] == pytest.approx(c["total"])
    # every layer does the same work; the embedding, the final norm, the head and the argmax run outside them
    assert len(set(c["per_layer"])) == 1 and c["per_layer"][0] > 0 and c["outside_layers"] >= 2
    if system in ("naive", "dense_kv"):        # unpacked low-rank: 7 projections x 2 GEMMs per layer + the head
        gemm_per_layer = c["by_class"]["gemm"] - 1
        assert gemm_per_layer == 14 * L


def test_one_count_for_one_configuration(pair):
    """The default count (DISPATCH_TOKENS steps) does not depend on how many steps it averages or the prompt."""
    dense, comp = pair
    ids = torch.randint(0, 256, (1, 9), generator=torch.Generator().manual_seed(1))
    for system in ("naive", "engine", "hf_static"):
        a = per_token_counts(make_runner(system, comp, dense, max_seq_len=40), ids)
        b = per_token_counts(make_runner(system, comp, dense, max_seq_len=40), ids[:, :5], DISPATCH_TOKENS + 2)
        assert a["total"] == b["total"] and a["per_layer"] == b["per_layer"], system
