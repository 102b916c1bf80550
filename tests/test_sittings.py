"""Targets across sittings (``lowrank_lib.eval.sittings``, ``bench sittings``) and the kv-decode targets as data
(``lowrank_lib.eval.kv_decode.targets``): which verdicts are read from which file, how they group, and the README's
table of every committed sitting, recomputed from the committed JSONs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowrank_lib.eval.kv_decode import SPEED_CONTEXT, SPEED_TARGETS, targets
from lowrank_lib.eval.sittings import across, sitting, sittings, table

ROOT = Path(__file__).resolve().parents[1]


def _kv_row(system, budget, speedup, threads=1, context=SPEED_CONTEXT, dtype="bfloat16", gemv="lrk_avx512"):
    return {"system": system, "budget": budget, "context": context, "threads": threads, "dtype": dtype,
            "speedup_vs_dense": speedup, "gemv": gemv}


def _verdict(target, measured, met, threads=1, issue=29, system="lowrank_lib_lowrank"):
    return {"shape": "smollm2", "system": system, "dtype": "bf16", "keep": 0.5, "lm_head": "exact",
            "threads": threads, "factor_bits": None, "target": target, "key": "roofline_x", "op": "<=",
            "bound": 1.3, "issue": issue, "measured": measured, "met": met}


def _write(folder: Path, name: str, res: dict) -> None:
    (folder / name).write_text(json.dumps(res))


def test_kv_decode_targets_apply_to_composed_rows_at_the_context_only():
    bounds = dict(SPEED_TARGETS)
    rows = [_kv_row("dense", None, 1.0), _kv_row("composed-kvzip-q8", 0.5, 1.15),
            _kv_row("composed-kvzip-q8", 0.25, 1.299, threads=2),
            _kv_row("composed-kvzip-q8", 0.125, 1.5, context=4000),
            _kv_row("kvzip", 0.5, 2.0), _kv_row("composed-kvzip-q8", 0.3, 2.0)]
    got = targets(rows, "smollm2")
    assert [(t["budget"], t["threads"], t["bound"], t["met"]) for t in got] == [(0.5, 1, bounds[0.5], True),
                                                                               (0.25, 2, bounds[0.25], False)]
    assert {t["issue"] for t in got} == {29} and {t["shape"] for t in got} == {"smollm2"}
    assert got[0]["target"] == "composed_speedup_b0.5" and got[1]["target"] == "composed_speedup_b0.25"


def test_sittings_read_each_kind_group_by_row_and_keep_time_order(tmp_path):
    machine = {"cpu": "AMD EPYC"}
    _write(tmp_path, "peer_cpu_2.json", {"written": "2026-01-02T00:00:00Z", "machine": machine,
                                         "copy_bandwidth_GBps_by_threads": {"1": 30.0, "2": 44.0},
                                         "rows": [{"system": "lowrank_lib_lowrank", "gemv": "lrk_avx512"}],
                                         "targets": [_verdict("lowrank_roofline_1t", 1.35, False),
                                                     _verdict("lowrank_roofline_1t", 1.2, True, threads=2),
                                                     _verdict("other", 1.0, True, issue=22)]})
    _write(tmp_path, "peer_cpu.json", {"written": "2026-01-01T00:00:00Z", "machine": machine,   # older, written first
                                       "copy_bandwidth_GBps_by_threads": {"1": 25.0},
                                       "rows": [{"system": "lowrank_lib_lowrank", "gemv": "lrk_avx512"}],
                                       "targets": [_verdict("lowrank_roofline_1t", 1.25, True),
                                                   {"dtype": "bf16", "threads": 1, "target": "old", "bound": 1.0,
                                                    "measured": 2.0, "met": True}]})        # no system: skipped
    rows = [_kv_row("dense", None, 1.0, dtype=None, gemv="lrk_avx2"), _kv_row("composed-kvzip-q8", 0.5, 1.2,
                                                                             dtype=None, gemv="lrk_avx2")]
    for r in rows:
        del r["dtype"]                                                                  # the fp32-era files
    _write(tmp_path, "kv_decode_3.json", {"written": "2026-01-03T00:00:00Z", "machine": machine, "copy_gbs": 20.0,
                                          "config": {"model": "smollm2"}, "kernel_isa": {"limit": "avx2"},
                                          "rows": rows})
    _write(tmp_path, "kv_decode.json", {"written": "2026-01-00T00:00:00Z", "rows": [{"store": "dense"}]})
    _write(tmp_path, "frontier_smollm2.json", {"written": "2026-01-04T00:00:00Z", "targets": [_verdict("x", 1, 1)]})

    sits = sittings(tmp_path)
    assert [s["file"] for s in sits] == ["kv_decode.json", "peer_cpu.json", "peer_cpu_2.json", "kv_decode_3.json"]
    assert sits[0]["verdicts"] == [] and len(sits[1]["verdicts"]) == 1
    assert sits[3]["host"] == "AMD EPYC, AVX2 (ISA limited to avx2)" and sits[2]["host"] == "AMD EPYC, AVX-512"
    kv = sits[3]["verdicts"][0]
    assert (kv["dtype"], kv["copy_gbs"], kv["met"], kv["shape"]) == ("float32", 20.0, True, "smollm2")

    groups = across(sits)
    one = next(g for g in groups if g["target"] == "lowrank_roofline_1t" and g["threads"] == 1)
    assert (one["n"], one["met"], one["low"], one["high"]) == (2, 1, 1.25, 1.35)
    assert [m["file"] for m in one["measured"]] == ["peer_cpu.json", "peer_cpu_2.json"]
    assert [m["copy_gbs"] for m in one["measured"]] == [25.0, 30.0]
    assert one["latest"] == {"file": "peer_cpu_2.json", "value": 1.35, "met": False, "copy_gbs": 30.0}
    two = next(g for g in groups if g["target"] == "lowrank_roofline_1t" and g["threads"] == 2)
    assert (two["n"], two["met"], two["latest"]["copy_gbs"]) == (1, 1, 44.0)
    assert {g["target"] for g in across(sits, issues=(29,))} == {"lowrank_roofline_1t", "composed_speedup_b0.5"}
    assert {g["target"] for g in across(sits, issues=(30,), targets=("other",))} == {"other"}

    md = table(across(sits, issues=(29,)))
    assert ("| 29 | lowrank_roofline_1t <= 1.3 | AMD EPYC, AVX-512 | smollm2, lowrank, keep 0.5, bf16, 1 thr | "
            "1 of 2 | 1.250 / 1.300 / 1.350 | 1.350 (NOT met, `peer_cpu_2.json`) |") in md
    assert "smollm2, composed-kvzip-q8, budget 0.5, fp32, 1 thr | 1 of 1" in md


def test_a_file_that_is_not_json_names_itself(tmp_path):
    (tmp_path / "peer_cpu_9.json").write_text("{not json")
    with pytest.raises(ValueError, match="peer_cpu_9.json"):
        sitting(tmp_path / "peer_cpu_9.json")


def test_bench_sittings_writes_the_table(tmp_path, capsys):
    from lowrank_lib.bench.cli import main

    _write(tmp_path, "kv_decode_2.json", {"written": "2026-01-03T00:00:00Z", "machine": {"cpu": "X"}, "copy_gbs": 20.0,
                                          "config": {"model": "smollm2"},
                                          "rows": [_kv_row("composed-kvzip-q8", 0.125, 1.39)]})
    out = tmp_path / "out"
    assert main(["sittings", "--results", str(tmp_path), "--issues", "29", "--out", str(out)]) == 0
    res = json.loads((out / "sittings.json").read_text())
    assert res["files"] == ["kv_decode_2.json"] and res["groups"][0]["met"] == 0
    assert "composed_speedup_b0.125 >= 1.4 | X, AVX-512 |" in (out / "sittings.md").read_text()
    assert "NOT met" in capsys.readouterr().out


#: the README's table of issues 29 and 30 (and issue 22's certified head, which issue 30 restates) across sittings
README_ANCHOR = "### Issues 29 and 30 across every sitting"


def test_readme_table_is_every_committed_sitting():
    text = (ROOT / "README.md").read_text()
    assert README_ANCHOR in text, "the README lost its sittings section"
    section = text.split(README_ANCHOR, 1)[1]
    assert "`python -m lowrank_lib.bench sittings --issues 29 30 --targets certified_speedup" in section
    lines = section.split("\n")
    first = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    shown = lines[first:next((i for i in range(first, len(lines)) if not lines[i].startswith("|")), len(lines))]
    want = table(across(sittings(ROOT / "benchmarks" / "results"), issues=(29, 30), targets=("certified_speedup",)))
    assert "\n".join(shown) == want, ("the README's sittings table is not the committed results': rerun `python -m "
                                      "lowrank_lib.bench sittings --issues 29 30 --targets certified_speedup` and "
                                      "paste its table")
