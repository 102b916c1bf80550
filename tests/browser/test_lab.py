"""Every notebook in JupyterLab, as a person uses it: Run All, every slider moved, saved, reopened.

One JupyterLab server and one Chromium serve the whole session (``conftest.py``). Per notebook: Run All from
the menu, wait until no cell is queued or running, then move every slider of every panel one step by
keyboard and wait for its answer (the panel's status line says what it shows; the view under it is
ordinary output updated in place). The saved notebook must be clean (``lowrank_lib.notebooks.html.
output_problems``: no stderr, warning, stray return value), and it is recorded for ``executed_notebook``
(``tests/nbruns.py``): the metrics tests of ``test_nb_*.py`` then reuse this run instead of a second
papermill execution. Notebooks with sliders are then reopened with no kernel state (no "Error displaying
widget", the last view shown) and rendered to offline HTML (the last view is in it).

``LOWRANK_LIB_BROWSER_TIMINGS=PATH.json`` writes, per notebook, the wall time from Run All to the last
output and to the first slider answer, and every slider answer's time (see ``tests/browser/README.md``).
"""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest

from lowrank_lib import notebooks

pytestmark = [pytest.mark.notebook, pytest.mark.smollm2, pytest.mark.slow]

NB_RUN_S = 900                  # Run All of a CI-sized notebook on a busy 2-core machine
STEP_S = 240                    # one slider answer on a busy machine (the idle target is 3 s: the timing run)
MIN_PX_PER_STEP = 8             # a slider track this wide per step: a small drag moves one step
TIMINGS: dict[str, dict] = {}


def _metrics(lab, name: str, timeout_s: float = 120) -> dict:
    """The metrics a notebook copy wrote: ``reports/<stem>/metrics.json`` beside the copy (``name`` may name a copy in
    a subfolder, ``mine/00_quickstart``); the context writes it whole (a rename), so it is read as soon as it exists."""
    path = lab.nbdir / Path(name).parent / "reports" / Path(name).name / "metrics.json"
    deadline = time.time() + timeout_s
    while not path.exists():
        assert time.time() < deadline, f"{path} was not written (outputs must land next to the notebook copy)"
        time.sleep(0.5)
    return json.loads(path.read_text())


def _views(lab, panel) -> list[str]:
    """Texts of the outputs of the cell holding ``panel`` (the controls, then the views)."""
    cell = lab.page.locator(".jp-Cell", has=panel).first
    return [t.strip() for t in cell.locator(".jp-OutputArea-output").all_text_contents()]


def _value(slider) -> tuple[float, float, float]:
    """(value, min, max) of a slider, from its noUiSlider handle's ARIA attributes."""
    h = slider.locator(".noUi-handle")
    return tuple(float(h.get_attribute(a)) for a in ("aria-valuenow", "aria-valuemin", "aria-valuemax"))


def _move(lab, panel, slider) -> tuple[str, float, float]:
    """One keyboard step of ``slider`` (right, or left at its maximum); waits for the panel's answer.
    Returns (the status line, seconds from the key press to the answer, CSS px of track per slider step)."""
    now, lo, hi = _value(slider)
    before = lab.status(panel)
    t = time.time()
    lab.key(slider, "ArrowLeft" if now >= hi else "ArrowRight")
    deadline = time.time() + STEP_S * float(os.environ.get("LOWRANK_LIB_BROWSER_SLOW", "1"))
    while True:
        text = lab.status(panel)
        if text.startswith("showing") and text != before:
            break
        if "failed" in text:
            pytest.fail(f"slider answer failed: {text}\n" + "\n---\n".join(v[-1500:] for v in _views(lab, panel)))
        assert time.time() < deadline, f"no answer after {STEP_S} s: status {text!r}"
        time.sleep(0.1)
    dt = time.time() - t
    step = abs(_value(slider)[0] - now)
    track = slider.locator(".noUi-target").first.bounding_box()["width"]
    return text, dt, track / max(1.0, round((hi - lo) / step)) if step else 0.0


