"""Notebook 04 (AttSVD interpretability): the rank explorer's numbers, then the notebook headless."""
import matplotlib
import pytest
import torch

from lowrank_lib import models
from lowrank_lib.attsvd import interpret
from lowrank_lib.kv import record
from lowrank_lib.explore.heads import CURVES, HeadRanks, draw_head, format_summary
from lowrank_lib.tokentext import token_label, token_labels

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def rec():
    m = models.tiny_model("tiny-gqa", seed=0)
    ids = torch.randint(0, m.config.vocab_size, (1, 48), generator=torch.Generator().manual_seed(0))
    return record(m, ids)


@pytest.mark.parametrize("layer,head", [(0, 0), (1, 1)])
def test_errors_at_every_rank_equal_interpret(rec, layer, head):
    """The suffix-sum errors equal rebuilding K_r / V_r at each rank (interpret.error_curves)."""
    h = interpret.head_view(rec, layer, head)
    hr = HeadRanks(h)
    ranks = list(range(1, hr.d + 1))
    assert hr.curves["rank"] == ranks
    ref = interpret.error_curves(h, ranks)
    for c in CURVES:
        torch.testing.assert_close(torch.tensor(hr.curves[c]), torch.tensor(ref[c]), rtol=1e-4, atol=1e-5)
        assert all(b <= a + 1e-12 for a, b in zip(hr.curves[c], hr.curves[c][1:])), c   # falls with r
        assert hr.curves[c][-1] == 0.0                                                   # exact at full rank
    # the aware bases are what AttSVD optimises: better than raw at every rank on these heads' own metric
    assert sum(a <= r for a, r in zip(hr.curves["logit_aware"], hr.curves["logit_raw"])) >= hr.d - 1


def test_attention_rows_and_top_keys(rec):
    h = interpret.head_view(rec, 1, 0)
    hr = HeadRanks(h)
    for r in (1, 5, hr.d):
        mine, ref = hr.attention_rows(r), interpret.attention_rows(h, r)
        for n in ref:
            torch.testing.assert_close(mine[n], ref[n], rtol=1e-4, atol=1e-6)
        top = hr.top_keys(r, k=5)
        dense = mine["dense"]
        assert top["positions"] == dense.topk(5).indices.tolist()
        assert top["dense"] == sorted(top["dense"], reverse=True)
        for b in ("aware", "raw"):
            assert 0.0 <= top[f"tv_{b}"] <= 1.0
            assert top[f"tv_{b}"] == pytest.approx(float(0.5 * (mine[b] - dense).abs().sum()), abs=1e-6)
    full = hr.top_keys(hr.d)
    assert full["tv_aware"] < 1e-4 and full["tv_raw"] < 1e-4
    with pytest.raises(ValueError, match="outside"):
        hr.errors(hr.d + 1)


def test_panel_shows_the_values_at_r(rec):
    import matplotlib.pyplot as plt

    hr = HeadRanks(interpret.head_view(rec, 0, 1))
    fig, axes = plt.subplots(1, 2)
    s = draw_head(axes, hr, 7, labels=[f"t{i}" for i in range(48)], k=6)
    plt.close(fig)
    assert s["rank"] == 7 and s["logit_aware"] == hr.curves["logit_aware"][6]
    legend = [t.get_text() for t in axes[0].get_legend().get_texts()]
    assert any(f"{s['logit_raw']:.3g}" in t for t in legend) and any(f"{s['output_aware']:.3g}" in t for t in legend)
    assert len(axes[1].get_xticklabels()) == 6 and "'t" in axes[1].get_xticklabels()[0].get_text()
    line = format_summary(s)
    assert "r = 7" in line and f"{s['output_raw']:.4f}" in line


class _ByteTok:
    """A byte-level tokenizer stand-in: one token per UTF-8 byte, GPT-2 alphabet pieces."""

    def __init__(self):
        from lowrank_lib.tokentext import _byte_decoder

        self.enc = {b: c for c, b in _byte_decoder().items()}

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, i):
        return self.enc[i]


def test_token_labels_never_show_the_replacement_character():
    tok = _ByteTok()
    ids = list("a é 𝔘".encode())
    labels = token_labels(tok, ids)
    assert all("\ufffd" not in s for s in labels)
    assert labels[0] == "a" and labels[2] == "\\xc3" and token_label(tok, ord("b")) == "b"


@pytest.mark.smollm2
def test_token_labels_smollm2(smollm2):
    _, tok = smollm2
    ids = tok("naïve café 𝔘 ∑ 東京", add_special_tokens=False).input_ids
    assert all("\ufffd" not in s for s in token_labels(tok, ids))


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
    # error curves at EVERY rank the slider offers: fall with rank and vanish at full rank
    c = m["error_curves"]
    assert c["rank"] == list(range(1, m["head_dim"] + 1))
    for key in CURVES:
        assert len(c[key]) == m["head_dim"]
        assert all(b <= a * 1.001 + 1e-6 for a, b in zip(c[key], c[key][1:]))
        assert c[key][-1] < 1e-3
    assert m["head_logit_err_aware"] == c["logit_aware"][m["rank"] - 1]
