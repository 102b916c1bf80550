"""Every notebook on disk runs in CI; the runner plans parameters correctly; notebook 00's metrics."""
import json
import math
import os
import subprocess

import pytest

from lowrank_lib import notebooks


def test_ci_runs_every_notebook_on_disk():
    on_disk = set(notebooks.on_disk())
    listed = notebooks.read_params()["notebooks"]
    assert len(listed) == len(set(listed)), "duplicate notebook in ci.yaml"
    assert on_disk == set(listed), (f"not executed by CI: {sorted(on_disk - set(listed))}; "
                                    f"listed but missing: {sorted(set(listed) - on_disk)}")


def test_every_notebook_has_one_parameters_cell_with_shared_names():
    import nbformat

    for name in notebooks.on_disk():
        nb = nbformat.read(notebooks.notebooks_dir() / f"{name}.ipynb", as_version=4)
        tagged = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
        assert len(tagged) == 1, f"{name}: {len(tagged)} cells tagged parameters"
        declared = notebooks.declared_parameters(notebooks.notebooks_dir() / f"{name}.ipynb")
        for required in ("MODEL", "SEED", "OUT_DIR", "FIG_DIR"):
            assert required in declared, f"{name} does not declare {required}"
        assert all(k.isupper() for k in declared), f"{name}: parameter names must be UPPER_CASE"


def test_ci_plan_redirects_outputs_and_only_passes_declared():
    p = notebooks.plan("00_quickstart", ci=True)
    assert p["OUT_DIR"] == "reports/ci/00_quickstart" and p["FIG_DIR"] == "reports/ci/figures"
    assert p["SEQ_LEN"] == 256
    r = notebooks.plan("00_quickstart", ci=False)
    assert r == {"OUT_DIR": "reports/00_quickstart", "FIG_DIR": "figures"}


def test_quickstart_metrics(executed_notebook):
    m = executed_notebook("00_quickstart")
    assert m["full_rank_rel_err"] < 1e-5
    assert 5 < m["dense_ppl"] < 100
    ppl = m["ppl_by_keep"]
    assert all(math.isfinite(float(v)) for v in ppl.values())
    # plain SVD: less kept -> worse; both worse than dense
    keeps = sorted(ppl, key=float)
    assert ppl[keeps[0]] >= ppl[keeps[-1]] > m["dense_ppl"]
    # SVD-LLM v1 (the slider's compressor): usable where plain SVD collapses, at the same parameter counts
    llm = m["svdllm_ppl_by_keep"]
    assert set(llm) == set(ppl)
    for k in llm:
        assert math.isfinite(llm[k]) and llm[k] < ppl[k] / 100
    assert llm[keeps[-1]] < 5 * m["dense_ppl"] and llm[keeps[0]] >= llm[keeps[-1]]
    assert m["params_compressed"] < m["params_dense"]
    assert "Paris" in m["answer_dense"]
    # the slider rendered its first value (papermill runs a kernel, so the widget exists)
    rows = m["slider_rows"]
    assert [r["keep"] for r in rows] == [round(m["keep_ratio"], 4)] and math.isfinite(rows[0]["ppl"])
    assert rows[0]["params"] == m["params_compressed"]
    assert 0 < m["slider_ready_s"] < m["wall_s"]
    assert m["figures"] and all(f.endswith(".png") for f in m["figures"])
    sens = m["sensitivity_ppl"]
    assert set(sens) == {"dense", "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    # on SmolLM2 one type (v_proj) breaks plain SVD: at least one isolated truncation must hurt a lot
    assert max(sens.values()) > 2 * sens["dense"]


def test_paper_params_file_only_overrides_declared_names(tmp_path):
    p = notebooks.notebooks_dir() / "params" / "paper.yaml"
    for name in notebooks.read_params(p)["overrides"]:
        plan = notebooks.plan(name, ci=False, params_file=p)  # raises on undeclared names
        assert plan["OUT_DIR"] == f"reports/{name}" and plan["FIG_DIR"] == "figures"
    bad = tmp_path / "bad.yaml"
    bad.write_text("overrides:\n  00_quickstart:\n    NOT_A_PARAM: 1\n")
    with pytest.raises(ValueError, match=r"overrides \['NOT_A_PARAM'\] for 00_quickstart"):
        notebooks.plan("00_quickstart", ci=False, params_file=bad)


# --------------------------------------------------------------------------- where notebooks write
def _fig():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.plot([0, 1])
    return fig


def test_context_writes_relative_to_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(notebooks.REPORT_RUN_ENV, raising=False)
    ctx = notebooks.NotebookContext("reports/00_quickstart", "figures")
    assert ctx.savefig(_fig(), "00_x") is None          # no return value to show as a cell output
    assert ctx.write_metrics({"a": 1.5, "nan": float("nan")}) is None
    assert (tmp_path / "figures" / "00_x.png").stat().st_size > 0
    m = json.loads((tmp_path / "reports" / "00_quickstart" / "metrics.json").read_text())
    assert m["figures"] == ["figures/00_x.png"] and m["a"] == 1.5 and m["nan"] == "nan"
    assert ctx.metrics_path == tmp_path / "reports" / "00_quickstart" / "metrics.json"
    # written whole through a renamed temporary file (a reader polling for it never sees half), none left behind
    assert [p.name for p in ctx.metrics_path.parent.iterdir()] == ["metrics.json"]
    # nothing went to the checkout
    assert notebooks.root() not in ctx.fig_dir.parents and notebooks.root() not in ctx.out_dir.parents


def _git(cwd, *args):
    subprocess.run(["git", "-C", str(cwd), *args], check=True, capture_output=True,
                   env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                        "GIT_COMMITTER_EMAIL": "t@t"})


