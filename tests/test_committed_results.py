"""The committed measurements: ``benchmarks/results/*.json`` and the README tables that cite them.

Three kinds of check, all on the committed files (no benchmark runs here):

- schema: every committed peer / peer-scale result holds what its issue asks for;
- verdicts: every target's ``met`` is what its ``measured`` and ``bound`` say (direction from the recorded ``op``,
  or, in files written before ``op`` was recorded, from the target's name: a speed-up must reach its bound, a
  ratio of times or a roofline factor must stay under it), and ``measured`` is what the rows say; the same for the
  pass flags of the KV-memory frontier and the AttSVD acceptance checks;
- the README: every number of the tables that cite a committed JSON (the peer tables, the kv-decode table, the
  load table, the peer-scale tables, the SVD perplexity and checkpoint-family tables, the KV-memory frontier)
  equals the JSON's, rounded as printed.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lowrank_lib.bench import peer, peer_base
from lowrank_lib.eval.kv_decode import SPEED_TARGETS

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"


def _committed(pattern: str = "peer_cpu*.json"):
    return sorted(RESULTS.glob(pattern))


def _load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


# --------------------------------------------------------------------------- schema (moved from test_bench_peer.py)
@pytest.mark.parametrize("p", _committed(), ids=lambda p: p.name)
def test_committed_result_has_the_schema(p):
    """Every committed benchmarks/results/peer_cpu*.json (from a real run) holds what the issue asks for."""
    res = json.loads(p.read_text())
    assert res["rows"] and isinstance(res["copy_bandwidth_GBps"], float) and res["command"].startswith("python -m")
    for r in res["rows"]:
        assert set(peer.ROW_KEYS) <= set(r) and r.get("lm_head", "exact") in peer.LM_HEADS
        assert r["system"] in peer.SYSTEMS and r["threads"] >= 1
        # llama.cpp's quantized files (issue 29) beside the fp32 / bf16 rows; quantized factors are bf16 rows
        assert r["dtype"] in ("fp32", "bf16") or (r["system"] in peer_base.GGUF_SYSTEMS and r["dtype"] in ("q8_0", "q4_k_m"))
        assert r.get("factor_bits") in (None, 8, 4) and (not r.get("factor_bits") or r["dtype"] == "bf16")
        assert r["decode_ms_per_token"] > 0 and r["prefill_ms"] > 0 and r["weight_bytes_per_token"] > 0
    assert set(peer_base.DEFAULT_SYSTEMS) <= {r["system"] for r in res["rows"]}      # ik_llamacpp: when asked for
    if any(r["dtype"] == "fp32" for r in res["rows"]):       # the same-tokens check runs in fp32 (a bf16-only run has none)
        assert "tokens_equal" in res["equivalence"]


@pytest.mark.parametrize("p", _committed("peer_scale_*.json"), ids=lambda p: p.name)
def test_committed_shape_result_has_the_schema(p):
    """Every committed peer_scale_<shape>.json: the issue's row keys, each roofline factor recomputable from its
    own row, llama.cpp dense and our dense and low-rank rows for every dtype, and a verdict for every target."""
    from lowrank_lib.bench import peer_scale as ps

    res = json.loads(p.read_text())
    assert res["command"].startswith("python -m lowrank_lib.bench peer --shape ") and res["rows"]
    for r in res["rows"]:
        # a later sitting of the same shape is written beside the first (results.ResultFiles never overwrites)
        assert set(ps.ROW_KEYS) <= set(r) and re.fullmatch(rf"peer_scale_{re.escape(r['shape'])}(_\d+)?\.json", p.name)
        assert r["roofline_x"] == pytest.approx(r["decode_ms_per_token"] / 1e3 /
                                                (r["weight_bytes_per_token"] / (r["copy_gbs"] * 1e9)), rel=1e-6)
    for dt in {r["dtype"] for r in res["rows"] if r["system"] == "lowrank_lib_dense"}:
        assert {r["system"] for r in res["rows"] if r["dtype"] == dt} >= {"llamacpp_dense", "lowrank_lib_dense",
                                                                          "lowrank_lib_lowrank"}
    assert res["targets"] and all(isinstance(t["met"], bool) and t["measured"] > 0 for t in res["targets"])


# --------------------------------------------------------------------------- verdicts
def _direction(target: dict) -> str:
    """The comparison a target's ``met`` stands for: the recorded ``op``, else (files written before ``op`` was
    recorded) read from the name: a speed-up (faster = larger) must reach its bound; a ratio of times
    (``dense_ratio``: ours / llama.cpp) or a roofline factor (time / bytes-bound time) must stay under it."""
    name = target["target"]
    words = f"{name} {target.get('key', '')}"
    by_name = ">=" if "speedup" in words else "<=" if ("ratio" in words or "roofline" in words) else None
    op = target.get("op", by_name)
    assert op in (">=", "<="), f"no direction for target {name!r}: record its op"
    assert by_name in (None, op), f"target {name!r}: op {op} contradicts its name"
    declared = {t.name: t for t in peer_base.TARGETS}          # the targets as data (eval/peer_targets.py)
    if name in declared:
        assert (op, target["bound"]) == (declared[name].op, declared[name].bound), target
    if name.startswith("composed_speedup_"):                   # and eval/kv_decode.py's
        assert (op, target["bound"]) == (">=", dict(SPEED_TARGETS)[target["budget"]]), target
    return op


def _head(r: dict) -> str:
    """A row's LM head: ``"exact"`` / ``"certified"`` (peer), ``{"mode": ...}`` (peer --shape), absent (llama.cpp)."""
    h = r.get("lm_head") or "exact"
    return h["mode"] if isinstance(h, dict) else h


