"""Decode time against the weight bytes a token reads: the peer benchmarks' rows (``python -m lowrank_lib.bench peer``,
``--shape``) drawn against the copy-bandwidth roofline, so a row's distance from its bytes' floor is what the eye reads.

A row is a dict with ``system`` (``llamacpp_dense`` / ``ik_llamacpp`` / ``lowrank_lib_dense`` / ``lowrank_lib_lowrank``), ``dtype``,
``weight_bytes_per_token``, ``decode_ms_per_token`` and optionally ``keep``, ``factor_bits`` and ``lm_head``.
matplotlib is imported by the caller (an ``ax`` is passed in), never here.
"""
from __future__ import annotations

__all__ = ["COLORS", "MARKERS", "draw_decode_vs_bytes", "draw_thread_scaling"]
MARKERS = {"llamacpp_dense": "s", "ik_llamacpp": "D", "lowrank_lib_dense": "o", "lowrank_lib_lowrank": "*"}
_PEERS = {"llamacpp_dense": "llama.cpp", "ik_llamacpp": "ik_llama.cpp"}
COLORS = {"fp32": "tab:blue", "bf16": "tab:orange", "q8_0": "tab:green", "q4_k_m": "tab:red"}


def draw_decode_vs_bytes(ax, rows: list[dict], copy_gbs: float | None, log: bool = False) -> None:
    """Decode ms/token against weight bytes per token, one marker per row (certified head: ``P``; int8 / int4
    factors: ``v`` / ``^``, thin ``1`` / ``2`` / ``x`` with an approximate q8 / q4 head; low rank: its keep beside
    it), llama.cpp dense as a dashed line per dtype, the copy-bandwidth roofline (bytes / bandwidth) dotted."""
    seen = set()
    for r in rows:
        x, y, cert = r["weight_bytes_per_token"] / 1e6, r["decode_ms_per_token"], r.get("lm_head") == "certified"
        bits = r.get("factor_bits")                  # quantized factors: their own marker and legend entry, no keep label
        head = r.get("lm_head")
        head = head.get("mode") if isinstance(head, dict) else head       # older results: {"mode": ...}
        approx = head not in (None, "exact", "certified")                  # a head read in fewer bytes (q8, q4, ...)
        label = (f"{_PEERS[r['system']]} {r['dtype']}" if r["system"] in _PEERS else
                 f"lowrank_lib {'dense' if r['system'] == 'lowrank_lib_dense' else 'low rank'} {r['dtype']}"
                 + (" + certified head" if cert else "") + (f", int{bits} factors" if bits else "")
                 + (f", {head} head" if approx else ""))
        marker = "P" if cert else {8: "v", 4: "^"}.get(bits, MARKERS[r["system"]])
        marker = marker if not approx else {"v": "1", "^": "2"}.get(marker, "x")
        ax.plot(x, y, marker, color=COLORS.get(r["dtype"], "gray"),
                ms=11 if r["system"] == "lowrank_lib_lowrank" else 8, label="_" if label in seen else label)
        seen.add(label)
        if r["system"] == "llamacpp_dense" and not log:
            ax.axhline(y, color=COLORS.get(r["dtype"], "gray"), ls="--", lw=1)
        if r["system"] == "lowrank_lib_lowrank" and r.get("keep") is not None and not bits and not cert:
            ax.annotate(f"{r['keep']}", (x, y), textcoords="offset points", xytext=(-8, 8), fontsize=8)
    if copy_gbs and rows:
        xs = [0.0 if not log else min(r["weight_bytes_per_token"] for r in rows) / 1e6 * 0.8,
              max(r["weight_bytes_per_token"] for r in rows) / 1e6 * 1.2]
        ax.plot(xs, [x * 1e6 / (copy_gbs * 1e9) * 1e3 for x in xs], ":", color="k", lw=1,
                label=f"roofline (copy {copy_gbs:.1f} GB/s)")
    ax.set(xlabel="weight bytes per token (MB)", ylabel="decode ms/token", **(
        {"xscale": "log", "yscale": "log"} if log else {"xlim": (0, None), "ylim": (0, None)}))
    ax.legend(fontsize=7, loc="upper left" if log else "best")


def draw_thread_scaling(ax, rows_all: list[dict], bws: dict) -> None:
    """Decode ms/token against threads, one line per (system, dtype, factor bits) (exact head), with each thread
    count's copy-bandwidth roofline (``bws``: GB/s by thread count as a string) of the low-rank bytes (dotted)."""
    for (system, dtype, bits) in sorted({(r["system"], r["dtype"], r.get("factor_bits") or 0) for r in rows_all}):
        rows = sorted((r for r in rows_all if (r["system"], r["dtype"], r.get("factor_bits") or 0) == (system, dtype, bits)
                       and r.get("lm_head", "exact") == "exact"), key=lambda r: r["threads"])
        th, label = [r["threads"] for r in rows], f"{system} {dtype}" + (f" int{bits} factors" if bits else "")
        ax.plot(th, [r["decode_ms_per_token"] for r in rows], marker=MARKERS[system], label=label,
                ls="--" if system == "llamacpp_dense" else ":" if system == "ik_llamacpp" else "-",
                color=COLORS.get(dtype, "gray"))
        if system == "lowrank_lib_lowrank":
            ax.plot(th, [r["weight_bytes_per_token"] / (bws[str(r["threads"])] * 1e9) * 1e3 for r in rows], ":",
                    color=COLORS.get(dtype, "gray"), lw=1, label=f"roofline, low-rank bytes {dtype}")
    ax.set(xlabel="threads", ylabel="decode ms/token", xticks=sorted({r["threads"] for r in rows_all}),
           ylim=(0, None), title="thread scaling (dashed: llama.cpp; dotted: ik_llama.cpp and bytes / copy bandwidth)")
    ax.legend(fontsize=7)
