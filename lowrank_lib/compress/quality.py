"""Quality table: every family at each keep, compressed -> written natively -> read back -> perplexity.

    OMP_NUM_THREADS=1 python -m lowrank_lib.compress.quality            # SmolLM2, keep 0.8 / 0.6 + dense
    python -m lowrank_lib.compress.quality --model tiny-smol --windows 1 --seq-len 128   # smoke run

Each row is measured on the model READ BACK from the family's native checkpoint (the normalised
representation), so the table also certifies the readers. Perplexity uses the first
``max_windows`` non-overlapping windows of WikiText-2 test (a documented subset: the full split is
~140 windows of 2048 on SmolLM2); calibration uses ``calib_samples`` x ``calib_seq_len`` tokens of
WikiText-2 valid (seeded). Settings are written into the JSON next to the results.
"""
from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

#: family -> native checkpoint family it is written as ("svd" = plain SVD, kept in our own format)
FAMILY_FORMAT = {"svd": "lowrank", "asvd": "asvd", "svdllm": "svdllm", "svdllm_v2": "svdllm",
                 "basis_sharing": "basis_sharing", "dobi": "dobi", "dobi-remap": "dobi-remap", "palu": "palu"}


@dataclass
class QualityConfig:
    model: str = "smollm2"
    keeps: tuple[float, ...] = (0.8, 0.6)
    families: tuple[str, ...] = tuple(FAMILY_FORMAT)
    calib_samples: int = 32
    calib_seq_len: int = 512
    seq_len: int = 2048
    max_windows: int | None = 8
    seed: int = 0
    basis_group_size: int = 2
    palu_head_group_size: int | None = None   # None: all KV heads in one group (G = 1)
    palu_align: int = 32
    roundtrip: bool = True
    progress: bool = True
    extra: dict = field(default_factory=dict)


def dir_bytes(path: Path) -> int:
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def compress_family(model, family: str, stats, keep: float, cfg: QualityConfig):
    from . import COMPRESSORS, compress_svd

    if family == "svd":
        return compress_svd(model, keep)
    kw = {"progress": False}
    if family == "basis_sharing":
        kw["group_size"] = cfg.basis_group_size
    if family == "palu":
        kw["head_group_size"] = cfg.palu_head_group_size or model.config.num_key_value_heads
        kw["align"] = cfg.palu_align
    return COMPRESSORS[family](model, stats, keep, **kw)


def eval_tokens(model, tok, cfg: QualityConfig) -> torch.Tensor:
    from ..data import random_token_batches, tokens

    if tok is not None:
        return tokens(tok, "test")
    n = (cfg.max_windows or 4) * cfg.seq_len
    return random_token_batches(model.config.vocab_size, 1, n, seed=cfg.seed + 1)[0]


