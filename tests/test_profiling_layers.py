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


def test_a_finalizer_of_earlier_garbage_is_not_counted():
    """Objects that died before the count (a dropped engine's finalizers release its kernel plans through ops) are
    collected before it, and no collection runs inside it: the count is the block's own ops, whatever the garbage
    collector's timing. Garbage in reference cycles whose finalizers call an op, then a collection threshold of 1
    inside the block (a collection on nearly every allocation, the worst timing): without the guard 3 aten.zeros
    would be counted with the 50 additions."""
    import gc
    import weakref

    from lowrank_lib.runtime.profiling import DispatchCounter

    class Cycle:
        def __init__(self):
            self.me = self

    x = torch.ones(4)
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            weakref.finalize(Cycle(), torch.zeros, 1)
        gc.enable()
        with DispatchCounter() as c:
            gc.set_threshold(1)
            for _ in range(50):
                x = x + 1
                [[] for _ in range(10)]         # allocations that would trigger a collection
            held_off = not gc.isenabled()
        assert dict(c.counts) == {"aten.add.Tensor": 50}
        assert held_off
        assert gc.isenabled()                    # restored as it was
    finally:
        gc.set_threshold(*threshold)
        (gc.enable if enabled else gc.disable)()
