"""eval.matched: checkpoint families compared at the size they really hold (issue 27, notebook 01)."""
from lowrank_lib.eval.matched import matched_groups, size_facts


def row(family, keep, ppl, params):
    return {"family": family, "keep": keep, "ppl": ppl, "total_params": params}


ROWS = [row("svd", 0.8, 1.6e8, 110e6), row("svd", 0.6, 2.7e7, 90e6), row("svdllm", 0.8, 51.3, 110.5e6),
        row("svdllm", 0.6, 134.8, 90.4e6), row("palu", 0.6, 24.2, 133.8e6), row("palu", 0.8, 22.4, 134.2e6),
        row("dobi-remap", 0.8, 28.0, 151.2e6)]


def test_groups_compare_only_rows_of_matched_size_and_different_families():
    groups = matched_groups(ROWS, tol=0.03)
    fams = [[r["family"] for r in g] for g in groups]
    assert fams == [["svdllm", "svd"], ["svdllm", "svd"]]          # best first; palu's two keeps are one family
    assert matched_groups(ROWS, tol=0.0) == []                      # no two rows of exactly one size
    # with a loose tolerance palu (133.8 M) and dobi-remap (151.2 M) stay apart: 13 % is not matched
    assert not any({"palu", "dobi-remap"} <= {r["family"] for r in g} for g in matched_groups(ROWS, tol=0.1))


def test_size_facts_name_rows_at_dense_size_and_perplexity_falling_with_size():
    f = size_facts(ROWS, 134.5e6)
    assert {(r["family"], r["keep"]) for r in f["at_dense"]} == {("palu", 0.6), ("palu", 0.8), ("dobi-remap", 0.8)}
    assert [(fam, a["keep"], b["keep"]) for fam, a, b in f["rising"]] == [("svd", 0.8, 0.6)]
