"""The peer runs' comparisons and THE targets they are judged on (issues 12, 22, 29, 30), as data.

Both ``bench peer`` runs (:mod:`lowrank_lib.bench.peer`, SmolLM2; :mod:`lowrank_lib.bench.peer_scale`, the 1B / 7B
geometries) and the notebooks that read their results judge rows here:

- :func:`comparisons`: every lowrank_lib row (and ik_llama.cpp's) against llama.cpp dense of the same model, dtype and
  threads, against its Q4_K_M, and ours against ik_llama.cpp's Q4_K_M;
- THE targets (:data:`TARGETS`, data: name, compared key, direction, bound, which rows, issue) and the ONE function
  that judges them (:func:`evaluate`; ``met`` from ``measured`` and ``bound`` by :func:`met`).

Pure functions of result rows (dicts): nothing is measured here.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["TARGETS", "Target", "comparisons", "evaluate", "met"]


def comparisons(rows: list[dict]) -> list[dict]:
    """Every row but mainline llama.cpp's (ours, ik_llama.cpp's) against llama.cpp dense of the same model
    (``shape``), dtype and threads (ik_llama.cpp: against mainline on the same file), its Q4_K_M, and ours against
    ik_llama.cpp's Q4_K_M."""
    key = lambda r, dt=None: (r.get("shape"), dt or r["dtype"], r["threads"])       # noqa: E731
    ref = {key(r): r for r in rows if r["system"] == "llamacpp_dense"}
    ik = {key(r): r for r in rows if r["system"] == "ik_llamacpp"}
    out = []
    for r in rows:
        if r["system"] == "llamacpp_dense":
            continue
        ll, q4, ik4 = ref.get(key(r)), ref.get(key(r, "q4_k_m")), ik.get(key(r, "q4_k_m"))
        c = {k: r.get(k) for k in ("shape", "system", "dtype", "threads", "keep", "lm_head", "factor_bits")}
        c["roofline_x"] = r["roofline_x"]
        for name, ref_row in (("dense", ll), ("q4_k_m", q4)):     # rounds (peer --shape --rounds): paired in time
            ms = {x["round"]: x["decode_ms_per_token"] for x in (ref_row or {}).get("rounds", ())}
            if len(ms) > 1:
                c[f"speedup_vs_llamacpp_{name}_by_round"] = [ms[x["round"]] / x["decode_ms_per_token"]
                                                             for x in r.get("rounds", ()) if x["round"] in ms]
        if ll and r["system"] == "ik_llamacpp":        # the fork against mainline on the same file
            c["speedup_vs_llamacpp_same_file"] = ll["decode_ms_per_token"] / r["decode_ms_per_token"]
        elif ll:
            c.update(speedup_vs_llamacpp_dense=ll["decode_ms_per_token"] / r["decode_ms_per_token"],
                     prefill_ratio_vs_llamacpp_dense=r["prefill_ms"] / ll["prefill_ms"],
                     bytes_vs_llamacpp_dense=r["weight_bytes_per_token"] / ll["weight_bytes_per_token"])
        if q4:          # llama.cpp's Q4_K_M of the same model and threads (issue 30)
            c["speedup_vs_llamacpp_q4_k_m"] = q4["decode_ms_per_token"] / r["decode_ms_per_token"]
        if ik4 and r["system"] != "ik_llamacpp":        # ik_llama.cpp's Q4_K_M, the stronger CPU peer
            c["speedup_vs_ik_llamacpp_q4_k_m"] = ik4["decode_ms_per_token"] / r["decode_ms_per_token"]
        out.append(c)
    return out


@dataclass(frozen=True)
class Target:
    """One target: ``key`` of a comparison ``op`` (``">="`` or ``"<="``) ``bound``, on the comparisons whose fields
    take the values in ``where`` (every target is at 1 thread), from issue ``issue``."""

    name: str
    key: str
    op: str
    bound: float
    where: tuple[tuple[str, tuple], ...]
    issue: int