def _decode(rows, lm_head="exact", **key) -> dict:
    """THE row with this LM head matching ``key``."""
    got = [r for r in rows if _head(r) == lm_head and all(r.get(k) == v for k, v in key.items())]
    assert len(got) == 1, (key, lm_head, len(got))
    return got[0]


def _measured(res: dict, t: dict) -> float:
    """A target's measured value recomputed from the file's rows (peer, peer --shape and kv-decode targets)."""
    rows, name, dt = res["rows"], t["target"], t["dtype"]
    if t.get("key") == "speedup_vs_dense":                    # bench kv-decode: the method's step against dense's
        key = {k: t[k] for k in ("system", "budget", "threads", "context", "dtype")}
        (r,) = [r for r in rows if all(r.get(k) == v for k, v in key.items())]
        at = (t["threads"], t["context"])
        (d,) = [x for x in rows if x["system"] == "dense" and (x["threads"], x["context"]) == at]
        assert r["speedup_vs_dense"] == pytest.approx(d["decode_ms_per_token"] / r["decode_ms_per_token"], abs=6e-4)
        return r["speedup_vs_dense"]
    if "shape" in t:            # bench/peer_scale.py, and bench/peer.py since its targets name the comparison key
        th, key, head = t.get("threads", 1), t.get("key", name), _head(t)
        ref = lambda q: _decode(rows, system="llamacpp_dense", dtype=q, threads=th)["decode_ms_per_token"]  # noqa: E731
        if t.get("system") == "lowrank_lib_dense" or name == "dense_speedup_vs_llamacpp_dense":
            r = _decode(rows, head, system="lowrank_lib_dense", dtype=dt, threads=th)
        else:
            r = _decode(rows, head, system="lowrank_lib_lowrank", dtype=dt, threads=th, keep=t["keep"],
                        factor_bits=t.get("factor_bits"))
        values = {"roofline_x": lambda: r["roofline_x"], "speedup_vs_llamacpp_dense": lambda: ref(dt) / r["decode_ms_per_token"],
                  "speedup_vs_llamacpp_q4_k_m": lambda: ref("q4_k_m") / r["decode_ms_per_token"],
                  "dense_speedup_vs_llamacpp_dense": lambda: ref(dt) / r["decode_ms_per_token"]}
        assert key in values, f"target {name!r}: a new kind, teach _measured to recompute it from the rows"
        return values[key]()
    th = t["threads"]                                          # bench/peer.py
    ll = _decode(rows, system="llamacpp_dense", dtype=dt, threads=th)["decode_ms_per_token"]
    de = _decode(rows, system="lowrank_lib_dense", dtype=dt, threads=th)
    lr = _decode(rows, system="lowrank_lib_lowrank", dtype=dt, threads=th)
    if name == "certified_speedup_vs_llamacpp":
        return ll / _decode(rows, system="lowrank_lib_lowrank", dtype=dt, threads=th,
                            lm_head="certified")["decode_ms_per_token"]
    values = {"lowrank_speedup_vs_llamacpp": ll / lr["decode_ms_per_token"],
              "dense_ratio_vs_llamacpp": de["decode_ms_per_token"] / ll, "lowrank_roofline_x": lr["roofline_x"]}
    assert name in values, f"target {name!r}: a new kind, teach _measured to recompute it from the rows"
    return values[name]


_WITH_TARGETS = [p for p in sorted(RESULTS.glob("*.json")) if isinstance(json.loads(p.read_text()).get("targets"), list)]


def test_the_files_with_targets_are_the_peer_results():
    """The verdict test below covers every committed file with a ``targets`` list (a new kind fails here first)."""
    kv = [p for p in _committed("kv_decode_*.json") if int(p.stem.rsplit("_", 1)[1]) >= 30]   # since they record them
    assert {p.name for p in _WITH_TARGETS} == {p.name for p in _committed() + _committed("peer_scale_*.json") + kv}


@pytest.mark.parametrize("p", _WITH_TARGETS, ids=lambda p: p.name)
def test_every_target_met_agrees_with_measured_and_bound(p):
    res = json.loads(p.read_text())
    assert res["targets"]
    for t in res["targets"]:
        op = _direction(t)
        assert t["met"] == (t["measured"] >= t["bound"] if op == ">=" else t["measured"] <= t["bound"]), t
        assert t["measured"] == pytest.approx(_measured(res, t), rel=1e-9), t


@pytest.mark.parametrize("p", _committed("kv_frontier*.json"), ids=lambda p: p.name)
def test_every_frontier_pass_agrees_with_its_kl_and_bytes(p):
    """``pass_target`` (``eval.kv_sweep.frontier_best``): ours has a lower KL than the best eviction policy at the
    same budget and holds no more bytes than it (1 % of the budget as slack)."""
    res = json.loads(p.read_text())
    assert res["best"]
    for b in res["best"]:
        want = b["best_ours_kl"] < b["best_eviction_kl"] and b["best_ours_bytes"] <= b["best_eviction_bytes"] + 0.01 * b["budget"]
        assert b["pass_target"] == want, b
        assert b["kl_ratio_eviction_over_ours"] == pytest.approx(b["best_eviction_kl"] / b["best_ours_kl"], rel=1e-9)


