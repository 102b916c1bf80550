"""Every committed sitting's target verdicts side by side: how steady a speed claim is on a noisy host.

A speed target is judged inside one run ("ratios from one sitting"), and on a shared 2-core VM the same command gives
different ratios from one hour to the next. This module reads the result files a folder holds (``bench peer``:
``peer_cpu*.json``; ``bench peer --shape``: ``peer_scale_*.json``; ``bench kv-decode``: ``kv_decode*.json``) and takes
each file's verdicts: the ``targets`` the run judged with the bounds of its day, or for a ``kv_decode`` file written
before it recorded them, :func:`lowrank_lib.eval.kv_decode.targets` over its rows. The first files of each kind give
none (kv-decode rows that name a ``store`` and no speed-up; peer verdicts that name no system). It groups the
verdicts by target and row: in how many sittings each target was met, the range of what was measured, the latest.

    >>> groups = across(sittings("benchmarks/results"), issues=(29, 30))
    >>> print(table(groups))

The host of a sitting is the CPU the run names and the kernels our rows ran (``lrk_avx512`` / ``lrk_avx2``; a run
limited by ``$LOWRANK_LIB_ISA`` is marked so: the AVX2 code on an AVX-512 host's memory is not an AVX2 host).
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

from .kv_decode import targets as kv_decode_targets

__all__ = ["FILE_KINDS", "across", "sitting", "sittings", "table"]

#: the result files read, by the glob of their names
FILE_KINDS = ("peer_cpu*.json", "peer_scale_*.json", "kv_decode*.json")
#: what identifies one target on one row (a group holds its verdicts from every sitting)
ROW_KEYS = ("issue", "target", "shape", "system", "dtype", "keep", "budget", "lm_head", "factor_bits", "threads", "op",
            "bound", "host")
_ISA = {"lrk_avx512": "AVX-512", "lrk_avx2": "AVX2"}


def _host(res: dict) -> str:
    cpu = (res.get("machine") or {}).get("cpu") or "?"
    kernels = sorted({_ISA.get(r.get("gemv"), r.get("gemv")) for r in res.get("rows", []) if r.get("gemv")})
    limit = (res.get("kernel_isa") or {}).get("limit")
    return f"{cpu}, {'/'.join(kernels) or '?'}" + (f" (ISA limited to {limit})" if limit else "")


def _copy_gbs(res: dict, threads: int) -> float | None:
    by = res.get("copy_bandwidth_GBps_by_threads") or {}
    if str(threads) in by:
        return by[str(threads)]
    return res.get("copy_gbs")                      # kv_decode: measured once, at the start of the run


def sitting(path) -> dict:
    """One result file -> {file, written, host, verdicts: [target records, each with its ``host`` and the sitting's
    ``copy_gbs`` at its thread count]}."""
    path = Path(path)
    try:
        res = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not a result JSON ({e})") from None
    if "targets" in res:                            # the full records only (the first files named no system)
        verdicts = [v for v in res["targets"] or [] if {"system", "threads", "issue"} <= v.keys()]
    elif path.name.startswith("kv_decode"):          # rows of the engine-adapter era (the first files had a store)
        rows = [{"dtype": "float32", **r} for r in res.get("rows", [])       # no dtype column: SmolLM2's own fp32
                if "system" in r and r.get("speedup_vs_dense") is not None]
        verdicts = kv_decode_targets(rows, (res.get("config") or {}).get("model"))
    else:
        verdicts = []
    host = _host(res)
    out = []
    for v in verdicts:
        bw = _copy_gbs(res, v["threads"])
        if bw is None:                              # a geometry row's own copy bandwidth
            bw = next((r.get("copy_gbs") for r in res.get("rows", []) if r.get("system") == v["system"]
                       and r.get("threads") == v["threads"] and r.get("copy_gbs")), None)
        out.append({"budget": None, **v, "host": host, "copy_gbs": bw})
    return {"file": path.name, "written": res.get("written") or res.get("time") or "", "host": host, "verdicts": out}


def sittings(folder) -> list[dict]:
    """:func:`sitting` of every result file of :data:`FILE_KINDS` in ``folder``, oldest first (by ``written``)."""
    paths = sorted({p for g in FILE_KINDS for p in Path(folder).glob(g)})
    return sorted((sitting(p) for p in paths), key=lambda s: (s["written"], s["file"]))


def across(sits: list[dict], issues: tuple[int, ...] | None = None, targets: tuple[str, ...] = ()) -> list[dict]:
    """Group the verdicts of ``sits`` (oldest first) by target and row (:data:`ROW_KEYS`). ``issues`` keeps those
    issues' targets and the targets named in ``targets`` (e.g. issue 22's ``certified_speedup``, which issue 30
    restates); None keeps every verdict. Each group: its keys, ``n`` sittings, ``met`` of them, ``measured`` [{file,
    value, met, copy_gbs}] oldest first, ``low`` / ``median`` / ``high`` of the values and the ``latest`` entry."""
    groups: dict[tuple, dict] = {}
    for s in sits:
        for v in s["verdicts"]:
            if issues is not None and v["issue"] not in issues and v["target"] not in targets:
                continue
            key = tuple(v.get(k) for k in ROW_KEYS)
            g = groups.setdefault(key, {**dict(zip(ROW_KEYS, key)), "measured": []})
            g["measured"].append({"file": s["file"], "value": v["measured"], "met": v["met"],
                                  "copy_gbs": v["copy_gbs"]})
    out = []
    for g in groups.values():
        vals = [m["value"] for m in g["measured"]]
        out.append({**g, "n": len(vals), "met": sum(m["met"] for m in g["measured"]), "low": min(vals),
                    "median": statistics.median(vals), "high": max(vals), "latest": g["measured"][-1]})
    return sorted(out, key=lambda g: tuple(str(g[k]) for k in ("issue", "target", "host", "shape", "system", "keep",
                                                               "budget", "lm_head", "factor_bits", "dtype", "threads")))


_DTYPES = {"bfloat16": "bf16", "float32": "fp32"}     # kv_decode rows name torch's dtypes, peer rows ours


def _row(g: dict) -> str:
    parts = [g["shape"] or "", g["system"].replace("lowrank_lib_", "")]
    parts += [f"keep {g['keep']:g}"] if g["keep"] is not None else []
    parts += [f"budget {g['budget']:g}"] if g["budget"] is not None else []
    parts += [f"{g['lm_head']} head"] if g["lm_head"] not in (None, "exact") else []
    parts += [f"int{g['factor_bits']} factors"] if g["factor_bits"] else []
    return ", ".join(p for p in parts + [_DTYPES.get(g["dtype"], g["dtype"] or ""), f"{g['threads']} thr"] if p)


def table(groups: list[dict]) -> str:
    """The groups as a Markdown table: issue, target and bound, host, row, met in how many sittings, the range of the
    measured values (low / median / high), the latest sitting's value and file."""
    lines = ["| issue | target | host | row | met | measured low / median / high | latest |",
             "|---|---|---|---|---|---|---|"]
    for g in groups:
        latest = g["latest"]
        lines.append(f"| {g['issue']} | {g['target']} {g['op']} {g['bound']:g} | {g['host']} | {_row(g)} | "
                     f"{g['met']} of {g['n']} | {g['low']:.3f} / {g['median']:.3f} / {g['high']:.3f} | "
                     f"{latest['value']:.3f} ({'met' if latest['met'] else 'NOT met'}, `{latest['file']}`) |")
    return "\n".join(lines)