def _panels(lab):
    """Each slider panel of the open notebook, (index, panel), once it shows its first answer."""
    for i in range(lab.panels().count()):
        panel = lab.panels().nth(i)
        lab.wait_status(panel, r"^showing ", STEP_S)
        yield i, panel


def _moves(lab, panel):
    """Every slider of ``panel`` moved one step in turn: :func:`_move`'s (status, seconds, px per step) each."""
    sliders = panel.locator(".widget-slider")
    for j in range(sliders.count()):
        yield _move(lab, panel, sliders.nth(j))


# --------------------------------------------------------------------------- per-notebook checks of the values
def _check_04(lab, panel, m: dict):
    """Typed values work, and the printed errors at r are the notebook's error curves at r (4 decimals)."""
    curves = m["error_curves"]
    lab.type_value(lab.slider("layer"), str(m["layer"]))
    lab.wait_status(panel, rf"^showing layer {m['layer']}, ", STEP_S)
    lab.type_value(lab.slider("KV head"), str(m["head"]))
    lab.wait_status(panel, rf"^showing layer {m['layer']}, KV head {m['head']}, ", STEP_S)
    lab.type_value(lab.slider("rank r"), "17")
    lab.wait_status(panel, rf"^showing layer {m['layer']}, KV head {m['head']}, r = 17 ", STEP_S)
    line = next(v for v in _views(lab, panel) if "logit error aware" in v)
    got = re.search(r"r = (\d+): logit error aware ([\d.]+) / raw ([\d.]+); output error aware ([\d.]+) / raw ([\d.]+)",
                    line)
    assert got and int(got.group(1)) == 17, line
    want = [curves[k][16] for k in ("logit_aware", "logit_raw", "output_aware", "output_raw")]
    assert [float(g) for g in got.groups()[1:]] == pytest.approx(want, abs=6e-5), line


def _check_00(lab, panel, m: dict):
    """A long drag computes only where it is released; a keep seen before comes from the cache."""
    keep = lab.slider("keep")
    before = lab.status(panel)
    lab.drag(keep, -150)             # 3-4 steps below the keeps seen so far (0.90, 0.95)
    v = lab.readout(keep)
    text = lab.wait_status(panel, rf"^showing keep {re.escape(v)} ", STEP_S)
    assert text != before
    view = "\n".join(_views(lab, panel))
    assert f"keep {v} (SVD-LLM v1)" in view and "computed in" in view
    lab.type_value(keep, f"{m['keep_ratio']:.2f}")
    lab.wait_status(panel, rf"^showing keep {m['keep_ratio']:.2f} ", STEP_S)
    view = "\n".join(_views(lab, panel))
    first = m["slider_rows"][0]
    assert "cached" in view and f"perplexity {first['ppl']:.2f}" in view, view[:500]


EXTRA = {"00_quickstart": _check_00, "04_attsvd_interpretability": _check_04}
COLD_WARM: dict[str, dict] = {}


def _first_view(lab, t0: float) -> float:
    """Seconds from ``t0`` (Run All) until the first slider panel shows its first answer ("showing ..."), while
    the cells after it may still run (a move is answered once the kernel is free: after the last cell)."""
    deadline = time.time() + NB_RUN_S * float(os.environ.get("LOWRANK_LIB_BROWSER_SLOW", "1"))
    while True:
        panels = lab.panels()
        if panels.count() and re.search(r"^showing ", lab.status(panels.first)):
            return time.time() - t0
        assert time.time() < deadline, "no slider panel showed an answer"
        time.sleep(0.2)