LOWRANK, EXACT, ONE = ("system", ("lowrank_lib_lowrank",)), ("lm_head", ("exact",)), ("threads", (1,))
BF16_FACTORS, SMOL_BF16 = ("factor_bits", (None,)), (("shape", ("smollm2",)), ("dtype", ("bf16",)))
#: THE targets of both peer runs (SmolLM2: ``shape`` "smollm2"; the geometries: llama3.2-1b, llama2-7b)
TARGETS = (
    Target("dense_speedup", "speedup_vs_llamacpp_dense", ">=", 1.0, (("system", ("lowrank_lib_dense",)), EXACT, ONE),
           22),
    Target("lowrank_speedup", "speedup_vs_llamacpp_dense", ">=", 1.4, (LOWRANK, EXACT, BF16_FACTORS, ONE,
                                                                                  ("shape", ("smollm2",))), 12),
    Target("certified_speedup", "speedup_vs_llamacpp_dense", ">=", 2.3,
           (LOWRANK, ("lm_head", ("certified",)), ONE, ("shape", ("smollm2",)), ("dtype", ("bf16",))), 22),
    Target("lowrank_speedup_k0.5", "speedup_vs_llamacpp_dense", ">=", 1.8,
           (LOWRANK, EXACT, ONE, ("shape", ("llama2-7b",)), ("keep", (0.5,)), ("dtype", ("bf16",))), 22),
    Target("lowrank_speedup_k0.8", "speedup_vs_llamacpp_dense", ">=", 1.15,
           (LOWRANK, EXACT, ONE, ("shape", ("llama2-7b",)), ("keep", (0.8,)), ("dtype", ("bf16",))), 22),
    Target("lowrank_roofline", "roofline_x", "<=", 1.2, (LOWRANK, EXACT, BF16_FACTORS, ONE), 22),
    # issue 29: SmolLM2 bf16 at 1 AND 2 threads; the roofline at 1 (1.3x) and 2 threads (1.5x)
    Target("lowrank_speedup_all_cores", "speedup_vs_llamacpp_dense", ">=", 1.5,
           (LOWRANK, EXACT, BF16_FACTORS, *SMOL_BF16, ("keep", (0.5,)), ("threads", (1, 2))), 29),
    Target("dense_speedup_all_cores", "speedup_vs_llamacpp_dense", ">=", 1.0,
           (("system", ("lowrank_lib_dense",)), EXACT, *SMOL_BF16, ("threads", (1, 2))), 29),
    Target("lowrank_roofline_1t", "roofline_x", "<=", 1.3, (LOWRANK, EXACT, ONE), 29),
    Target("lowrank_roofline_2t", "roofline_x", "<=", 1.5, (LOWRANK, EXACT, ("threads", (2,))), 29),
    # issue 30: int8 factors at keep 0.5 against llama.cpp's Q4_K_M, SmolLM2, 1 and 2 threads
    Target("int8_vs_q4_k_m", "speedup_vs_llamacpp_q4_k_m", ">=", 1.3,
           (LOWRANK, EXACT, ("factor_bits", (8,)), ("keep", (0.5,)), ("shape", ("smollm2",)), ("threads", (1, 2))), 30),
    # issue 30 at the geometries, 1 and 2 threads (1B: any head, the head read in fewer bytes allowed and named)
    *(Target(f"int{b}_k{k}_vs_q4_k_m_{shape}", "speedup_vs_llamacpp_q4_k_m", ">=", bound, (LOWRANK, ("factor_bits", (b,)),
          ("keep", (k,)), ("shape", (shape,)), ("threads", (1, 2)), *(() if shape == "llama3.2-1b" else (EXACT,))), 30)
      for shape, b, k, bound in (("llama3.2-1b", 8, 0.5, 1.0), ("llama3.2-1b", 4, 0.5, 1.4), ("llama2-7b", 8, 0.5, 1.1),
                                 ("llama2-7b", 4, 0.8, 1.2), ("llama2-7b", 4, 0.5, 1.7))),
)


def met(measured: float, bound: float, op: str) -> bool:
    """Whether ``measured op bound`` holds (``op``: ``">="`` or ``"<="``)."""
    return {">=": measured >= bound, "<=": measured <= bound}[op]


def evaluate(comps: list[dict], targets=TARGETS) -> list[dict]:
    """Every target on every comparison it applies to (and that measured its key): the comparison's identity, the
    target, its bound and direction, the measured value and whether it is met."""
    out = []
    for t in targets:
        for c in comps:
            if c.get(t.key) is not None and all(c.get(k) in vals for k, vals in t.where):
                out.append({**{k: c.get(k) for k in ("shape", "system", "dtype", "keep", "lm_head", "threads",
                                                    "factor_bits")},
                            "target": t.name, "key": t.key, "op": t.op, "bound": t.bound, "issue": t.issue,
                            "measured": c[t.key], "met": met(c[t.key], t.bound, t.op)})
    return out
