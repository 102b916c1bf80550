"""Notebook 00's answer comparison and keep slider: values cached per keep, equal to compressing directly."""
import math

import pytest
import torch

from lowrank_lib import account, models
from lowrank_lib.compress import collect_stats
from lowrank_lib.compress.whitened import WhitenedSpectra
from lowrank_lib.data import random_token_batches
from lowrank_lib.eval.perplexity import perplexity
from lowrank_lib.explore.keep import AnswerComparison, KeepExplorer, readable


@pytest.fixture()
def explorer(monkeypatch):
    m = models.tiny_model("tiny-gqa", seed=0)
    stats = collect_stats(m, random_token_batches(256, 4, 64, seed=1), progress=False)
    spectra = WhitenedSpectra(m, stats, progress=False)
    calls = {"compress": 0}
    real = spectra.compress

    def counting(model, keep=None, ranks=None, share=False):
        calls["compress"] += 1
        calls["share"] = share
        return real(model, keep, ranks, share)

    monkeypatch.setattr(spectra, "compress", counting)
    window = random_token_batches(256, 1, 48, seed=5)[0]
    prompt = random_token_batches(256, 1, 12, seed=6)
    answers = AnswerComparison(m, prompt, tok=None, max_new_tokens=8)
    return KeepExplorer(m, spectra, window, answers), m, real, window, calls


def test_values_equal_direct_compression_and_are_cached(explorer):
    ex, m, compress, window, calls = explorer
    row = ex.result(0.6)
    direct = compress(m, 0.6)
    assert row["ppl"] == pytest.approx(perplexity(direct, window, seq_len=48, progress=False).ppl, rel=1e-6)
    assert row["params"] == account(direct).total_params < account(m).total_params
    assert row["method"] == "svdllm" and row["keep"] == 0.6 and not row["cached"]
    assert calls["share"]                         # the slider's model holds views of the spectra, not copies
    assert row["answer_ids"] == ex.answers.generate(direct).tolist()
    again = ex.result(0.6000000001)                     # a slider's float noise hits the same entry
    assert again["cached"] and again["ppl"] == row["ppl"] and calls["compress"] == 1
    ex.result(0.8)
    assert calls["compress"] == 2 and sorted(ex.results) == [0.6, 0.8]
    assert math.isfinite(ex.dense()["ppl"]) and ex.dense() is ex.dense()


def test_agreement_and_kl_against_the_dense_answer(explorer):
    ex, m, compress, *_ = explorer
    a = ex.answers
    assert a.dense_ids.numel() >= 1
    same = a.compare(m)                                  # the dense model against itself
    assert same["agreement"] == 1.0 and same["kl"] == pytest.approx(0.0, abs=1e-9)
    assert same["answer_ids"] == a.dense_ids.tolist() == a.dense["answer_ids"]
    low = a.compare(compress(m, 0.3))
    assert 0.0 <= low["agreement"] <= 1.0 and low["kl"] > 1e-4
    with torch.no_grad():                                # agreement: top-1 against the dense model's own top-1
        ids = torch.cat([a.prompt, a.dense_ids[None]], 1)
        T = a.prompt.shape[1]
        top_d = m(ids).logits[0, T - 1:-1].argmax(-1)
        top_c = compress(m, 0.3)(ids).logits[0, T - 1:-1].argmax(-1)
    assert low["agreement"] == pytest.approx(float((top_d == top_c).double().mean()))
    # KL by hand at the first answer position
    T = a.prompt.shape[1]
    ids = torch.cat([a.prompt, a.dense_ids[None]], 1)
    with torch.no_grad():
        pd_ = torch.log_softmax(m(ids).logits[0, T - 1].double(), -1)
        pc = torch.log_softmax(compress(m, 0.3)(ids).logits[0, T - 1].double(), -1)
    first = float((pd_.exp() * (pd_ - pc)).sum())
    if a.dense_ids.numel() == 1:
        assert low["kl"] == pytest.approx(first, rel=1e-6)
    with pytest.raises(ValueError, match=r"\[1, T\]"):
        AnswerComparison(m, a.prompt[0], tok=None)


def test_readable_cuts_repetition_and_length():
    assert readable("France - France - France - France - France") == "France - France - … (repeats)"
    assert readable("scratch scratch scratch scratch scratch") == "scratch scratch … (repeats)"
    assert readable("The capital of France is Paris.") == "The capital of France is Paris."
    assert readable("a" * 10 + " line\nbreak", limit=200) == "aaaaaaaaaa line break"
    long = readable(" ".join(f"w{i}" for i in range(40)), limit=50)
    assert len(long) == 50 and long.endswith("…")


def test_table_describe_and_draw_show_the_current_keep(explorer):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ex, *_ = explorer
    row = ex.result(0.75)
    text = ex.describe(row)
    assert text.startswith("keep 0.75 (SVD-LLM v1)") and f"{row['ppl']:.2f}" in text and "computed in" in text
    assert "cached" in ex.describe(ex.result(0.75))
    t = ex.table(row)
    assert list(t.index) == ["dense", "SVD-LLM v1, keep 0.75"]
    assert t.loc["dense", "agreement with dense answer"] == "100%"
    assert t.loc["SVD-LLM v1, keep 0.75", "perplexity (1 × 48 tokens)"] == f"{row['ppl']:.2f}"
    fig, axes = plt.subplots(1, 2)
    ex.draw(axes, 0.75)
    labels = [t.get_text() for t in axes[0].get_legend().get_texts()]
    plt.close(fig)
    assert "keep 0.75" in labels and any(lab.startswith("dense") for lab in labels)