@pytest.mark.parametrize("p", _committed("attsvd_*.json"), ids=lambda p: p.name)
def test_every_attsvd_pass_agrees_with_its_measurements(p):
    """The AttSVD acceptance flags (``eval.kv_sweep.targets``): KL ratio >= 3, |ppl gap| <= 2 %, KL <= the best
    eviction's, passkey >= dense's."""
    res = json.loads(p.read_text())
    assert res["targets"]
    for t in res["targets"].values():
        assert t["kl_ratio_svd_over_attsvd"] == pytest.approx(t["kl_svd"] / t["kl_attsvd"], rel=1e-9)
        assert t["ppl_gap_pct"] == pytest.approx(100 * (t["ppl_attsvd"] / t["ppl_dense"] - 1), rel=1e-9)
        assert t["pass_kl_3x"] == (t["kl_ratio_svd_over_attsvd"] >= 3.0)
        assert t["pass_ppl_2pct"] == (abs(t["ppl_gap_pct"]) <= 2.0)
        ev = t["best_eviction_kl"]
        assert t["pass_vs_eviction"] == (ev is not None and t["kl_attsvd"] <= ev)
        for tag in ("km", "ext"):
            if f"pass_vs_eviction_{tag}" in t:
                assert t[f"pass_vs_eviction_{tag}"] == (ev is not None and t[f"kl_attsvd_{tag}"] <= ev)
        if "pass_passkey" in t:
            assert t["pass_passkey"] == (t["passkey_attsvd"] >= t["passkey_dense"])


# --------------------------------------------------------------------------- the README's tables
def _readme_table(anchor: str) -> tuple[list[str], list[list[str]]]:
    """The first markdown table after ``anchor`` in README.md: (header cells, rows of cells); cells stripped of
    bold and backticks."""
    text = (ROOT / "README.md").read_text()
    assert text.count(anchor) == 1, f"README.md: {anchor!r} found {text.count(anchor)} times"
    lines = text[text.index(anchor):].splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith("|"))
    block = []
    for ln in lines[start:]:
        if not ln.startswith("|"):
            break
        block.append([c.strip().replace("**", "").replace("`", "") for c in ln.strip().strip("|").split("|")])
    assert set("".join(block[1])) <= set("-: "), block[1]
    return block[0], block[2:]


def _same(cell: str, value: float, what) -> None:
    """``cell`` prints ``value`` rounded to the cell's own decimals (``3.9e6``: to its mantissa's; a trailing ``x``
    or `` M`` allowed)."""
    m = re.fullmatch(r"([-+]?\d+(?:\.(\d+))?)(?:e(-?\d+))?(?:x| M)?", cell.strip())
    assert m, f"{what}: {cell!r} is not a number"
    dec, exp = len(m.group(2) or ""), int(m.group(3) or 0)
    assert abs(float(m.group(1)) * 10.0 ** exp - value) <= 0.5 * 10.0 ** (exp - dec) * (1 + 1e-9), \
        f"{what}: README {cell}, JSON {value}"


def _expand(cells: list[str]) -> list[list[str]]:
    """One README row that prints two systems (``llama.cpp, Q8_0 / Q4_K_M | | 2 | 81.1 / 51.8 | ...``) -> two rows.
    The label's later parts replace its last word (``keep 0.8 / 0.5`` -> ``keep 0.8``, ``keep 0.5``)."""
    if " / " not in cells[0]:
        return [cells]
    parts = cells[0].split(" / ")
    head = parts[0].rsplit(" ", 1)[0]
    labels = [parts[0]] + [f"{head} {p}" for p in parts[1:]]
    return [[lab] + [c.split(" / ")[i] if " / " in c else c for c in cells[1:]] for i, lab in enumerate(labels)]


def _system(label: str) -> dict:
    """A README system label -> the row key it names."""
    m = re.fullmatch(r"(llama\.cpp|ik_llama\.cpp|lowrank_lib), (dense|keep ([\d.]+)|BF16|Q8_0|Q4_K_M)"
                     r"( \+ (certified|q8) head)?(, int(8|4) factors)?", label)
    assert m, f"unknown system label {label!r}"
    key = {"lm_head": m.group(5) or "exact", "factor_bits": int(m.group(7)) if m.group(7) else None}
    if m.group(1) in ("llama.cpp", "ik_llama.cpp"):
        key["system"] = "llamacpp_dense" if m.group(1) == "llama.cpp" else "ik_llamacpp"
        if m.group(2) in ("BF16", "Q8_0", "Q4_K_M"):
            key["dtype"] = m.group(2).lower()
    elif m.group(2) == "dense":
        key["system"] = "lowrank_lib_dense"
    else:
        key["system"], key["keep"] = "lowrank_lib_lowrank", float(m.group(3))
    return key


