"""Your checkpoint through the notebooks (issue 28): CHECKPOINT in 00 to 06, a refused checkpoint stopping a notebook
at its first code cell, ``python -m lowrank_lib.notebooks run --checkpoint`` end to end.

Every family goes through notebook 01's, 02's and 05 / 06's library paths (01: ``checkpoint_rows``; 02: resolve,
describe, the systems' dispatch counts; 05 / 06: the continuation protocol and the engine serving AttSVD on the
compressed model) with and without a reference; ONE family runs through the real notebooks 00, 01, 02, 05 and 06
without a tokenizer or a reference (00 and 02 in JupyterLab: tests/browser/test_lab.py), and one (with both)
through 00, 01, 02 and 04 by the command: a papermill run per
family would cost minutes (each kernel ~12 s of imports alone)."""
import json
from pathlib import Path

import nbformat
import pytest
import torch
import yaml

from lowrank_lib import models, notebooks, synthetic
from lowrank_lib.notebooks import checkpoint as own
from lowrank_lib.notebooks.html import output_problems
from lowrank_lib.resolve import NO_TOKENIZER, describe, normalised_path, resolve_models, source_hash
from test_resolve import family_files, reference_dir  # noqa: F401 (fixtures: the families' small files, a reference)

NB00, NB01, NB02, NB04, NB05, NB06 = ("00_quickstart", "01_checkpoint_normalization", "02_launch_count_profiling",
                                      "04_attsvd_interpretability", "05_attsvd_quality_memory",
                                      "06_factor_space_attention")


def test_the_notebooks_taking_a_checkpoint_resolve_it_in_their_first_code_cell():
    """00 to 06 declare CHECKPOINT, and the first code cell after the parameters reads it (so a refused file stops the
    notebook there); the quick parameters name only what each declares. (07 reads a committed frontier of SmolLM2.)"""
    names = own.checkpoint_notebooks()
    assert names == [NB00, NB01, NB02, "03_graph_replay_ablation", NB04, NB05, NB06]
    for n in names:
        nb = nbformat.read(notebooks.notebooks_dir() / f"{n}.ipynb", as_version=4)
        code = [c for c in nb.cells if c.cell_type == "code"]
        assert "parameters" in code[0].metadata.get("tags", []) and "CHECKPOINT = None" in code[0].source
        reads = "checkpoint_rows(CHECKPOINT, MODEL" if n == NB01 else "resolve_models(MODEL, CHECKPOINT"
        assert reads in code[1].source, n
        p = own.plan(n, "x.pt", None, notebooks.root() / "reports" / "mine", "quick")
        assert p["CHECKPOINT"].endswith("/x.pt") and p["CHECKPOINT"].startswith("/") and p["MODEL"] is None
        assert p["OUT_DIR"].endswith(f"reports/mine/{n}") and p["FIG_DIR"].endswith("reports/mine/figures")
        assert own.plan(n, "x.pt", "smollm2", notebooks.root(), "full").keys() == {"CHECKPOINT", "MODEL", "OUT_DIR",
                                                                                   "FIG_DIR"}
        assert p.get("DTYPE", "fp32") == "fp32"        # auto on a file it cannot read: the notebook names the error


def test_quick_reports_load_a_checkpoint_too_large_for_fp32_copies_in_bf16(family_files, monkeypatch):  # noqa: F811
    """``DTYPE: auto`` (quick.yaml, 02 and 03) becomes the dtype ``resolve_models`` loads the file in, so the
    runners share the loaded model instead of each casting a copy."""
    from lowrank_lib import resolve

    path = family_files["svdllm"]
    for mem, want in ((1 << 50, "fp32"), (1, "bf16")):
        monkeypatch.setattr(resolve.host, "physical_memory", lambda m=mem: m)
        for n in (NB02, "03_graph_replay_ablation"):
            assert own.plan(n, path, None, notebooks.root() / "reports" / "mine", "quick")["DTYPE"] == want
        assert resolve.load_dtype(path) == {"fp32": torch.float32, "bf16": torch.bfloat16}[want]