def run(cfg: QualityConfig, out_dir: str | Path | None = "benchmarks/results", model=None, tok=None, stats=None,
        keep_dir: str | Path | None = None) -> dict:
    """Build the table; returns ``{"config", "rows"}`` and writes JSON into ``out_dir`` (unless None).

    ``model``/``tok``/``stats`` reuse an already loaded model and its calibration statistics.
    ``keep_dir``: keep the native checkpoints there (row["path"]) instead of deleting them.
    Each row's ``roundtrip_rel_err`` compares the read-back model's logits with the in-memory one
    on the first 64 evaluation tokens (fp16-stored families differ by their storage rounding).
    """
    from .. import account, models
    from ..eval.perplexity import perplexity
    from ..formats import detect_format, load_checkpoint, write_native
    from .calib import calibration_data, collect_stats

    torch.manual_seed(cfg.seed)
    if model is None:
        model, tok = models.load(cfg.model)
    ids = eval_tokens(model, tok, cfg)
    probe = ids[None, :64]
    t0 = time.perf_counter()
    if stats is None:
        calib = calibration_data(tok, cfg.calib_samples, cfg.calib_seq_len, cfg.seed, model.config.vocab_size)
        stats = collect_stats(model, calib, progress=cfg.progress)
    calib_s = time.perf_counter() - t0

    def ppl(m, desc):
        return perplexity(m, ids, seq_len=cfg.seq_len, max_windows=cfg.max_windows, progress=cfg.progress, desc=desc).ppl

    acc = account(model)
    rows = [{"family": "dense", "format": None, "keep": 1.0, "ppl": ppl(model, "dense"), "total_params": acc.total_params,
             "linear_params": acc.linear_params, "linear_keep": 1.0, "memory_bytes": acc.total_bytes,
             "disk_bytes": None}]
    tmp = Path(keep_dir) if keep_dir is not None else Path(tempfile.mkdtemp(prefix="lowrank_quality_"))
    try:
        for fam in tqdm(cfg.families, desc="families", disable=not cfg.progress):
            for keep in cfg.keeps:
                t1 = time.perf_counter()
                cm = compress_family(model, fam, stats, keep, cfg)
                t_comp = time.perf_counter() - t1
                fmt = FAMILY_FORMAT[fam]
                disk = err = p = None
                if cfg.roundtrip:
                    p = write_native(cm, fmt, tmp / f"{fam}-{keep}", tokenizer=None)
                    if detect_format(p) != fmt:
                        raise RuntimeError(f"{p}: detected {detect_format(p)!r}, wrote {fmt!r}")
                    disk = dir_bytes(p)
                    back = load_checkpoint(p)
                    with torch.no_grad():
                        ref = cm(probe).logits
                        err = float((back(probe).logits - ref).norm() / ref.norm())
                    cm = back
                    if keep_dir is None:
                        shutil.rmtree(p) if p.is_dir() else p.unlink()
                a = account(cm)
                rows.append({"family": fam, "format": fmt, "keep": keep, "ppl": ppl(cm, f"{fam}@{keep}"),
                             "total_params": a.total_params, "linear_params": a.linear_params,
                             "linear_keep": a.linear_keep, "memory_bytes": a.total_bytes, "disk_bytes": disk,
                             "shared_params_saved": a.shared_params_saved, "compress_s": round(t_comp, 2),
                             "roundtrip_rel_err": err, "path": None if keep_dir is None or p is None else str(p)})
                del cm
    finally:
        if keep_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    result = {"config": {**asdict(cfg), "calib_split": "wikitext-2 valid", "eval_split": "wikitext-2 test",
                         "eval_tokens_per_window": cfg.seq_len, "calib_seconds": round(calib_s, 1),
                         "torch": torch.__version__, "threads": torch.get_num_threads()},
              "rows": rows}
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        stem = f"quality_{Path(cfg.model).name}_w{cfg.max_windows}x{cfg.seq_len}_c{cfg.calib_samples}x{cfg.calib_seq_len}"
        target = out / f"{stem}.json"
        if target.exists():                       # never overwrite an earlier run silently
            target = out / f"{stem}_{time.strftime('%Y%m%dT%H%M%S')}.json"
        target.write_text(json.dumps(result, indent=2) + "\n")
        result["path"] = str(target)
    return result


def format_table(result: dict) -> str:
    lines = ["| family | keep | PPL | params (M) | linear keep | disk MB |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        disk = "" if r["disk_bytes"] is None else f"{r['disk_bytes'] / 1e6:.1f}"
        lines.append(f"| {r['family']} | {r['keep']} | {r['ppl']:.2f} | {r['total_params'] / 1e6:.2f} | "
                     f"{r['linear_keep']:.3f} | {disk} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowrank_lib.compress.quality", description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--keeps", type=float, nargs="+", default=[0.8, 0.6])
    ap.add_argument("--families", nargs="+", default=list(FAMILY_FORMAT))
    ap.add_argument("--windows", type=int, default=8, help="first N windows of WikiText-2 test")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--calib-samples", type=int, default=32)
    ap.add_argument("--calib-seq-len", type=int, default=512)
    ap.add_argument("--palu-align", type=int, default=32)
    ap.add_argument("--out-dir", default="benchmarks/results")
    a = ap.parse_args(argv)
    cfg = QualityConfig(model=a.model, keeps=tuple(a.keeps), families=tuple(a.families), max_windows=a.windows,
                        seq_len=a.seq_len, calib_samples=a.calib_samples, calib_seq_len=a.calib_seq_len,
                        palu_align=a.palu_align)
    res = run(cfg, a.out_dir)
    print(format_table(res))
    print(f"wrote {res['path']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
