"""Peak memory of a load, measured as the peak RSS of a child process: every family at 200-400 MB (Dobi remap also
served from its codes, int8), the cheap refusal.

Files of every family are written at the ``test`` shape of ``lowrank_lib.synthetic`` (hidden 1024, 8
layers, vocabulary 16 000: 150-420 MB in the families' native dtypes, random weights) plus the SVD-LLM
and Dobi whole-model pickles as their original code saved them under transformers 4.35 / 4.37
(``tests/legacy_checkpoints.py``; the SVD-LLM one in the pre-1.6 container), then loaded one after another in ONE
child (its peak RSS reset before each load: ``/proc/self/clear_refs``). Each load must stay within the
contract of issue 20, ``peak - baseline <= 1.15 x model + 0.5 GB``, and, so that a regression to a
second copy of the model fails here rather than hiding in the 0.5 GB, within ``1.15 x model + 160 MB``
(the old loader peaked at 1.65x the model). The refused pickle of the same size must cost under
64 MB (it used to read the whole file) and well under 2 s. ``python -m lowrank_lib.bench load
--quick`` is run as the benchmark's own test.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowrank_lib import synthetic as S
from lowrank_lib.bench import load as L

ROOT = Path(__file__).resolve().parents[1]
MB = 1 << 20
pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux /proc")


def _random(model, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.uniform_(-0.02, 0.02, generator=g)            # writes the zero pages: real values
    return model


def _legacy_pickles(folder: Path) -> list[Path]:
    """SVD-LLM (transformers 4.35, pre-1.6 container: storages at unaligned offsets) and Dobi (4.37, zip,
    cuda:0 tags) whole-model pickles at the test shape, random weights."""
    from legacy_checkpoints import dobi_pickle, svdllm_pickle

    out = [svdllm_pickle(_random(S.placeholder_model("test", "svdllm", 0.8), 0), folder / "legacy_pre16", keep=0.8,
                         zipfile_format=False)[0]]
    dm = _random(S.placeholder_model("test", "dobi", 0.8), 1)
    out.append(dobi_pickle(dm, folder / "DobiSVD_Noremapping-test-0.8")[0].parent)
    return out


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    d = tmp_path_factory.mktemp("loadmem")
    legacy = [{"family": f"legacy:{p.name}", "shape": "test", "path": p, "file_bytes": L.file_bytes(p)}
              for p in _legacy_pickles(d / "legacy")]                 # loaded in the same child as the others
    return L.run_rows("test", list(S.FAMILIES), {"svdllm": ["stored", "float32", "bfloat16"],
                                                  "dobi-remap": ["stored", "int8"]}, d / "native",
                      one_child_per_row=False, log=lambda s: None, extra=legacy)


def test_every_family_loads_within_the_memory_contract(loaded):
    ok = [r for r in loaded if not r["refusal"]]
    assert len(ok) == len(S.FAMILIES) + 2 + 1 + 2, [r["family"] for r in ok]
    for r in ok:
        assert r["ok"], r
        assert r["reset_peak"], "the peak RSS could not be reset between loads"
        name = f"{r['family']} {r['dtype']}"
        assert 150 * MB <= r["file_bytes"] <= 420 * MB, (name, r["file_bytes"] / MB)
        assert r["within_rss_limit"], (name, r["peak_over_baseline"] / MB, r["rss_limit"] / MB)
        assert r["peak_over_baseline"] <= 1.15 * r["model_bytes"] + 160 * MB, \
            (name, "peak - baseline MB", r["peak_over_baseline"] / MB, "model MB", r["model_bytes"] / MB)


def test_dtype_rows_hold_the_asked_dtype(loaded):
    by = {(r["family"], r["dtype"]): r for r in loaded if r.get("ok")}
    # Dobi remap served from its codes (int8 codes + fp16 scales): a smaller model than the widened fp16 one (its peak
    # is held to the contract by the test above, like every row; the two peaks are not compared: in one child each
    # load's baseline holds what the loads before it left in the allocator, and the served peak measured 53-155 MB,
    # the widened one 155-256 MB, once the served above the widened)
    served, widened = by["dobi-remap", "int8"], by["dobi-remap", "stored"]
    assert served["model_bytes"] < 0.8 * widened["model_bytes"]
    assert set(by["svdllm", "stored"]["dtypes"]["loaded"]) == {"float32", "float16"}
    assert set(by["svdllm", "float32"]["dtypes"]["loaded"]) == {"float32"}
    assert set(by["svdllm", "bfloat16"]["dtypes"]["loaded"]) == {"bfloat16"}
    assert by["svdllm", "bfloat16"]["model_bytes"] < 0.55 * by["svdllm", "float32"]["model_bytes"]


def test_a_refused_pickle_costs_its_pickle_only(loaded):
    (r,) = [r for r in loaded if r["refusal"]]
    assert not r["ok"] and r["error"] == "UnsafePickleError" and ".print'" in r["message"], r
    assert r["file_bytes"] > 250 * MB
    assert r["peak_rss"] - r["baseline_rss"] < 64 * MB, (r["peak_rss"] - r["baseline_rss"]) / MB
    assert r["wall_s"] < 2.0


def test_bench_load_quick(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "lowrank_lib.bench", "load", "--quick", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (f,) = tmp_path.glob("load_quick_*.json")
    res = json.loads(f.read_text())
    fams = {r["family"] for r in res["rows"] if r.get("ok")}
    assert fams == set(S.FAMILIES)
    assert all(r["within_rss_limit"] for r in res["rows"] if r.get("ok"))
    assert res["copy_bandwidth_GBps"] > 0 and res["load_average"]["start"] is not None
    assert (tmp_path / f.name.replace(".json", ".md")).exists()