def test_context_refuses_to_overwrite_a_committed_file_outside_the_runner(tmp_path, monkeypatch):
    _git(tmp_path, "init", "-q")
    (tmp_path / "figures").mkdir()
    (tmp_path / "figures" / "00_x.png").write_bytes(b"committed")
    (tmp_path / "figures" / "00_untracked.png").write_bytes(b"scratch")
    _git(tmp_path, "add", "figures/00_x.png")
    _git(tmp_path, "commit", "-q", "-m", "fig")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(notebooks.REPORT_RUN_ENV, raising=False)
    ctx = notebooks.NotebookContext("out", "figures")
    with pytest.raises(FileExistsError, match=r"00_x\.png is a file committed to git"):
        ctx.savefig(_fig(), "00_x")
    assert (tmp_path / "figures" / "00_x.png").read_bytes() == b"committed"
    ctx.savefig(_fig(), "00_untracked")                 # an untracked file is the run's own output
    assert (tmp_path / "figures" / "00_untracked.png").read_bytes() != b"scratch"
    notebooks.NotebookContext("out", "figures", overwrite_tracked=True).savefig(_fig(), "00_x")
    assert (tmp_path / "figures" / "00_x.png").read_bytes() != b"committed"
    _git(tmp_path, "checkout", "--", "figures/00_x.png")
    monkeypatch.setenv(notebooks.REPORT_RUN_ENV, "1")   # what run() sets while papermill executes
    notebooks.NotebookContext("out", "figures").savefig(_fig(), "00_x")
    assert (tmp_path / "figures" / "00_x.png").read_bytes() != b"committed"


def test_report_run_env_is_scoped(monkeypatch):
    monkeypatch.delenv(notebooks.REPORT_RUN_ENV, raising=False)
    with notebooks._report_run():
        assert os.environ[notebooks.REPORT_RUN_ENV] == "1"
    assert notebooks.REPORT_RUN_ENV not in os.environ


def test_prepare_injects_ci_parameters_but_not_output_dirs(tmp_path):
    import nbformat

    out = notebooks.prepare("04_attsvd_interpretability", tmp_path)
    nb = nbformat.read(out, as_version=4)
    tags = [c.metadata.get("tags", []) for c in nb.cells]
    i = next(i for i, t in enumerate(tags) if "parameters" in t)
    assert "injected-parameters" in tags[i + 1]
    injected = nb.cells[i + 1].source
    assert "PROMPT_LEN = 256" in injected and "KEEP_RATIO = 0.5" in injected
    assert "OUT_DIR" not in injected and "FIG_DIR" not in injected
    assert not any(c.get("outputs") for c in nb.cells if c.cell_type == "code")   # prepared, not executed


