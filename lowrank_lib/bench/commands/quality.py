"""Every checkpoint family at each keep: compress -> write natively -> read back -> WikiText-2 perplexity."""
from __future__ import annotations


def add_arguments(p) -> None:
    from ...eval.quality import METHOD_NAMES

    p.add_argument("--model", default="smollm2")
    p.add_argument("--keeps", type=float, nargs="+", default=[0.8, 0.6])
    p.add_argument("--families", nargs="+", default=list(METHOD_NAMES))
    p.add_argument("--windows", type=int, default=8, help="first N windows of WikiText-2 test")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--calib-seq-len", type=int, default=512)
    p.add_argument("--palu-align", type=int, default=32)


def run(a) -> int:
    from ...eval.quality import QualityConfig, format_table
    from ...eval.quality import run as quality_table
    from ..results import write_result

    cfg = QualityConfig(model=a.model, keeps=tuple(a.keeps), families=tuple(a.families), max_windows=a.windows,
                        seq_len=a.seq_len, calib_samples=a.calib_samples, calib_seq_len=a.calib_seq_len,
                        palu_align=a.palu_align)
    res = quality_table(cfg)
    table = format_table(res)
    print(table)
    print(f"wrote {write_result(a.out, 'quality', cfg.slug(), {**res, 'command': a.command_line}, md=table)}")
    return 0