#: README anchor (the bold path of the run the table shows), JSON, (threads when the table has no such column)
PEER_TABLES = [("**`benchmarks/results/peer_cpu_7.json`**", "peer_cpu_7.json", None),
               ("**`benchmarks/results/peer_cpu_8.json`**", "peer_cpu_8.json", None),
               ("**`benchmarks/results/peer_cpu_9.json`**", "peer_cpu_9.json", None),
               ("**`benchmarks/results/peer_cpu_10.json`**", "peer_cpu_10.json", None),
               ("**`benchmarks/results/peer_cpu_12.json`**", "peer_cpu_12.json", None),
               ("**`benchmarks/results/peer_cpu_13.json`**", "peer_cpu_13.json", None),
               ("**`benchmarks/results/peer_cpu_14.json`**", "peer_cpu_14.json", None),
               ("**`benchmarks/results/peer_cpu_15.json`**", "peer_cpu_15.json", None),
               ("**`benchmarks/results/peer_cpu_16.json`**", "peer_cpu_16.json", None),
               ("**`benchmarks/results/peer_cpu_17.json`**", "peer_cpu_17.json", None),
               ("**`benchmarks/results/peer_cpu_18.json`**", "peer_cpu_18.json", None),
               ("**`benchmarks/results/peer_cpu_19.json`**", "peer_cpu_19.json", None),
               ("**`benchmarks/results/peer_cpu_20.json`**", "peer_cpu_20.json", None),
               ("**`benchmarks/results/peer_cpu_21.json`**", "peer_cpu_21.json", None),
               ("**`benchmarks/results/peer_cpu_22.json`**", "peer_cpu_22.json", None),
               ("**`benchmarks/results/peer_cpu_23.json`**", "peer_cpu_23.json", None),
               ("**`benchmarks/results/peer_cpu_24.json`**", "peer_cpu_24.json", None),
               ("**`benchmarks/results/peer_cpu_25.json`**", "peer_cpu_25.json", None),
               ("**`benchmarks/results/peer_cpu_26.json`**", "peer_cpu_26.json", None),
               ("**`benchmarks/results/peer_cpu_27.json`**", "peer_cpu_27.json", None),
               ("**`benchmarks/results/peer_cpu_28.json`**", "peer_cpu_28.json", None),
               ("**`benchmarks/results/peer_cpu_29.json`**", "peer_cpu_29.json", None),
               ("**`benchmarks/results/peer_cpu_3.json`**", "peer_cpu_3.json", None),
               ("**`benchmarks/results/peer_cpu_4.json`**", "peer_cpu_4.json", 1),
               ("**`benchmarks/results/peer_scale_llama2-7b.json`**", "peer_scale_llama2-7b.json", 1),
               ("**`benchmarks/results/peer_scale_llama2-7b_2.json`**", "peer_scale_llama2-7b_2.json", None),
               ("**`benchmarks/results/peer_scale_llama2-7b_3.json`**", "peer_scale_llama2-7b_3.json", None),
               ("**`benchmarks/results/peer_scale_llama2-7b_4.json`**", "peer_scale_llama2-7b_4.json", None),
               ("**`benchmarks/results/peer_scale_llama3.2-1b.json`**", "peer_scale_llama3.2-1b.json", None),
               ("**`benchmarks/results/peer_scale_llama3.2-1b_5.json`**", "peer_scale_llama3.2-1b_5.json", None),
               ("**`benchmarks/results/peer_scale_llama3.2-1b_6.json`**", "peer_scale_llama3.2-1b_6.json", None),
               ("**`benchmarks/results/peer_scale_llama3.2-1b_7.json`**", "peer_scale_llama3.2-1b_7.json", None),
               ("**`benchmarks/results/peer_scale_llama3.2-1b_8.json`**", "peer_scale_llama3.2-1b_8.json", None),
               ("**`benchmarks/results/peer_scale_llama3.2-1b_9.json`**", "peer_scale_llama3.2-1b_9.json", None),
               ("**`benchmarks/results/peer_scale_llama3.2-1b_10.json`**", "peer_scale_llama3.2-1b_10.json", None),
               ("**`benchmarks/results/peer_scale_llama3.2-1b_11.json`**", "peer_scale_llama3.2-1b_11.json", None),
               ("**`benchmarks/results/peer_scale_llama3.2-1b_12.json`**", "peer_scale_llama3.2-1b_12.json", None)]


@pytest.mark.parametrize("anchor,name,threads", PEER_TABLES, ids=[t[1] for t in PEER_TABLES])
def test_readme_peer_table_equals_the_json(anchor, name, threads):
    res = _load(name)
    header, rows = _readme_table(anchor)
    col = {h: i for i, h in enumerate(header)}
    seen = set()
    for cells in (c for row in rows for c in _expand(row)):
        key = _system(cells[0])
        if "dtype" not in key:
            key["dtype"] = cells[col["dtype"]]
        assert cells[col["dtype"]] in ("", key["dtype"]), cells
        key["threads"] = int(cells[col["threads"]]) if "threads" in col else threads
        rows_ = [r for r in res["rows"] if r["system"] == key["system"] and r["dtype"] == key["dtype"]
                 and r["threads"] == key["threads"] and _head(r) == key["lm_head"]
                 and ("keep" not in key or r.get("keep", key["keep"]) == key["keep"])
                 and r.get("factor_bits") == key["factor_bits"]]
        assert len(rows_) == 1, (name, cells, len(rows_))
        r = rows_[0]
        seen.add(id(r))
        ref_dtype = key["dtype"] if key["dtype"] in ("fp32", "bf16") else "bf16"     # quantized: vs dense bf16
        ll = [x for x in res["rows"] if x["system"] == "llamacpp_dense" and x["dtype"] == ref_dtype
              and x["threads"] == key["threads"] and _head(x) == "exact"]
        for h, i in col.items():
            what = f"README table of {name}, row {cells[0]} {key['dtype']} {key['threads']}, column {h!r}"
            if h in ("system", "dtype", "threads"):
                continue
            if h.startswith("vs llama.cpp dense"):
                assert len(ll) == 1, what
                _same(cells[i], ll[0]["decode_ms_per_token"] / r["decode_ms_per_token"], what)
            elif h in ("vs llama.cpp Q4_K_M", "vs ik_llama.cpp Q4_K_M"):
                peer_ = "ik_llamacpp" if h.startswith("vs ik") else "llamacpp_dense"
                q4 = [x for x in res["rows"] if x["system"] == peer_ and x["dtype"] == "q4_k_m"
                      and x["threads"] == key["threads"]]
                assert len(q4) == 1, what
                _same(cells[i], q4[0]["decode_ms_per_token"] / r["decode_ms_per_token"], what)
            else:
                value = {"decode ms/token": lambda: r["decode_ms_per_token"], "prefill ms": lambda: r["prefill_ms"],
                         "MB/token": lambda: r["weight_bytes_per_token"] / 1e6,
                         "GB/token": lambda: r["weight_bytes_per_token"] / 1e9,
                         "x roofline": lambda: r["roofline_x"], "x copy roofline": lambda: r["roofline_x"],
                         "x roofline with KV": lambda: r["roofline_with_kv_x"]}[h]()
                _same(cells[i], value, what)
    assert len(seen) >= len(rows)


