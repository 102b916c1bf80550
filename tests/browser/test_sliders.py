"""Notebooks 04 and 00 in JupyterLab, as a person uses them: Run All, then every slider by keyboard and mouse.

Each wait looks for the expected output text (the kernel's busy/idle indicator is unreliable while widget
callbacks run). The values a widget prints are checked against the numbers the notebook wrote to its
``metrics.json``, which lands in the copy's own folder (outputs stay where the notebook runs).
"""
from __future__ import annotations

import json
import re
import time

import pytest

pytestmark = [pytest.mark.notebook, pytest.mark.smollm2, pytest.mark.slow]

OUT = ".widget-output"          # the explorers' Output widget
NB_RUN_S = 900                  # Run All of a CI-sized notebook on a busy 2-core machine
STEP_S = 240                    # one slider step


def _metrics(lab, name: str, timeout_s: float = 120) -> dict:
    path = lab.nbdir / "reports" / name / "metrics.json"
    deadline = time.time() + timeout_s
    while not path.exists():
        assert time.time() < deadline, f"{path} was not written (outputs must land next to the notebook copy)"
        time.sleep(0.5)
    time.sleep(0.5)
    return json.loads(path.read_text())


def _figure(loc, timeout_s: float = STEP_S) -> str:
    """The figure (img src) of the explorer output ``loc``, once drawn. An explorer clears its output, prints its
    line, then draws: after the line appears, the first figure under it belongs to the same redraw."""
    deadline = time.time() + timeout_s
    while True:
        img = loc.locator("img")
        if img.count() and (src := img.first.get_attribute("src")):
            return src
        assert time.time() < deadline, "no figure under the explorer's output"
        time.sleep(0.25)


def _new_figure(loc, before: str, timeout_s: float = STEP_S) -> str:
    """The figure under ``loc`` once it differs from ``before``: the printed line of a redraw can arrive before
    its image, so the first image seen may still be the old one for a moment (seen once on a loaded machine)."""
    deadline = time.time() + timeout_s
    while (src := _figure(loc, timeout_s)) == before:
        assert time.time() < deadline, "the figure did not change"
        time.sleep(0.25)
    return src


def _explorer_text(lab, layer: int, head: int, r: int):
    return lab.wait_text(OUT, rf"layer {layer}, KV head {head}, r = {r}:", STEP_S)


def _check_values(text: str, curves: dict, r: int):
    """The printed errors at r are the notebook's error curves at r (4 decimals)."""
    got = re.search(r"logit error aware ([\d.]+) / raw ([\d.]+); output error aware ([\d.]+) / raw ([\d.]+)", text)
    assert got, text
    want = [curves[k][r - 1] for k in ("logit_aware", "logit_raw", "output_aware", "output_raw")]
    assert [float(g) for g in got.groups()] == pytest.approx(want, abs=6e-5), (r, text)


def test_nb_04_rank_explorer(lab, timings):
    t0 = time.time()
    lab.open("04_attsvd_interpretability")
    lab.run_all()
    lab.wait_text(".jp-OutputArea-output", r"all \d+ heads at r = \d+", NB_RUN_S)
    timings.add("04 Run All (CI parameters)", time.time() - t0)
    m = _metrics(lab, "04_attsvd_interpretability")
    layer, head, r0, d, curves = m["layer"], m["head"], m["rank"], m["head_dim"], m["error_curves"]
    out = _explorer_text(lab, layer, head, r0)
    _check_values(lab.text(out), curves, r0)
    rank = lab.slider("rank r")
    assert lab.readout(rank) == str(r0)

    # keyboard: one step right
    before = _figure(out)
    t = time.time()
    lab.key(rank, "ArrowRight")
    out = _explorer_text(lab, layer, head, r0 + 1)
    timings.add("04 redraw after a key press", time.time() - t)
    assert lab.readout(rank) == str(r0 + 1)
    _check_values(lab.text(out), curves, r0 + 1)
    _new_figure(out, before)

    # mouse: drag the handle left; the output follows the value the readout shows
    t = time.time()
    lab.drag(rank, -60)
    r1 = int(lab.readout(rank))
    assert r1 < r0 + 1
    out = _explorer_text(lab, layer, head, r1)
    timings.add("04 redraw after a drag", time.time() - t)
    _check_values(lab.text(out), curves, r1)

    # typed into the readout: an odd rank between the old power-of-two samples has its own values
    lab.type_value(rank, "17")
    out = _explorer_text(lab, layer, head, 17)
    _check_values(lab.text(out), curves, 17)
    assert lab.readout(rank) == "17"

    # layer by keyboard, KV head by mouse: new heads are decomposed on demand
    lay = lab.slider("layer")
    l1 = layer - 1 if layer > 0 else layer + 1
    lab.key(lay, "ArrowLeft" if layer > 0 else "ArrowRight")
    out = _explorer_text(lab, l1, head, 17)
    assert lab.readout(lay) == str(l1)
    kv = lab.slider("KV head")
    before = _figure(out)
    lab.drag(kv, 200 if head == 0 else -200)
    h1 = int(lab.readout(kv))
    assert h1 != head
    out = _explorer_text(lab, l1, h1, 17)
    _new_figure(out, before)
    assert lab.readout(rank) == "17" and d >= 17
    lab.assert_clean()


def test_nb_00_keep_slider(lab, timings):
    t0 = time.time()
    lab.open("00_quickstart")
    lab.run_all()
    out = lab.wait_text(OUT, r"keep 0\.90 \(SVD-LLM v1\)[\s\S]*answer:", NB_RUN_S)
    timings.add("00 keep slider shows its first value after Run All", time.time() - t0)
    lab.wait_text(".jp-OutputArea-output", r"plain SVD keep 0\.9:", NB_RUN_S)
    timings.add("00 Run All (CI parameters)", time.time() - t0)
    m = _metrics(lab, "00_quickstart")
    first = m["slider_rows"][0]
    assert f"perplexity {first['ppl']:.2f}" in lab.text(out)
    keep = lab.slider("keep")
    assert lab.readout(keep) == "0.90"

    # keyboard: one step left -> 0.85, computed once
    before = _figure(out)
    t = time.time()
    lab.key(keep, "ArrowLeft")
    out = lab.wait_text(OUT, r"keep 0\.85 \(SVD-LLM v1\)[\s\S]*computed in", STEP_S)
    timings.add("00 step after a key press (compress + perplexity + answer)", time.time() - t)
    assert lab.readout(keep) == "0.85"
    _new_figure(out, before)

    # mouse: a long drag computes only where it is released (continuous_update=False)
    t = time.time()
    lab.drag(keep, -70)
    v = lab.readout(keep)
    assert float(v) < 0.85
    out = lab.wait_text(OUT, rf"keep {re.escape(v)} \(SVD-LLM v1\)", STEP_S)
    timings.add("00 step after a drag", time.time() - t)
    done = re.search(r"keeps computed so far: (.*)", lab.text(out)).group(1).split(", ")
    assert done == sorted({v, "0.85", "0.90"}), done

    # back to a keep seen before: shown from the cache
    t = time.time()
    lab.type_value(keep, "0.85")
    lab.wait_text(OUT, r"keep 0\.85 \(SVD-LLM v1\)[\s\S]*cached", STEP_S)
    timings.add("00 step to a cached keep", time.time() - t)
    lab.assert_clean()