@pytest.mark.parametrize("family", synthetic.FAMILIES)
def test_every_family_through_notebook_02s_library_path(family_files, reference_dir, family):  # noqa: F811
    """What notebook 02 does with a checkpoint, for every family: resolve (with the tiny reference and without),
    what it says it ran on, and the dispatch count of each system it runs (the uncompressed ones only with a
    reference)."""
    from lowrank_lib.runtime.baselines import make_runner
    from lowrank_lib.runtime.profiling import DISPATCH_TOKENS, per_token_counts

    path = family_files[family]
    ids = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))
    for model in (None, reference_dir["with"]):
        resolved = resolve_models(model, path)
        dense, comp, tok = resolved
        info = describe(model, path, resolved)
        assert info["reference"] == (model is not None) and info["checkpoint"] == str(path)
        assert (info["banner"] is None) == (tok is not None)
        systems = ["naive", "engine", "hf_static"] + (["dense_engine"] if dense is not None else [])
        counts = {s: per_token_counts(make_runner(s, comp, dense, dtype=torch.float32,
                                                  max_seq_len=16 + DISPATCH_TOKENS + 2), ids)["total"]
                  for s in systems}
        assert all(v > 0 for v in counts.values()), counts
        assert counts["naive"] > counts["engine"], counts
        if dense is None:
            with pytest.raises(ValueError, match="needs the uncompressed model"):
                make_runner("dense_engine", comp, dense)


@pytest.mark.parametrize("family", synthetic.FAMILIES)
def test_every_family_through_notebook_01s_library_path(family_files, reference_dir, family):  # noqa: F811
    """What notebook 01 does with a checkpoint, for every family: its row (and the reference's), the normalised
    copy equal to the native file, the comparison with the reference only when one is given, perplexity only with a
    tokenizer, the dense size the checkpoint's own accounting gives equal to the reference's measured one."""
    from lowrank_lib.eval.quality import QualityConfig, checkpoint_rows

    path = family_files[family]
    cfg = QualityConfig(model=None, keeps=(), families=(), seq_len=32, max_windows=1, progress=False)
    for model in (None, reference_dir["with"], reference_dir["bare"]):
        res = checkpoint_rows(path, model, cfg, probe_len=16)
        rows = res["rows"]
        mine = rows[-1]
        assert [r["family"] for r in rows] == (["dense"] if model is not None else []) + [mine["family"]]
        assert mine["family"] == synthetic.families_format(family) and mine["format"] == mine["family"]
        assert mine["path"] == str(path) and mine["disk_bytes"] > 0 and mine["factorized"] > 0
        assert mine["roundtrip_rel_err"] < 1e-6, mine["roundtrip_rel_err"]
        has_tok = model != reference_dir["bare"] and (model is not None or family_tokenizer(path))
        assert res["config"]["tokenizer"] == bool(has_tok)
        assert (mine["ppl"] is not None) == bool(has_tok) and (mine["ppl"] is None or mine["ppl"] > 1)
        assert ("ref_logit_rel_err" in mine) == (model is not None)
        if model is not None:
            assert rows[0]["total_params"] == mine["dense_params"]
            assert 0 <= mine["ref_top1_agree"] <= 1 and mine["ref_logit_rel_err"] > 0