def test_readme_kv_decode_table_equals_the_json():
    res = _load("kv_decode_3.json")
    header, rows = _readme_table("`benchmarks/results/kv_decode_3.json`; SmolLM2 fp32")
    assert header == ["system", "budget (bytes held)", "attention kernel", "ms/token (IQR)", "speed-up vs dense",
                      "attention ms", "attention vs dense"]
    assert len(rows) == len(res["rows"])
    for cells in rows:
        sys_, budget = cells[0], None if cells[0] == "dense" else float(cells[1])
        (r,) = [r for r in res["rows"] if r["system"] == sys_ and r["budget"] == budget]
        what = f"README kv-decode row {sys_} {budget}"
        _same(cells[1], r["bytes_ratio"], what + " bytes held")
        kernel, why = re.fullmatch(r"(\S+) \((.+)\)", cells[2]).groups()
        assert kernel == r["attention_kernel"] and (("fused tier" in why) == ("fused tier" in r["attention_reason"]))
        ms, lo, hi = re.fullmatch(r"([\d.]+) \(([\d.]+)-([\d.]+)\)", cells[3]).groups()
        _same(ms, r["decode_ms_per_token"], what + " ms/token")
        _same(lo, r["decode_iqr_ms"][0], what + " IQR low")
        _same(hi, r["decode_iqr_ms"][1], what + " IQR high")
        _same(cells[4].split(" (target")[0], r["speedup_vs_dense"], what + " speed-up")
        _same(cells[5], r["attn_ms_per_token"], what + " attention ms")
        _same(cells[6].split(" (target")[0], r["attn_ratio_vs_dense"], what + " attention ratio")


@pytest.mark.parametrize("name", ["kv_decode_5.json", "kv_decode_6.json", "kv_decode_7.json", "kv_decode_8.json",
                                  "kv_decode_9.json", "kv_decode_10.json", "kv_decode_11.json",
                                  "kv_decode_12.json", "kv_decode_13.json", "kv_decode_14.json",
                                  "kv_decode_15.json", "kv_decode_16.json", "kv_decode_17.json",
                                  "kv_decode_18.json", "kv_decode_19.json", "kv_decode_20.json",
                                  "kv_decode_21.json", "kv_decode_22.json", "kv_decode_23.json",
                                  "kv_decode_24.json", "kv_decode_25.json", "kv_decode_26.json",
                                  "kv_decode_27.json", "kv_decode_28.json", "kv_decode_29.json",
                                  "kv_decode_30.json", "kv_decode_31.json", "kv_decode_32.json",
                                  "kv_decode_33.json", "kv_decode_34.json",
                                  "kv_decode_35.json", "kv_decode_36.json", "kv_decode_37.json",
                                  "kv_decode_38.json", "kv_decode_39.json",
                                  "kv_decode_40.json", "kv_decode_41.json", "kv_decode_42.json",
                                  "kv_decode_43.json"])