# --------------------------------------------------------------------------- clean outputs
@pytest.mark.notebook
@pytest.mark.smollm2
@pytest.mark.parametrize("name", notebooks.on_disk())
def test_executed_outputs_are_clean(name):
    """No error, stderr, warning, stray return value, negative zero or U+FFFD in what the CI run shows (the
    browser tests' saved Run All when they ran, else the papermill copy), saved widget outputs included."""
    import nbformat
    import nbruns

    from lowrank_lib.notebooks.html import output_problems

    run = nbruns.get(name)
    bad = output_problems(nbformat.read(run.notebook, as_version=4))
    assert not bad, f"{name} ({run.how} run, {run.notebook}):\n" + "\n".join(bad)


# --------------------------------------------------------------------------- committed reports
#: reports that are stale on purpose, by name, with the reason (the test xfails them instead of failing); the
#: coordinator empties it when the reports are regenerated on an idle machine
STALE: dict[str, str] = {
}


@pytest.mark.parametrize("name", notebooks.on_disk())
def test_committed_report_is_fresh_and_clean(name):
    """reports/<name>.ipynb holds the notebook's current cells, cleanly executed, and reports/<name>.html was
    rendered from it (offline: ``lowrank_lib.notebooks.html``). Regenerate with ``make report``."""
    from lowrank_lib.notebooks.html import report_problems

    report = notebooks.root() / "reports" / f"{name}.ipynb"
    assert report.exists(), f"no committed report {report} (make report)"
    bad = report_problems(report, notebooks.notebooks_dir() / f"{name}.ipynb")
    if bad and name in STALE:
        pytest.xfail(f"{name}: {STALE[name]}")
    assert not bad, f"reports/{name}.ipynb:\n" + "\n".join(bad)
    assert name not in STALE, f"{name} is fresh: remove it from STALE"


def test_report_checks_catch_stale_and_dirty_reports(tmp_path):
    """The freshness / cleanliness checks fail on what they should: changed code, stderr, a stray value,
    a warning, a negative zero, a missing or foreign HTML."""
    import nbformat

    from lowrank_lib.notebooks.html import report_problems, to_html

    src = nbformat.v4.new_notebook()
    src.cells = [nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]}), nbformat.v4.new_code_cell("x")]
    rep = nbformat.v4.new_notebook()
    rep.cells = [nbformat.v4.new_code_cell("x = 1", metadata={"tags": ["parameters"]}),
                 nbformat.v4.new_code_cell("OUT_DIR = 'o'", metadata={"tags": ["injected-parameters"]}),
                 nbformat.v4.new_code_cell("x")]
    rep.cells[2].outputs = [nbformat.v4.new_output("display_data", data={"text/html": "<b>1</b>", "text/plain": "1"})]
    sp, rp = tmp_path / "n.ipynb", tmp_path / "r.ipynb"
    nbformat.write(src, sp)
    nbformat.write(rep, rp)
    assert report_problems(rp, sp) == ["no r.html beside the report (python -m lowrank_lib.notebooks html)"]
    to_html(rp)
    assert report_problems(rp, sp) == []
    cases = {
        "differs from the notebook": lambda nb: setattr(nb.cells[2], "source", "x + 1"),
        "stderr": lambda nb: nb.cells[2].outputs.append(nbformat.v4.new_output("stream", name="stderr", text="[x] done\n")),
        "stray return value": lambda nb: nb.cells[2].outputs.append(
            nbformat.v4.new_output("execute_result", data={"text/plain": "PosixPath('/x')"}, execution_count=1)),
        "a warning": lambda nb: nb.cells[2].outputs.append(nbformat.v4.new_output(
            "stream", name="stdout", text="a.py:1: FutureWarning: `past_key_values` is deprecated\n")),
        "negative zero": lambda nb: nb.cells[2].outputs.append(nbformat.v4.new_output(
            "display_data", data={"text/plain": "KL -0.0000 at 1.0"})),
        "not rendered from this": None,
    }
    for why, change in cases.items():
        nb = nbformat.read(rp, as_version=4)
        if change is not None:
            change(nb)
        nbformat.write(nb, rp)
        if change is not None:
            to_html(rp)                                  # a fresh HTML: only the change itself is wrong
        else:
            rp.write_text(rp.read_text() + " ")          # the ipynb changed after its HTML was written
        assert any(why in p for p in report_problems(rp, sp)), (why, report_problems(rp, sp))
        nbformat.write(rep, rp)
        to_html(rp)