@pytest.mark.parametrize("family", synthetic.FAMILIES)
def test_every_family_through_notebook_05_and_06s_library_path(family_files, reference_dir, family):  # noqa: F811
    """What notebooks 05 and 06 do with a checkpoint, for every family, with the tiny reference and without: the
    windows (WikiText-2 through the tokenizer, else seeded random ids), the continuation protocol of the AttSVD cache
    read in factor space and rebuilt (the same function: equal per-window NLL; perplexity only with text), and the
    runtime Engine serving the AttSVD method on the compressed model."""
    from lowrank_lib.eval.factor_space import bench_engine
    from lowrank_lib.eval.kvquality import continuation_by_rank, eval_windows

    path = family_files[family]
    for model in (None, reference_dir["bare"]):
        _, comp, tok = resolve_models(model, path)
        vocab = comp.config.vocab_size
        w = eval_windows(tok, 2, 24, vocab, seed=1)
        assert w.shape == (2, 24) and int(w.max()) < vocab
        assert torch.equal(w, eval_windows(tok, 2, 24, vocab, seed=1))
        q = continuation_by_rank(comp, tok, [1.0, 0.5], prefill_len=32, cont_len=8, n_windows=1, window=4,
                                 progress=False)
        ident = q["identity"]
        assert q["text"] == (tok is not None) and q["factor_calls"] > 0 and q["rebuild_calls"] > 0
        assert ident["max_window_nll_diff"] < 1e-4 and abs(q["rows"][0]["kl"]) < 1e-4      # full rank: exact
        assert all((r["ppl"] is None) == (tok is None) for r in q["rows"])
        assert (ident["ppl_rel_diff"] is None) == (tok is None)
        rows = bench_engine(comp, tok, [24], [0.5], window=4, gen_tokens=2, progress=False, runs=1)
        assert {r["route"] for r in rows} == {"engine_dense", "engine_factor"}
        assert all(r["ms_token"] > 0 and len(r["tokens"]) == len(rows[0]["tokens"]) > 2 for r in rows)
        factor = next(r for r in rows if r["route"] == "engine_factor")
        assert 0 < factor["attsvd_ratio"] < 1.2


def family_tokenizer(path) -> bool:
    from lowrank_lib.resolve import checkpoint_tokenizer

    return checkpoint_tokenizer(path) is not None


def test_notebook_01s_roundtrip_check_catches_a_damaged_normalised_copy(family_files, tmp_path):  # noqa: F811
    """The roundtrip error of a checkpoint's row compares two real reads: damage one tensor of the normalised copy in
    the model cache and the next row (which reads that copy) shows it; a reference of another geometry is refused."""
    from safetensors.torch import load_file, save_file

    from lowrank_lib.eval.quality import QualityConfig, checkpoint_rows

    path = family_files["svdllm"]
    cfg = QualityConfig(model=None, keeps=(), families=(), seq_len=32, max_windows=1, progress=False)
    entry = normalised_path(source_hash(path), torch.float32)
    checkpoint_rows(path, None, cfg, probe_len=16)                      # writes (or finds) the normalised copy
    files = sorted(entry.glob("*.safetensors"))
    assert files
    f = files[0]
    import json as _json
    import struct

    head = _json.loads(f.read_bytes()[8:8 + struct.unpack("<Q", f.read_bytes()[:8])[0]])
    tensors = load_file(f)
    name = next(k for k in tensors if "layers.0" in k and tensors[k].dim() == 2)
    tensors[name] = tensors[name] * 1.5
    save_file(tensors, f, metadata=head.get("__metadata__"))
    try:
        row = checkpoint_rows(path, None, cfg, probe_len=16)["rows"][-1]
        assert row["normalised_cache_hit"] and row["roundtrip_rel_err"] > 1e-3, row["roundtrip_rel_err"]
    finally:
        import shutil

        shutil.rmtree(entry, ignore_errors=True)
    other = tmp_path / "other"
    models.tiny_model("tiny-gqa", **{**synthetic.SHAPES["quick"], "hidden_size": 96}).save_pretrained(other)
    with pytest.raises(ValueError, match="not its dense model"):
        checkpoint_rows(path, other, cfg)


def _ci_params(name, tmp_path, **extra):
    p = {**notebooks.plan(name, ci=True), "OUT_DIR": str(tmp_path / name), "FIG_DIR": str(tmp_path / "figures")}
    p.update(extra)
    return p


def _outputs(nb) -> str:
    return "\n".join(str(o.get("data", {}).get("text/plain", o.get("text", ""))) for c in nb.cells
                     for o in c.get("outputs", []))


