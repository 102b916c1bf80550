"""Every checkpoint family at each keep: compress -> write natively -> read back -> WikiText-2 perplexity."""
from __future__ import annotations


def add_arguments(p) -> None:
    from ...eval.quality import METHOD_NAMES
    from ...executor import add_arguments as add_executor_arguments
    from ..options import add_keep, add_prompt_len

    p.add_argument("--model", default="smollm2")
    add_keep(p, [0.8, 0.6])
    p.add_argument("--families", nargs="+", default=list(METHOD_NAMES))
    p.add_argument("--windows", type=int, default=8, help="first N windows of WikiText-2 test")
    add_prompt_len(p, 2048, "perplexity window tokens")
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--calib-len", type=int, default=512, help="tokens per calibration sample")
    p.add_argument("--palu-align", type=int, default=32)
    add_executor_arguments(p)       # one task per family (+ dense): --executor ray [--address ...]


def run(a) -> int:
    from ...eval.quality import QualityConfig, format_table
    from ...eval.quality import run as quality_table
    from ...executor import SweepError, from_args
    from ..options import one
    from ..results import ResultFiles
    from . import report, sweep_failed

    cfg = QualityConfig(model=a.model, keeps=tuple(a.keep), families=tuple(a.families), max_windows=a.windows,
                        seq_len=one(a.prompt_len, "--prompt-len"), calib_samples=a.calib_samples,
                        calib_seq_len=a.calib_len, palu_align=a.palu_align)
    files = ResultFiles(a.out, "quality", cfg.slug())

    def write(res: dict):           # after every finished task: the table so far (a crash keeps it)
        files.write({**res, "command": a.command_line}, md=format_table(res))

    try:
        res = quality_table(cfg, executor=from_args(a), on_partial=write)
    except SweepError as e:
        return sweep_failed(e, files)
    return report(files, {**res, "command": a.command_line}, md=format_table(res))
