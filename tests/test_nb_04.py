"""Notebook 04 (AttSVD interpretability) runs headless and reports what the paper's App. D.3.2 shows."""
import pytest


@pytest.mark.notebook
@pytest.mark.smollm2
def test_nb_04_interpretability(executed_notebook):
    m = executed_notebook("04_attsvd_interpretability")
    assert len(m["figures"]) == 5
    # attention-aware truncation beats raw SVD on the quantities attention consumes, on real heads
    assert m["all_heads_logit_err_aware_mean"] < m["all_heads_logit_err_raw_mean"]
    assert m["all_heads_output_err_aware_mean"] < m["all_heads_output_err_raw_mean"]
    assert m["frac_heads_aware_logit_better"] >= 0.9
    # keys are more compressible than values in the weighted geometry (r_K << r_V)
    assert m["mean_rank_k"] < m["mean_rank_v"] and m["frac_heads_rk_lt_rv"] > 0.5
    # error curves fall with rank and vanish at full rank
    c = m["error_curves"]
    for key in ("logit_aware", "logit_raw", "output_aware", "output_raw"):
        assert all(b <= a * 1.001 + 1e-6 for a, b in zip(c[key], c[key][1:]))
        assert c[key][-1] < 1e-3