@pytest.mark.notebook
@pytest.mark.parametrize("name", [NB01])
def test_notebooks_00_and_01_on_a_checkpoint_without_tokenizer_or_reference(family_files, tmp_path, name):  # noqa: F811
    """The real notebooks 00 (the slider on the file's own factors) and 01 (the tour of the file) at CI size on a
    Dobi file alone: the banner, no perplexity anywhere, clean output; 00 compares with the checkpoint as stored.
    00 (and 02) on such a file run in JupyterLab instead (``tests/browser/test_lab.py::test_run_all_on_a_checkpoint``,
    the same checks); a papermill run here as well would cost CI a kernel each."""
    path = family_files["dobi"]
    out_nb = tmp_path / f"{name}.ipynb"
    m = notebooks.papermill_run(name, out_nb, _ci_params(name, tmp_path, MODEL=None, CHECKPOINT=str(path)),
                                progress=False, tracked=False)
    assert m["checkpoint"] == str(path) and not m["tokenizer"] and m["peak_rss_bytes"] > 0
    if name == NB00:
        rows = m["slider_rows"]
        assert rows and all(r["ppl"] is None and r["method"] == "truncated" for r in rows)
        assert m["reference_row"]["method"] == "your checkpoint" and m["reference_row"]["agreement"] == 1.0
        lo, hi = m["slider_range"]
        assert lo < hi <= m["keep"] + 1e-9 and rows[0]["params"] <= m["params_checkpoint"]  # starts at most at the file
    else:
        assert m["ppl"] == {"dobi@0.6": None} and m["roundtrip_rel_err"]["dobi@0.6"] < 1e-6
        assert m["reference"] is None and not m["ref_logit_rel_err"]
    nb = nbformat.read(out_nb, as_version=4)
    assert NO_TOKENIZER in _outputs(nb)
    assert output_problems(nb) == []


@pytest.mark.notebook
@pytest.mark.parametrize("name", [NB05, NB06])
def test_notebooks_05_and_06_on_a_checkpoint_without_tokenizer_or_reference(family_files, tmp_path, name):  # noqa: F811
    """The real notebooks 05 (every KV cache) and 06 (factor-space attention) at CI size on a Dobi file alone: the
    banner, random ids, no perplexity stored or shown, the committed SmolLM2 frontier skipped (05), clean output."""
    path = family_files["dobi"]
    out_nb = tmp_path / f"{name}.ipynb"
    m = notebooks.papermill_run(name, out_nb, _ci_params(name, tmp_path, MODEL=None, CHECKPOINT=str(path)),
                                progress=False, tracked=False)
    assert m["checkpoint"] == str(path) and not m["tokenizer"] and m["label"].startswith(path.name)
    assert m["headline"]["model"] == m["label"]
    if name == NB05:
        assert m["ppl_dense"] is None and set(m["ppl"].values()) == {None} and m["frontier"] is None
        assert not any("ppl" in k for k in m["targets_50pct"]) and m["kl"]
    else:
        q = m["continuation"]
        assert q["ppl_dense"] is None and all(r["ppl"] is None for r in m["quality_rows"])
        assert q["identity"]["max_window_nll_diff"] < 1e-4 and m["decode_tokens_equal"]
    nb = nbformat.read(out_nb, as_version=4)
    text = _outputs(nb)
    assert NO_TOKENIZER in text
    assert "perplexity" not in text.replace(NO_TOKENIZER, "").replace("no perplexity", "")
    assert output_problems(nb) == []


