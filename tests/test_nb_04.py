"""Notebook 04 (AttSVD interpretability): the rank explorer's numbers, then the notebook headless."""
import matplotlib
import pytest
import torch

from lowrank_lib import models
from lowrank_lib.attsvd import interpret
from lowrank_lib.kv import record
from lowrank_lib.attsvd.basis import logit_error, output_error
from lowrank_lib.explore.heads import CURVES, HeadRanks, draw_head, factor_concentration, format_summary, split_view
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


def test_the_heldout_score_uses_tokens_the_basis_never_saw():
    """Two recordings share a 32-token prompt and differ in their 16-token continuation. The prompt's view (all a
    basis is fitted on) is the same in both and equals a recording of the prompt alone; the bases and in-sample
    curves are identical; the held-out curves differ, and equal a brute-force rebuild of K_r / V_r scored on the
    continuation's queries."""
    m = models.tiny_model("tiny-gqa", seed=0)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, m.config.vocab_size, (1, 32), generator=g)
    conts = [torch.randint(0, m.config.vocab_size, (1, 16), generator=g) for _ in range(2)]
    alone = record(m, prompt)
    views = [split_view(record(m, torch.cat([prompt, c], 1)), 1, 1, 32) for c in conts]
    ref = interpret.head_view(alone, 1, 1)
    for view, q_out in views:
        assert q_out.shape[1] == 16
        for f in ("K", "V", "Q", "mass"):
            torch.testing.assert_close(getattr(view, f), getattr(ref, f), rtol=1e-5, atol=1e-6)
    (v0, q0), (v1, q1) = views
    h0, h1 = HeadRanks(v0), HeadRanks(v1)
    for c in CURVES:
        assert h0.curves[c] == pytest.approx(h1.curves[c], rel=1e-6, abs=1e-9)
    out0, out1 = h0.heldout(q0), h0.heldout(q1)
    assert out0["logit_aware"][3] != pytest.approx(out1["logit_aware"][3], rel=1e-3)
    P = torch.softmax((q0 @ v0.K.T) * v0.scaling, -1)
    for r in (1, 4, h0.d):
        rec_r = interpret.reconstructions(v0, r)
        for b in ("aware", "raw"):
            assert out0[f"logit_{b}"][r - 1] == pytest.approx(float(logit_error(q0, v0.K, rec_r[f"{b}_k"]).mean()),
                                                           rel=1e-3, abs=1e-5)
            assert out0[f"output_{b}"][r - 1] == pytest.approx(float(output_error(P, v0.V, rec_r[f"{b}_v"]).mean()),
                                                            rel=1e-3, abs=1e-5)
    with pytest.raises(ValueError, match="held-out"):
        split_view(alone, 1, 1, 32)


def test_factor_concentration_against_uniform(rec):
    h = interpret.head_view(rec, 0, 0)
    S = h.K.shape[0]
    rows = factor_concentration(h, n_factors=3, k=4, which="v")
    ref = interpret.top_tokens(h, list(range(S)), None, 3, 4, "v")
    for row, r in zip(rows, ref):
        assert row["positions"] == [int(p) for p, _ in r] and row["shares"] == pytest.approx([v for _, v in r])
        assert row["uniform"] == 4 / S and row["uniform"] <= row["top_share"] <= 1.0
        assert 1.0 <= row["effective_tokens"] <= S + 1e-6


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
    assert len(m["figures"]) == 6
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
    # the held-out score: queries of the continuation after the prompt the bases were fitted on, paired over heads
    ho = m["heldout"]
    assert ho["basis_positions"] == [0, m["prompt_len"]] and ho["positions"] == [m["prompt_len"], m["prompt_len"] + m["gen_len"]]
    for key in ("in-sample logit", "held out logit", "in-sample output", "held out output"):
        assert m["paired_over_heads"][key]["n"] >= 2 and m["paired_over_heads"][key]["verdict"] in (
            "a better", "b better", "within noise")
    assert m["paired_over_heads"]["in-sample logit"]["verdict"] == "a better"     # optimal by construction