def test_readme_kv_decode_table_at_1_and_2_threads_equals_the_json(name):
    res = _load(name)
    header, rows = _readme_table(f"`benchmarks/results/{name}`;")
    limit = (res.get("kernel_isa") or {}).get("limit")
    if limit:                 # a run with fewer kernel features than the CPU has says so where the README cites it
        (line,) = [ln for ln in (ROOT / "README.md").read_text().splitlines() if f"`benchmarks/results/{name}`;" in ln]
        assert f"LOWRANK_LIB_ISA={limit}" in line, f"README's {name} line does not name the ISA limit {limit}"
    cold = "attn_cold_ms_per_token" in res["rows"][0]    # measured from kv_decode_42 on: the README shows it too
    assert header == ["threads", "system", "budget (bytes held)", "ms/token (IQR)", "speed-up vs dense", "attention ms",
                      "attention vs dense"] + (["attention ms, cold", "cold vs dense"] if cold else [])
    assert len(rows) == len(res["rows"]) == 8
    for cells in rows:
        th, sys_, budget = int(cells[0]), cells[1], None if cells[1] == "dense" else float(cells[2])
        (r,) = [r for r in res["rows"] if r["threads"] == th and r["system"] == sys_ and r["budget"] == budget]
        what = f"README kv-decode row {th} {sys_} {budget}"
        assert r["fused_layer"] == "lrk_decode_layer" and r["graph"] == res["config"]["graph"], what
        if "--graph" in res["command"]:                                 # the README's command says which
            assert f"--graph {r['graph']}" in res["command"], what
        _same(cells[2], r["bytes_ratio"], what + " bytes held")
        ms, lo, hi = re.fullmatch(r"([\d.]+) \(([\d.]+)-([\d.]+)\)", cells[3]).groups()
        _same(ms, r["decode_ms_per_token"], what + " ms/token")
        _same(lo, r["decode_iqr_ms"][0], what + " IQR low")
        _same(hi, r["decode_iqr_ms"][1], what + " IQR high")
        speed = cells[4].replace("*", "").split(" (target")[0]
        _same(speed, r["speedup_vs_dense"], what + " speed-up")
        if "(target" in cells[4]:                     # a verdict that matches the number
            target = float(re.search(r"target ([\d.]+)x", cells[4]).group(1))
            assert ("NOT met" in cells[4]) == (r["speedup_vs_dense"] < target), what
        _same(cells[5], r["attn_ms_per_token"], what + " attention ms")
        _same(cells[6], r["attn_ratio_vs_dense"], what + " attention ratio")
        if cold:
            _same(cells[7], r["attn_cold_ms_per_token"], what + " cold attention ms")
            _same(cells[8], r["attn_cold_ratio_vs_dense"], what + " cold attention ratio")
    assert res["machine"]["cpu"] and res["copy_gbs"] > 0


#: the README's file labels of the load table -> (family, refusal)
_LOAD_LABELS = {"SVD-LLM v1 (whole-model pickle)": ("svdllm", False), "SVD-LLM v2": ("svdllm_v2", False),
                "Dobi-SVD (pickle": ("dobi", False), "Dobi-SVD remap": ("dobi-remap", False),
                "Basis Sharing": ("basis_sharing", False), "ASVD": ("asvd", False), "Palu": ("palu", False),
                "ours": ("lowrank", False), "the SVD-LLM v1 file with a refused global": ("svdllm", True),
                "SVD-LLM v1, LLaMA-7B": ("svdllm", False)}


@pytest.mark.parametrize("name, anchor", [
    ("load_llama-3.2-1b_k0.8_3.json", "`benchmarks/results/load_llama-3.2-1b_k0.8_3.json`), measured"),
    ("load_llama-3.2-1b_k0.8_4.json", "Dobi-SVD remap served from its codes (`benchmarks/results/load_llama-3.2-1b_k0.8_4.json`")])
def test_readme_load_table_equals_the_json(name, anchor):
    res = _load(name)
    header, rows = _readme_table(anchor)
    assert header == ["file", "shape", "loaded as", "file GiB", "model GiB", "wall s", "GB/s", "peak - baseline GiB",
                      "limit GiB"]
    assert len(rows) == len(res["rows"])
    G = 2 ** 30
    for cells in rows:
        (family, refusal), = [v for k, v in _LOAD_LABELS.items() if cells[0].startswith(k)
                              and not (k == "SVD-LLM v1 (whole-model pickle)" and "7B" in cells[0])]
        shape = {"1B": "llama-3.2-1b", "7B": "llama-7b"}[cells[1]]
        got = [r for r in res["rows"] if r["family"] == family and r["refusal"] == refusal and r["shape"] == shape
               and (refusal or r["dtype"] == cells[2])]
        assert len(got) == 1, cells
        r, what = got[0], f"README load row {cells[:3]}"
        _same(cells[3], r["file_bytes"] / G, what + " file GiB")
        _same(cells[5], r["wall_s"], what + " wall s")
        _same(cells[7], r["peak_over_baseline"] / G if "peak_over_baseline" in r
              else (r["peak_rss"] - r["baseline_rss"]) / G, what + " peak - baseline")
        for i, v in ((4, r.get("model_bytes")), (6, r.get("file_GBps")), (8, r.get("rss_limit"))):
            if cells[i] == "-":
                assert refusal, what
            else:
                _same(cells[i], v / G if i != 6 else v, what + f" {header[i]}")


def test_readme_ppl_table_equals_the_json():
    res = _load("ppl_svd_smollm2_w16x2048.json")
    header, rows = _readme_table("`benchmarks/results/ppl_svd_smollm2_w16x2048.json`")
    assert header == ["model", "keep", "PPL", "parameters"] and len(rows) == len(res["rows"])
    for cells in rows:
        method = {"dense": "dense", "plain SVD": "svd"}[cells[0]]
        (r,) = [r for r in res["rows"] if r["method"] == method and r["keep"] == float(cells[1])]
        _same(cells[2], r["ppl"], f"README ppl row {cells[:2]} PPL")
        _same(cells[3], r["params"] / 1e6, f"README ppl row {cells[:2]} parameters")


#: the README's family labels of the quality table -> the JSON's family
_QUALITY_LABELS = {"dense": "dense", "plain SVD": "svd", "ASVD (uniform ratio)": "asvd", "SVD-LLM v1": "svdllm",
                   "SVD-LLM v2": "svdllm_v2", "Basis Sharing (groups of 2)": "basis_sharing",
                   "Dobi-SVD (no remap, fp16)": "dobi", "Dobi-SVD (remap, 8-bit)": "dobi-remap",
                   "Palu (k/v only)": "palu"}


