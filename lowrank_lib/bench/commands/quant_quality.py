"""Perplexity of quantized factors (issue 30): SVD-LLM v1 factors fp32 / bf16 / int8 / int4 at several group sizes.

    python -m lowrank_lib.bench quant-quality --threads 2 [--gptq]   # SmolLM2, keep 0.8, 4 x 2048 windows

The library call is :func:`lowrank_lib.eval.quant_quality.measure_quant_quality` (the README's protocol; every
projection in fp32, so the rows differ by the factors' storage alone). The JSON is written after every row.
"""
from __future__ import annotations


def add_arguments(p) -> None:
    from ..options import add_keep, add_list, add_prompt_len

    p.add_argument("--model", default="smollm2")
    p.add_argument("--families", nargs="+", default=["svdllm"], help="one compressor (dobi-remap: int rows = its codes)")
    add_keep(p, [0.8])
    p.add_argument("--windows", type=int, default=4, help="first N windows of WikiText-2 test")
    add_prompt_len(p, 2048, "perplexity window tokens")
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-len", type=int, default=512, help="tokens per calibration sample")
    add_list(p, "--groups", int, [32, 64, 128], "group sizes (columns per scale) tried at each bit width")
    add_list(p, "--bits", lambda v: v if v == "mixed" else int(v), [8, 4], "bit widths ('mixed': MIXED_4_8)")
    add_list(p, "--lm-heads", str, ["q8", "q4"], "approximate heads also scored (bf16 factors; 'none': no head rows)")
    p.add_argument("--gptq", action="store_true", help="also each (bits, group) with GPTQ codes (calibrated)")
    p.add_argument("--qmatmul-prefix", type=int, default=256,
                   help="tokens of window 0 also run through the spec's qmatmul forward (0: skip)")


def run(a) -> int:
    from ...eval.quant_quality import measure_quant_quality, table as format_table
    from ..options import one
    from ..results import ResultFiles, slug

    keep, seq, fam = one(a.keep, "--keep"), one(a.prompt_len, "--prompt-len"), one(a.families, "--families")
    name = slug(a.model.split("/")[-1], *([] if fam == "svdllm" else [fam]), *([] if a.bits == [8, 4] else
                ["bits" + "-".join(map(str, a.bits))]), f"keep{keep}", f"w{a.windows}x{seq}")
    files = ResultFiles(a.out, "quant_quality", name)

    def write(res: dict, complete: bool = False):
        files.write({**res, "command": a.command_line, "complete": complete}, md=format_table(res))

    res = measure_quant_quality(a.model, keep, a.windows, seq, a.calib_samples, a.calib_len,
                                [(b, g) for b in a.bits for g in a.groups], a.qmatmul_prefix, on_row=write,
                                heads=tuple(h for h in a.lm_heads if h != "none"), family=fam, gptq=a.gptq)
    write(res, complete=True)
    print(f"{format_table(res)}\nchosen group: {res['chosen_group']}\nwrote {files.path}")
    return 0
