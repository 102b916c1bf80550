"""The stricter report checks (issue 27): repeated paragraphs, headings placed after the cell they describe, and
committed timings measured on a busy machine (``lowrank_lib.notebooks.html``)."""
import json

import nbformat

from lowrank_lib.notebooks.html import heading_problems, repeated_paragraphs, report_problems, to_html

LONG = "The panels are stacked (one per prefill) under one legend for every policy, so the figure fits the page."


def md(text):
    return nbformat.v4.new_markdown_cell(text)


def result(kind="figure", text="**What this shows.** A computed sentence."):
    c = nbformat.v4.new_code_cell("show()")
    data = {"image/png": "iVBORw0KGgo=", "text/plain": "[figure]"} if kind == "figure" else \
        {"text/markdown": text, "text/plain": text}
    c.outputs = [nbformat.v4.new_output("display_data", data=data)]
    return c


def notebook(*cells):
    nb = nbformat.v4.new_notebook()
    nb.cells = list(cells)
    return nb


def test_a_paragraph_printed_twice_is_caught_and_a_short_one_is_not():
    assert repeated_paragraphs(notebook(md(f"## 1 · A\n\n{LONG}"), md("**Next:** more."), md("**Next:** more."))) == []
    twice = repeated_paragraphs(notebook(md(f"## 1 · A\n\n{LONG}\n\n{LONG}")))
    assert len(twice) == 1 and "2 times" in twice[0]
    # whitespace and line breaks do not hide a copy, and a Markdown output counts like a markdown cell
    rewrapped = LONG.replace(" so ", "\nso ")
    assert repeated_paragraphs(notebook(md(LONG), result("md", rewrapped)))
    # notebook 06's mistake: two lines pasted twice INSIDE one paragraph (no blank line between the copies)
    pasted = "Every measurement runs in ONE cell, the sections below\nonly read its results; times are medians.\n"
    found = repeated_paragraphs(notebook(md("# 06\n\nIntro line.\n" + pasted + pasted + "Library: x.")))
    assert len(found) == 2 and all("a line printed 2 times" in f for f in found), found
    # table rows may repeat, short lines may repeat
    table = "| route | ms |\n|---|---|\n| dense | 1.0 |\n| dense | 1.0 |\n"
    assert repeated_paragraphs(notebook(md(table + "\nok\nok\n"))) == []


def test_a_heading_placed_after_its_cell_is_caught():
    good = notebook(md("# Title"), nbformat.v4.new_code_cell("setup()"), md("## 1 · Cost model"), result(),
                    md("## 2 · Measured"), result("md"), md("### A subsection"), result())
    assert heading_problems(good) == []
    # notebook 06's mistake: the result shown under an unnumbered heading, its numbered heading one cell later
    shifted = notebook(md("# Title"), md("## Every measurement"), result(), md("## 1 · Cost model"), result("md"),
                       md("## 2 · Measured"), result())
    assert any("cell 2" in p and "no numbered section" in p for p in heading_problems(shifted))
    # a result before section 1, and a section that shows nothing before the next heading
    assert any("no numbered section" in p for p in heading_problems(notebook(result(), md("## 1 · A"), result())))
    empty = heading_problems(notebook(md("## 1 · A"), result(), result(), md("## 2 · B"), md("## 3 · C"), result()))
    assert any("section 2 shows no figure" in p for p in empty)
    assert any("count 1, 2, 3" in p for p in heading_problems(notebook(md("## 1 · A"), result(), md("## 3 · C"),
                                                                         result())))
    assert heading_problems(notebook(md("# No numbered sections"), result())) == []


def test_committed_timings_marked_not_meaningful_fail_the_freshness_check(tmp_path):
    nb = notebook(nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]}))
    src, rep = tmp_path / "n.ipynb", tmp_path / "r.ipynb"
    nbformat.write(nb, src)
    nbformat.write(nb, rep)
    to_html(rep)
    assert report_problems(rep, src) == []
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "metrics.json").write_text(json.dumps({"timings_meaningful": True}))
    assert report_problems(rep, src) == []
    (tmp_path / "r" / "metrics.json").write_text(json.dumps({"timings_meaningful": False}))
    assert any("timings_meaningful=false" in p for p in report_problems(rep, src))