def test_without_a_window_no_perplexity_is_shown(explorer):
    """No tokenizer (``window=None``): no perplexity in the row, the table or the line; the KL stands in."""
    ex, m, *_ = explorer
    bare = KeepExplorer(m, ex.spectra, None, ex.answers)
    row = bare.result(0.75)
    assert row["ppl"] is None
    t = bare.table(row)
    assert not any("perplexity" in c for c in t.columns) and "KL to dense / token" in t.columns
    assert "perplexity" not in bare.describe(row) and "KL" in bare.describe(row)


def test_panel_is_none_outside_a_kernel(explorer):
    ex, *_ = explorer
    assert ex.panel(0.8) is None


def test_window_must_be_1d(explorer):
    ex, m, *_ = explorer
    with pytest.raises(ValueError, match="1-D"):
        KeepExplorer(m, ex.spectra, torch.zeros(2, 8, dtype=torch.long), ex.answers)


class _ByteTok:
    """One token per UTF-8 byte; no chat template."""

    chat_template = None
    pad_token_id = 0
    eos_token_id = 0

    def __call__(self, text, return_tensors="pt"):
        ids = torch.tensor([list(text.encode())])
        return type("Enc", (), {"input_ids": ids, "attention_mask": torch.ones_like(ids)})()

    def decode(self, ids, skip_special_tokens=True):
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, ids, skip_special_tokens=False):   # GPT-2's byte-level alphabet
        from lowrank_lib.tokentext import _byte_decoder

        enc = {b: c for c, b in _byte_decoder().items()}
        return [enc[int(i)] for i in ids]


class _Parrot(torch.nn.Module):
    def __init__(self, tail: bytes):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1))
        self.tail = torch.tensor([list(tail)])

    def generate(self, ids, **kw):
        return torch.cat([ids, self.tail[:, :kw["max_new_tokens"]]], dim=1)


def test_answer_drops_a_character_cut_by_max_new_tokens():
    from lowrank_lib.generation import answer

    tok = _ByteTok()
    tail = "Paris 東京".encode()                      # 東 and 京 are 3 bytes each
    assert answer(_Parrot(tail), tok, "q", max_new_tokens=len(tail)) == "Paris 東京"
    assert answer(_Parrot(tail), tok, "q", max_new_tokens=len(tail) - 1) == "Paris 東"
    assert answer(_Parrot(tail), tok, "q", max_new_tokens=7) == "Paris"


def test_answer_escapes_invalid_bytes_inside_gibberish():
    from lowrank_lib.generation import answer

    tail = b"scratch\xe2\x80 scratch\xff done"          # what a broken model can emit
    text = answer(_Parrot(tail), _ByteTok(), "q", max_new_tokens=len(tail))
    assert "\ufffd" not in text and text == "scratch\\xe2\\x80 scratch\\xff done"


def test_compressed_copies_share_no_tensor_with_the_dense_model(explorer):
    """Every keep is a copy of the dense model with factors in place (compress.common.copy_for_factors: the
    replaced weights are never copied): the copy shares no tensor with the dense model and holds no placeholder,
    the dense model is untouched, and a tied head factorized in a copy unties the copy only."""
    from lowrank_lib.compress import compress_svd

    ex, m, compress, *_ = explorer
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        ref = m(x).logits
    before = {n: t.clone() for n, t in m.state_dict().items()}
    dense = {p.data_ptr() for p in m.parameters()}
    assert m.lm_head.weight is m.model.embed_tokens.weight          # tied
    one = next(iter(ex.spectra.u))                                    # one matrix factorized, the rest copied
    for c in (compress(m, 0.5), compress(m, None, {one: 2}), compress_svd(m, 0.5),
              compress_svd(m, 0.5, include_lm_head=True)):
        ps = list(c.parameters())
        assert all(p.numel() for p in ps) and not dense & {p.data_ptr() for p in ps}
        with torch.no_grad():
            for p in ps:
                p.add_(1.0)
    assert all(torch.equal(before[n], t) for n, t in m.state_dict().items())
    assert m.lm_head.weight is m.model.embed_tokens.weight
    with torch.no_grad():
        assert torch.equal(m(x).logits, ref)


def test_the_tour_refuses_a_dense_model_too_large_for_memory_before_loading_it(tmp_path):
    from lowrank_lib.explore.keep import TourTooLarge, check_tour_fits, tour_footprint
    from lowrank_lib.models import shape_config

    big, small = tmp_path / "llama7b", tmp_path / "llama1b"
    shape_config("llama2-7b").save_pretrained(big)          # a config alone: nothing may be loaded to refuse
    shape_config("llama3.2-1b").save_pretrained(small)
    need7, need1 = tour_footprint(shape_config("llama2-7b")), tour_footprint(shape_config("llama3.2-1b"))
    # float32: the weights and two full-rank decompositions of every projection, > 3x the weights' bytes
    assert 3 * 4 * 6.4e9 < need7 < 5 * 4 * 6.8e9 and 3 * 4 * 0.97e9 < need1 < 5 * 4 * 1.3e9
    with pytest.raises(TourTooLarge, match="CHECKPOINT"):
        check_tour_fits(str(big), memory=24 * 2 ** 30)
    check_tour_fits(str(small), memory=24 * 2 ** 30)        # 14 GiB: fits
    with pytest.raises(TourTooLarge):
        check_tour_fits(str(small), memory=8 * 2 ** 30)
    check_tour_fits("smollm2", memory=1)                     # names, not directories: not checked
    check_tour_fits("tiny-gqa", memory=1)