@pytest.mark.parametrize("name", notebooks.on_disk())
def test_run_all_then_every_slider(lab, timings, name):
    import nbformat
    import nbruns

    from lowrank_lib.notebooks.html import PANEL_NOTE, output_problems, to_html

    t0 = time.time()
    lab.open(name)
    lab.run_all()
    first_view_s = _first_view(lab, t0) if name in EXTRA else None
    lab.wait_all_done(NB_RUN_S)
    last_output_s = time.time() - t0
    timings.add(f"{name} Run All to the last output", last_output_s)
    m = _metrics(lab, name)
    answers, first_answer_s, statuses = [], None, []
    for i, panel in _panels(lab):
        for j, (text, dt, px) in enumerate(_moves(lab, panel)):
            assert px >= MIN_PX_PER_STEP, f"slider {j} of panel {i}: {px:.1f} px of track per step"
            answers.append(dt)
            first_answer_s = first_answer_s or time.time() - t0
            timings.add(f"{name} slider answer ({text[:40]})", dt)
        if name in EXTRA:
            EXTRA[name](lab, panel, m)
        statuses.append(lab.status(panel))
    lab.assert_clean()
    lab.save()
    saved = lab.nbdir / f"{name}.ipynb"
    nb = nbformat.read(saved, as_version=4)
    assert not output_problems(nb), f"{name}: the saved notebook is not clean:\n" + "\n".join(output_problems(nb))
    nbruns.record(name, m, saved, "browser")
    TIMINGS[name] = {"params": os.environ.get("LOWRANK_LIB_BROWSER_PARAMS", "ci"), "last_output_s": last_output_s,
                     "first_slider_view_s": first_view_s, "first_slider_answer_s": first_answer_s,
                     "slider_answers_s": answers,
                     "load_average_at_end": list(os.getloadavg())}
    if not statuses:
        return
    # reopened with no kernel state: the saved widget state draws the panels at their last values
    lab.new_page()
    lab.open(name)
    lab.wait_text(".widget-html", re.escape(statuses[-1][:30]), 120)
    assert lab.page.locator("text=Error displaying widget").count() == 0, f"{name} reopened: a widget did not load"
    assert lab.panels().count() == len(statuses)
    # rendered offline to HTML: the note in place of the controls, the last view as plain output
    html = to_html(saved, lab.nbdir / f"{name}.html").read_text()
    assert html.count(PANEL_NOTE.split(":")[0]) >= len(statuses)
    last_value = re.search(r"showing (.+?) \(answered", statuses[-1]).group(1)
    assert last_value.split(",")[0] in html, f"{name}: the last view ({last_value}) is not in the HTML"


@pytest.fixture(scope="module")
def on_checkpoint(lab_server):
    """``mine/``: a Dobi-SVD file alone (no tokenizer beside it, no reference) and copies of 00 and 02 prepared on it
    (``python -m lowrank_lib.notebooks prepare NAME DIR --checkpoint PATH``), as a user with only a compressed file
    gets them."""
    from lowrank_lib import synthetic

    _, _, nbdir = lab_server
    mine = nbdir / "mine"
    path = synthetic.write_family("dobi", "quick", mine / "ckpt", keep=0.6)
    for name in ("00_quickstart", "02_launch_count_profiling"):
        notebooks.prepare(name, mine, ci=True, checkpoint=path)
    return path


