"""Compressors against their papers on one protocol: SVD-LLM v1 / v2 taken apart, ASVD uniform vs its STRS search.

    python -m lowrank_lib.bench compressors --threads 1                        # SmolLM2, keep 0.8 / 0.6
    python -m lowrank_lib.bench compressors --model tiny-smol --windows 1 --prompt-len 128 --calib-samples 2

The variants and what the JSON holds: :mod:`lowrank_lib.eval.compressors` (this command parses the options into its
``CompressorsConfig``; results are rewritten after every row).
"""
from __future__ import annotations


def add_arguments(p) -> None:
    from ...eval.compressors import VARIANTS
    from ..options import add_keep, add_prompt_len

    p.add_argument("--model", default="smollm2")
    add_keep(p, [0.8, 0.6])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    p.add_argument("--windows", type=int, default=4, help="first N windows of WikiText-2 test")
    add_prompt_len(p, 2048, "perplexity window tokens")
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-len", type=int, default=512, help="tokens per calibration sample")
    p.add_argument("--asvd-calib", type=int, nargs=2, default=[2, 256], metavar=("SAMPLES", "TOKENS"),
                   help="the first SAMPLES calibration samples, TOKENS each, that ASVD's sensitivity uses (default 2 256)")
    p.add_argument("--asvd-candidates", nargs="+", type=float, default=None,
                   help="parameter ratios ASVD's sensitivity tries (default: the paper's 0.1 ... 0.9)")
    p.add_argument("--no-loss-table", action="store_true", help="skip the per-matrix truncation-loss comparison")


def run(a) -> int:
    from ...eval.compressors import CompressorsConfig, format_table, measure
    from ..options import one
    from ..results import ResultFiles, slug

    cfg = CompressorsConfig(model=a.model, keeps=tuple(a.keep), variants=tuple(a.variants), windows=a.windows,
                            seq_len=one(a.prompt_len, "--prompt-len"), calib_samples=a.calib_samples,
                            calib_len=a.calib_len, asvd_calib=tuple(a.asvd_calib),
                            asvd_candidates=tuple(a.asvd_candidates) if a.asvd_candidates else None,
                            loss_table=not a.no_loss_table)
    fams = {v.split("_")[0] for v in cfg.variants}
    tag = slug(cfg.model.split("/")[-1], f"w{cfg.windows}x{cfg.seq_len}", f"c{cfg.calib_samples}x{cfg.calib_len}",
               fams.pop() if len(fams) == 1 else "")
    files = ResultFiles(a.out, "compressors", tag)

    def write(res: dict, complete: bool = False):     # after every row: an interrupted run keeps what it measured
        files.write({**res, "command": a.command_line, "complete": complete}, md=format_table(res))

    res = measure(cfg, on_row=write)
    write(res, complete=True)
    print(format_table(res))
    print(f"wrote {files.path}")
    return 0