def test_readme_quality_table_equals_the_json():
    res = _load("quality_smollm2_w4x2048_c16x512.json")
    header, rows = _readme_table("`benchmarks/results/quality_smollm2_w4x2048_c16x512.json`")
    assert header == ["family", "keep 0.8: PPL", "keep 0.6: PPL", "params at 0.8 / 0.6 (M)",
                      "on disk at 0.8 / 0.6 (MB)"]
    assert {_QUALITY_LABELS[c[0]] for c in rows} == {r["family"] for r in res["rows"]}
    for cells in rows:
        fam = _QUALITY_LABELS[cells[0]]
        keeps = (1.0,) if fam == "dense" else (0.8, 0.6)
        got = {k: [r for r in res["rows"] if r["family"] == fam and r["keep"] == k] for k in keeps}
        assert all(len(v) == 1 for v in got.values()), cells
        what = f"README quality row {cells[0]}"
        for i, k in enumerate(keeps):
            r = got[k][0]
            _same(cells[1 + i], r["ppl"], f"{what} keep {k} PPL")
            _same(cells[3].split(" / ")[i], r["total_params"] / 1e6, f"{what} keep {k} params")
            if r["disk_bytes"] is None:
                assert cells[4] == "", what
            else:
                _same(cells[4].split(" / ")[i], r["disk_bytes"] / 1e6, f"{what} keep {k} MB on disk")
        if fam == "dense":
            assert cells[2] == "" and " / " not in cells[3], what


_POLICY_LABELS = {"KVzip": "kvzip", "normalised H2O": "h2o_norm", "H2O": "h2o", "SnapKV": "snapkv",
                  "StreamingLLM": "streamingllm", "Expected Attention": "expected_attention", "KeyDiff": "keydiff"}


def test_readme_kv_frontier_table_equals_the_json():
    """Per (prefill, budget): the best eviction policy, its KL and perplexity change, composed-kvzip-q8's, their
    ratio (``best``), and attsvd-ext's KL (``rows``)."""
    res = _load("kv_frontier.json")
    header, rows = _readme_table("the shards (`benchmarks/results/kv_frontier.json` / `.txt`, the merge")
    assert header[:2] == ["prefill", "budget"] and header[4] == "ratio" and "attsvd-ext" in header[5]
    assert len(rows) == len(res["best"])
    by = {(r["policy"], r["prefill"], r["budget"]): r for r in res["rows"]}
    for cells in rows:
        P, b = int(cells[0]), float(cells[1])
        (best,) = [x for x in res["best"] if x["prefill"] == P and x["budget"] == b]
        assert best["best_ours"] == "composed-kvzip-q8", best
        what = f"README frontier row {P} {b}"
        label, kl, ppl = re.fullmatch(r"(.+) (\S+) \(([-+]?[\d.]+) %\)", cells[2]).groups()
        assert _POLICY_LABELS[label] == best["best_eviction"], what
        ev = by[(best["best_eviction"], P, b)]
        _same(kl, best["best_eviction_kl"], what + " eviction KL")
        _same(ppl, 100 * (ev["ppl"] / ev["ppl_dense"] - 1), what + " eviction PPL change")
        kl, ppl = re.fullmatch(r"(\S+) \(([-+]?[\d.]+) %\)", cells[3]).groups()
        ours = by[("composed-kvzip-q8", P, b)]
        _same(kl, best["best_ours_kl"], what + " composed KL")
        _same(ppl, 100 * (ours["ppl"] / ours["ppl_dense"] - 1), what + " composed PPL change")
        _same(cells[4], best["kl_ratio_eviction_over_ours"], what + " ratio")
        _same(cells[5], by[("attsvd-ext", P, b)]["kl_mean"], what + " attsvd-ext KL")



def test_readme_lowrank_vs_quantization_table_is_the_json():
    """The README's low-rank-vs-quantization table is ``eval.frontier.format_table`` of the committed frontier,
    character for character (every point, its frontier verdict, its ms/token with its ratio to the reference of
    its own sitting); every timed point names a sitting that timed the reference."""
    from lowrank_lib.eval import frontier as fr

    res = _load("frontier_smollm2.json")
    want = fr.format_table(res["points"], sittings=res["sittings"])
    text = (ROOT / "README.md").read_text()
    head = want.splitlines()[0]
    assert text.count(head) == 1, "README.md: the frontier table's header is not there once"
    got = text[text.index(head):].split("\n\n")[0]
    assert got == want
    sits = {s["id"]: s for s in res["sittings"]}
    for p in res["points"]:
        if p.get("speed"):
            s = sits[p["sitting"]]
            assert p["id"] in s["points"] and set(s["reference_speed"]) >= set(p["speed"]), p["id"]


def test_readme_breakdown_table_equals_the_json():
    """The README's 'Where a token's time goes' table (1 thread, exact head) is peer_cpu_7.json's breakdown, rounded."""
    res = _load("peer_cpu_7.json")
    header, rows = _readme_table("**Where a token's time goes**")
    assert len(rows) == 4
    for cells in rows:
        key = _system("lowrank_lib, " + cells[0])
        [r] = [r for r in res["rows"] if r["system"] == key["system"] and r["threads"] == 1 and _head(r) == "exact"
               and r.get("factor_bits") == key["factor_bits"]]
        b, p = r["breakdown"], r["breakdown"]["phases_ms"]
        want = [f"{b['step_ms']:.2f}", f"{b['gemv_ms']:.2f} ({b['gemv_GBps']:.1f})", f"{b['attention_ms']:.2f}",
                f"{p['rmsnorm'] + p['rope_kv_write'] + p['residual']:.2f}", f"{p['silu_mul']:.2f}",
                f"{b['prolog_ms']:.2f}", f"{b['outside_layers_ms']:.2f}"]
        assert cells[1:] == want, (cells, want)


