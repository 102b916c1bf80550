"""Plain-SVD perplexity vs keep ratio (dense + keeps), or the per-projection-type sensitivity (--sensitivity)."""
from __future__ import annotations


def add_arguments(p) -> None:
    from ..options import add_keep, add_prompt_len

    p.add_argument("--model", default="smollm2")
    add_keep(p, [0.9, 0.8, 0.6])
    add_prompt_len(p, 2048, "perplexity window tokens")
    p.add_argument("--windows", type=int, default=16, help="first N windows of WikiText-2 test (0 = all)")
    p.add_argument("--sensitivity", type=float, default=None, metavar="RANK_FRAC",
                   help="instead: PPL with only one projection type truncated to RANK_FRAC of full rank")


def run(a) -> int:
    import platform
    import time

    import torch

    from ... import models
    from ...data import tokens
    from ...eval import ppl_vs_keep, sensitivity_by_type
    from ..options import one
    from ..results import write_result

    t0 = time.time()
    P = one(a.prompt_len, "--prompt-len")
    model, tok = models.load(a.model)
    ids = tokens(tok, "test")
    win = a.windows or None
    info = {"command": a.command_line, "model": a.model, "seq_len": P, "torch": torch.__version__,
            "machine": platform.processor() or platform.machine()}
    if a.sensitivity is not None:
        res = sensitivity_by_type(model, ids, a.sensitivity, seq_len=P, max_windows=win)
        for k, v in res.items():
            print(f"{k:>10} {v:12.3f}")
        name, tag = "svd_sensitivity", f"{a.model}_r{a.sensitivity}_w{a.windows}x{P}"
        info.update(rank_frac=a.sensitivity, windows=a.windows, ppl=res)
    else:
        rows = ppl_vs_keep(model, ids, a.keep, seq_len=P, max_windows=win)
        print(f"{'method':>6} {'keep':>5} {'ppl':>12} {'params (M)':>10} {'proj kept':>9}")
        for r in rows:
            print(f"{r['method']:>6} {r['keep']:5.2f} {r['ppl']:12.3f} {r['params'] / 1e6:10.2f} "
                  f"{r['linear_keep']:9.3f}")
        name, tag = "ppl_svd", f"{a.model}_w{a.windows}x{P}"
        info.update(windows=rows[0]["windows"], test_tokens_total=int(ids.numel()), rows=rows)
    info["wall_s"] = round(time.time() - t0, 1)
    print(f"wrote {write_result(a.out, name, tag, info)}")
    return 0
