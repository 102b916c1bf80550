"""The bandwidth each decode GEMV class of a geometry reaches with our packed kernel, beside the copy bandwidth.

A class is one kernel call of the engine's decode step, with the shapes the engine packs
(``runtime.packing.ProjectionGroup``: q/k/v and gate/up share one stage-1 matrix, their stage-2 factors
run as ONE segmented call; RoPE folding doubles the q/k stage-2 rows when every q/k is low rank):

    dense:    qkv [q + 2 kv, H], o [H, q], gate_up [2 I, H], down [H, I], lm_head [V, H]
    low rank: qkv.V [r_q + r_k + r_v, H], qkv.U (2q x r_q, 2kv x r_k, kv x r_v), o.V, o.U,
              gate_up.V [r_g + r_u, H], gate_up.U (I x r_g, I x r_u), down.V [r_d, I], down.U [H, r_d]

Each class is timed streaming from memory: enough packed copies of its matrices (clones of one random
draw, each in its own memory) to exceed ``stream_bytes`` are multiplied in turn (nothing stays in cache),
``repeats`` times (after one warm-up pass), median; GB/s = weight bytes / time. Only the public kernel ops
(``runtime.kernels.ops``) are used.
"""
from __future__ import annotations

import torch

from ..timing import summary, timed


def gemv_classes(cfg, keep: float | None) -> list[dict]:
    """The decode GEMV calls of one layer (and the head) of a ``LlamaConfig`` geometry: name, matrices
    ``[(out, in, x_offset)]`` and the width of x, per call."""
    from ..ranks import keep_rank

    from ..geometry import geometry

    g = geometry(cfg)
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    q, kv = g.n_heads * g.head_dim, g.n_kv_heads * g.head_dim
    head = {"name": "lm_head", "mats": [(V, H, 0)], "x": H}
    if keep is None:
        return [{"name": "qkv", "mats": [(q + 2 * kv, H, 0)], "x": H}, {"name": "o", "mats": [(H, q, 0)], "x": q},
                {"name": "gate_up", "mats": [(2 * I, H, 0)], "x": H}, {"name": "down", "mats": [(H, I, 0)], "x": I},
                head]
    r = {n: keep_rank(o, i, keep) for n, (o, i) in
         {"q": (q, H), "k": (kv, H), "v": (kv, H), "o": (H, q), "g": (I, H), "u": (I, H), "d": (H, I)}.items()}
    return [{"name": "qkv.V", "mats": [(r["q"] + r["k"] + r["v"], H, 0)], "x": H},
            {"name": "qkv.U", "mats": [(2 * q, r["q"], 0), (2 * kv, r["k"], r["q"]), (kv, r["v"], r["q"] + r["k"])],
             "x": r["q"] + r["k"] + r["v"]},
            {"name": "o.V", "mats": [(r["o"], q, 0)], "x": q}, {"name": "o.U", "mats": [(H, r["o"], 0)], "x": r["o"]},
            {"name": "gate_up.V", "mats": [(r["g"] + r["u"], H, 0)], "x": H},
            {"name": "gate_up.U", "mats": [(I, r["g"], 0), (I, r["u"], r["g"])], "x": r["g"] + r["u"]},
            {"name": "down.V", "mats": [(r["d"], I, 0)], "x": I}, {"name": "down.U", "mats": [(H, r["d"], 0)], "x": r["d"]},
            head]


@torch.no_grad()
def measure(cfg, keep: float | None, dtype: torch.dtype | str, stream_bytes: float = 1.0e9, repeats: int = 3,
            seed: int = 0) -> dict:
    """GB/s of every class of :func:`gemv_classes` at ``dtype`` (``"fp32"``, ``"bf16"`` or a torch dtype), cold (the
    median of ``repeats`` passes over every copy, :func:`lowrank_lib.timing.timed`), and the copy bandwidth
    before and after."""
    from ..runtime.kernels import build, ops
    from ..host import copy_bandwidth

    lib = build.load()
    if not lib.available:
        return {"error": lib.reason}
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype, dtype)
    g = torch.Generator().manual_seed(seed)
    bw = [copy_bandwidth("cpu")]
    rows = []
    for c in gemv_classes(cfg, keep):
        nbytes = sum(o * i for o, i, _ in c["mats"]) * dtype.itemsize
        k = min(2000, max(2, int(stream_bytes // nbytes)))
        one = [ops.pack((torch.randn(o, i, generator=g) * 0.02).to(dtype)) for o, i, _ in c["mats"]]
        sets = [one] + [[P.clone() for P in one] for _ in range(k - 1)]        # distinct memory: cold streams
        x = torch.randn(1, c["x"], generator=g).to(dtype)
        outs, ins, offs = ([m[j] for m in c["mats"]] for j in range(3))

        def stream():
            for P in sets:
                ops.gemv(x, P, outs, ins, offs)

        t = summary(timed(stream, repeats + 1)[1:])["median_ms"] / 1e3 / k      # the first pass warms up
        rows.append({"class": c["name"], "shapes": [[o, i] for o, i, _ in c["mats"]], "bytes": nbytes,
                     "us_per_call": t * 1e6, "GBps": nbytes / t / 1e9})
    bw.append(copy_bandwidth("cpu"))
    cb = sum(bw) / 2
    for r in rows:
        r["x_copy_bandwidth"] = r["GBps"] / cb
    return {"dtype": str(dtype).replace("torch.", ""), "keep": keep, "threads": torch.get_num_threads(),
            "copy_gbs": cb, "copy_gbs_before_after": bw, "classes": rows}