def test_committed_gpu_checks_agree_with_their_measurements():
    """benchmarks/results/gpu_checks.json (the H200 session): every verdict recomputed from its speed rows, the
    correctness rows all passed or skipped for a missing package, and the README's two tables print the JSON."""
    from lowrank_lib.bench.gpu import verdicts

    res = _load("gpu_checks.json")
    assert res["device"].startswith("NVIDIA") and all(v.startswith("done") for v in res["stages"].values())
    assert verdicts(res["speed"], res["n_layers"]) == res["verdicts"]
    assert all(r.get("tokens_equal") or "package is not importable" in r.get("skipped", "") for r in res["correctness"])
    header, rows = _readme_table("**`benchmarks/results/gpu_checks.json`**")
    assert header == ["prompt / gen", "system", "ms/token", "launches/token", "GB read/token", "x roofline"]
    speed = {(f"{s['config']['prompt_len']} / {s['config']['gen_len']}", k): r
             for s in res["speed"] for k, r in s["systems"].items()}
    assert len(rows) == len(speed)
    for cells in rows:
        r, what = speed[cells[0], cells[1]], f"README GPU row {cells[:2]}"
        for cell, v in zip(cells[2:], (r["decode_ms_per_token"], r["per_token_count"], r["weight_bytes_per_token"] / 1e9,
                                       r["roofline_x"])):
            _same(cell, v, what)
    text = (ROOT / "README.md").read_text()
    verdict_rows = text[text.index("| setting | target | system | value | verdict |"):].split("\n\n")[0].splitlines()[2:]
    assert verdict_rows == [f"| {v['setting']} | {v['target']} | {v['system']} | {v['value']:.2f} | "
                            f"{'met' if v['met'] else 'NOT met'} |" for v in res["verdicts"]]


def test_readme_compress_memory_table_equals_the_json():
    header, rows = _readme_table("| library | layers | calibration s | compress s | X^T X GiB |")
    assert header[-1] == "JSON" and len(rows) == 4
    G = 2 ** 30
    for cells in rows:
        res = _load(cells[-1].strip("`"))
        (r,) = res["rows"]
        what = f"README compress-memory row {cells[-1]}"
        assert r["layers"] == int(cells[1]) and r["method"] == "svdllm" and r["logits_finite"], what
        assert cells[0].split("(")[-1].rstrip(")") in res["note"], what        # the library commit that ran it
        for i, v in ((2, r["calib_s"]), (3, r["compress_s"]), (4, r["stats_bytes"] / G), (5, r["peak_anon"] / G),
                     (6, r["peak_rss"] / G), (7, res["copy_bandwidth_GBps"])):
            _same(cells[i], v, f"{what} {header[i]}")


def test_readme_dobi_lut_table_equals_the_json():
    res = _load("dobi_lut_gemv_t1.json")
    header, rows = _readme_table("(**`benchmarks/results/dobi_lut_gemv_t1.json`**")
    assert header[0] == "factor [rows, cols]" and len(rows) * 3 == len(res["rows"])
    kernels = ("lut_bf16", "int8_vnni", "bf16")
    for cells in rows:
        shape = [int(v) for v in cells[0].split(" x ")]
        for cell, k in zip(cells[1:], kernels):
            (r,) = [r for r in res["rows"] if r["shape"] == shape and r["kernel"] == k]
            us, gbps = re.fullmatch(r"([\d.]+) \(([\d.]+)\)", cell).groups()
            _same(us, r["us"], f"README dobi lut {shape} {k} us")
            _same(gbps, r["GBps"], f"README dobi lut {shape} {k} GB/s")
    # the verdict the README states: the table kernel is the slowest at every shape
    for shape in {tuple(r["shape"]) for r in res["rows"]}:
        us = {r["kernel"]: r["us"] for r in res["rows"] if tuple(r["shape"]) == shape}
        assert us["lut_bf16"] > us["bf16"] > us["int8_vnni"], shape


def test_readme_notebooks_04_06_at_7b_are_the_json():
    res = json.loads((RESULTS / "checkpoint_report_llama-7b_04-06.json").read_text())
    header, rows = _readme_table("**`benchmarks/results/checkpoint_report_llama-7b_04-06.json`**")
    assert header[:3] == ["notebook", "wall s", "kernel peak RSS GiB"]
    names = sorted(res["notebooks"])
    assert [r[0][:2] for r in rows[:3]] == [n[:2] for n in names] and rows[3][0] == "all three"
    for row, name in zip(rows, names):
        nb = res["notebooks"][name]
        _same(row[1], nb["wall_s"], f"{name} wall")
        _same(row[2], nb["peak_rss_bytes"] / 2 ** 30, f"{name} peak RSS")
    _same(rows[3][1], res["wall_s_all"], "all three wall")
    assert res["targets"]["04+05+06 within this 24 GB machine"]["met"]