@pytest.mark.notebook
def test_an_unreadable_checkpoint_stops_the_notebook_at_its_first_code_cell(family_files, tmp_path):  # noqa: F811
    import papermill as pm

    good = family_files["svdllm"]
    bad = tmp_path / good.name
    bad.write_bytes(good.read_bytes()[: good.stat().st_size // 2])              # truncated
    out_nb = tmp_path / f"{NB02}.ipynb"
    with pytest.raises(pm.PapermillExecutionError) as e:
        notebooks.papermill_run(NB02, out_nb, _ci_params(NB02, tmp_path, MODEL=None, CHECKPOINT=str(bad)),
                                progress=False, tracked=False)
    assert e.value.ename == "CheckpointError" and str(bad) in e.value.evalue
    nb = nbformat.read(out_nb, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    tags = [c.metadata.get("tags", []) for c in code]
    assert "parameters" in tags[0] and "injected-parameters" in tags[1]
    first = code[2]                                          # the notebook's first code cell after its parameters
    assert [o.get("ename") for o in first.outputs if o.output_type == "error"] == ["CheckpointError"]
    assert all(c.execution_count is None for c in code[3:])


@pytest.mark.notebook
def test_the_command_reports_on_a_checkpoint(family_files, reference_dir, tmp_path, capsys):  # noqa: F811
    """``run 01 04 --checkpoint --model --params --out`` on an ASVD folder with its reference (and the
    reference's tokenizer): HTML + index, one table naming the model with each kernel's peak RSS, the checkpoint
    normalised once: by the first notebook, the second reads the normalised copy. 00, 02 and 03 on a checkpoint are
    not run here (each kernel costs ~10 s of imports; 00 and 02 run on a checkpoint in ``tests/browser/test_lab.py``,
    without a tokenizer or reference 01, 05 and 06 above)."""
    import shutil

    small = {"parameters": {"SEED": 0, "CI": True},          # smaller than ci.yaml
             "overrides": {NB01: {"SEQ_LEN": 64, "EVAL_WINDOWS": 1},
                           NB04: {"PROMPT_LEN": 48, "GEN_LEN": 8, "KEEP_RATIO": 0.5}}}
    params = tmp_path / "small.yaml"
    params.write_text(yaml.safe_dump(small))
    path, out = family_files["asvd"], tmp_path / "mine"
    shutil.rmtree(normalised_path(source_hash(path), torch.float32), ignore_errors=True)   # from an earlier run
    names = [NB01, NB04]
    rc = notebooks.main(["run", *names, "--checkpoint", str(path), "--model", str(reference_dir["with"]),
                         "--params", str(params), "--out", str(out), "--no-progress"])
    table = capsys.readouterr().out
    assert rc == 0, table
    for n in names:
        assert f"{n}: on {path.name} (asvd, keep 0.60)" in table, table
        assert f"(reference {reference_dir['with']}, tokenizer yes" in table, table
        assert (out / f"{n}.html").is_file()
        nb = nbformat.read(out / f"{n}.ipynb", as_version=4)
        assert output_problems(nb) == [], n
        m = json.loads((out / n / "metrics.json").read_text())
        assert m["checkpoint"] == str(path.resolve()) and m["tokenizer"] and m["peak_rss_bytes"] > 0
        assert m["cache_hit"] == (n != names[0]), n                    # normalised by the first notebook only
    assert "peak RSS" in table
    assert f"index: {out / 'index.html'}" in table and all(f"{n}.html" in (out / "index.html").read_text()
                                                           for n in names)


def test_the_command_refuses_what_it_cannot_run(tmp_path, capsys):
    with pytest.raises(SystemExit):
        notebooks.main(["run", "--checkpoint", "x.pt"])                  # no --out
    with pytest.raises(SystemExit):
        notebooks.main(["run", "--ci", "--checkpoint", "x.pt", "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="committed reports' folder"):
        own.run("x.pt", notebooks.root() / "reports")
    with pytest.raises(ValueError, match="does not take CHECKPOINT"):
        notebooks.prepare("07_lowrank_vs_quantization", tmp_path, checkpoint="x.pt")


def test_a_copy_prepared_on_a_checkpoint_runs_on_it(tmp_path):
    """``prepare NAME DIR --checkpoint PATH [--model M]``: the copy's injected cell names the file (absolute) and the
    reference, on top of the CI parameters; without --checkpoint nothing of it is injected."""
    assert notebooks.main(["prepare", NB05, str(tmp_path / "a"), "--checkpoint", "x.pt", "--model", "smollm2"]) == 0
    notebooks.prepare(NB05, tmp_path / "b")
    for sub, checkpoint, model in (("a", str(Path("x.pt").resolve()), "smollm2"), ("b", None, "smollm2")):
        nb = nbformat.read(tmp_path / sub / f"{NB05}.ipynb", as_version=4)
        cell = next(c for c in nb.cells if "injected-parameters" in c.metadata.get("tags", []))
        env = {}
        exec(cell.source, env)
        assert env.get("CHECKPOINT") == checkpoint and env["MODEL"] == model and env["PROMPT_LEN"] == 160
