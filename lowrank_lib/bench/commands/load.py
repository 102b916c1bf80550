"""Checkpoint loading at real size: every family's native file at Llama-3.2-1B shape, peak RSS and GB/s in a child.

    python -m lowrank_lib.bench load                    # every family at Llama-3.2-1B, keep 0.8 (4 GB files)
    python -m lowrank_lib.bench load --llama7b          # + the LLaMA-7B SVD-LLM v1 row (~21 GB on disk)
    python -m lowrank_lib.bench load --quick            # tiny shapes, seconds (the test)

Per family: the checkpoint is written by the library's native writer from zero-page placeholders and
filled with random finite values (``lowrank_lib.synthetic``), read once into the page cache, then
loaded by ``load_checkpoint`` in a fresh child process: wall time, file bytes per second, peak RSS
over the child's baseline (``import lowrank_lib, transformers``) against the contract
``1.15 x model bytes + 0.5 GB``. SVD-LLM v1 loads in its stored dtypes, float32 and bfloat16; the
others as stored. A refusal row times a same-size SVD-LLM file whose pickle names a refused global
after every tensor. Files go to ``--workdir`` (a temporary folder by default; one family on disk at
a time, deleted after) and never into the repository. Writes ``load_<shape>_k<keep>.json`` (+
``.md``) with the load average before and after, the copy bandwidth and the machine.

Memory: a 1B row's child peaks at about the model's bytes (4-5 GB) plus the baseline; run it under
``flock /tmp/lowrank_bigmem.lock`` on a shared machine. The 7B row needs ~21 GB free disk and, in its
stored dtypes (fp32 factors), about 21 GB of RAM; ``--llama7b-dtypes bfloat16`` alone needs ~11 GB.
"""
from __future__ import annotations


def add_arguments(p) -> None:
    from ..options import add_keep

    p.add_argument("--shape", default="llama-3.2-1b", help="llama-3.2-1b (default), test (200-400 MB files), quick")
    p.add_argument("--quick", action="store_true", help="tiny shape, every row in one child (the test)")
    p.add_argument("--families", nargs="+", default=None, help="default: every family")
    add_keep(p, 0.8, "fraction of parameters kept by every family (one value)")
    p.add_argument("--svdllm-dtypes", nargs="+", default=["stored", "float32", "bfloat16"])
    p.add_argument("--dobi-remap-dtypes", nargs="+", default=["stored", "int8"], help="int8: served from its codes")
    p.add_argument("--llama7b", action="store_true", help="add the LLaMA-7B SVD-LLM v1 row (~21 GB on disk)")
    p.add_argument("--llama7b-dtypes", nargs="+", default=["stored", "bfloat16"])
    p.add_argument("--no-refusal", action="store_true", help="skip the refused-pickle row")
    p.add_argument("--workdir", default=None, help="where the files are written (default: a temporary folder)")
    p.add_argument("--note", default="", help="recorded in the JSON (e.g. 'shared machine')")


def run(a) -> int:
    import shutil
    import tempfile
    import time
    from pathlib import Path

    import torch

    from ...host import copy_bandwidth, load_average, machine, physical_memory
    from ...synthetic import FAMILIES
    from ..load import format_table, run_rows
    from ..options import one
    from ..results import ResultFiles, slug

    shape, keep = "quick" if a.quick else a.shape, one(a.keep, "--keep")
    files = ResultFiles(a.out, "load", slug(shape, f"k{keep}"))
    res = {"command": a.command_line, "shape": shape, "keep": keep, "note": a.note,
           "machine": {**machine(), "memory_gib": round(physical_memory() / 2 ** 30, 1)},
           "threads": torch.get_num_threads(), "load_average": {"start": load_average()},
           "copy_bandwidth_GBps": copy_bandwidth("cpu"),
           "contract": "peak RSS - baseline <= 1.15 x loaded model bytes + 0.5 GB; >= 1 GB/s of file bytes "
                       "(warm page cache) for SVD-LLM v1; a refusal reads only the pickle / header", "rows": []}
    root = Path(a.workdir) if a.workdir else Path(tempfile.mkdtemp(prefix="lowrank_load_"))
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:
        dtypes = {"svdllm": a.svdllm_dtypes, "dobi-remap": a.dobi_remap_dtypes}
        res["rows"] += run_rows(shape, a.families or list(FAMILIES), dtypes, root / shape, keep,
                                refusal=not a.no_refusal, one_child_per_row=not a.quick)
        files.write(res, md=format_table(res))
        if a.llama7b:
            res["rows"] += run_rows("llama-7b", ["svdllm"], {"svdllm": a.llama7b_dtypes}, root / "llama-7b", keep,
                                    refusal=False)
    finally:
        if not a.workdir:
            shutil.rmtree(root, ignore_errors=True)
    res["load_average"]["end"] = load_average()
    res["wall_s"] = round(time.perf_counter() - t0, 1)
    table = format_table(res)
    print(table)
    print(f"wrote {files.write(res, md=table)}")
    return 0