@pytest.mark.parametrize("name", ["00_quickstart", "02_launch_count_profiling"])
def test_run_all_on_a_checkpoint(lab, on_checkpoint, name):
    """Your checkpoint in JupyterLab (issue 28): Run All of a copy prepared on a Dobi file alone, every slider moved
    one step, saved clean. What it ran on: the file, no tokenizer (the banner; no perplexity anywhere), no reference
    (00 compares with the file as stored and truncates its own factors; 02 runs no uncompressed system)."""
    import nbformat

    from lowrank_lib.notebooks.html import output_problems
    from lowrank_lib.resolve import NO_TOKENIZER

    copy = f"mine/{name}"
    lab.open(copy)
    lab.run_all()
    lab.wait_all_done(NB_RUN_S)
    m = _metrics(lab, copy)
    assert m["checkpoint"] == str(on_checkpoint.resolve()) and not m["tokenizer"] and m["peak_rss_bytes"] > 0
    for _, panel in _panels(lab):
        for text, _, _ in _moves(lab, panel):
            assert "perplexity" not in "\n".join(_views(lab, panel)), text
    if name == "00_quickstart":
        assert lab.panels().count() == 1
        rows = m["slider_rows"]
        assert rows and all(r["ppl"] is None and r["method"] == "truncated" for r in rows)
        assert m["reference_row"]["method"] == "your checkpoint" and m["reference_row"]["agreement"] == 1.0
        lo, hi = m["slider_range"]
        assert lo < hi <= m["keep"] + 1e-9 and rows[0]["params"] <= m["params_checkpoint"]
    else:
        assert m["family"] == "dobi" and m["keep"] == pytest.approx(0.6) and not m["reference"]
        assert not any(s.startswith("dense_") and s != "dense_kv" for s in m["systems"]) and "engine" in m["systems"]
        assert m["per_token"]["naive"] > m["per_token"]["engine"] > 0
    lab.assert_clean()
    lab.save()
    nb = nbformat.read(lab.nbdir / f"{copy}.ipynb", as_version=4)
    assert NO_TOKENIZER in "\n".join(str(o.get("data", {}).get("text/plain", o.get("text", "")))
                                     for c in nb.cells for o in c.get("outputs", []))
    assert not output_problems(nb), f"{copy}: the saved notebook is not clean:\n" + "\n".join(output_problems(nb))


@pytest.mark.skipif(not os.environ.get("LOWRANK_LIB_BROWSER_TIMINGS"), reason="the timing run only")
def test_quickstart_slider_cold_then_warm(lab, timings):
    """The quickstart's slider from Run All, twice: cold (the whitened-SVD cache emptied; SmolLM2 already
    fetched) and warm (the same notebook reopened: the cache holds its calibration and factors). Per run: the
    first answer on screen, the first answer to a move (after the last cell), and that move's own time."""
    import shutil

    from lowrank_lib.compress.whitened import default_cache_dir

    name = "00_quickstart"
    shutil.rmtree(default_cache_dir(), ignore_errors=True)
    for kind in ("cold", "warm"):
        lab.new_page()
        t0 = time.time()
        lab.open(name)
        lab.run_all()
        first_view_s = _first_view(lab, t0)
        lab.wait_all_done(NB_RUN_S)
        last_output_s = time.time() - t0
        panel = lab.panels().first
        _, dt, _ = _move(lab, panel, panel.locator(".widget-slider").first)
        m = _metrics(lab, name)
        COLD_WARM[kind] = {"first_slider_view_s": first_view_s, "first_move_answer_s": time.time() - t0,
                           "move_s": dt, "slider_ready_s_in_kernel": m["slider_ready_s"],
                           "spectra_cache_hit": m["spectra_cache_hit"], "spectra_s": m["spectra_s"],
                           "last_output_s": last_output_s, "load_average_at_end": list(os.getloadavg())}
        timings.add(f"{name} {kind}: Run All to the slider's first answer", first_view_s)
        assert m["spectra_cache_hit"] == (kind == "warm")
    lab.shutdown_kernels()


def test_write_timings():
    """Last: the timing JSON of this session's notebook runs, when LOWRANK_LIB_BROWSER_TIMINGS asks for it."""
    path = os.environ.get("LOWRANK_LIB_BROWSER_TIMINGS")
    if not path:
        pytest.skip("LOWRANK_LIB_BROWSER_TIMINGS not set")
    from lowrank_lib.host import load_average

    out = {"written": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "load_average": load_average(),
           "cores": os.cpu_count(), "notebooks": TIMINGS, "quickstart_slider": COLD_WARM}
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
