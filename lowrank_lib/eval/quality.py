"""Quality table: every family at each keep, compressed -> written natively -> read back -> perplexity.

    python -m lowrank_lib.bench quality --threads 1                 # SmolLM2, keep 0.8 / 0.6 + dense
    python -m lowrank_lib.bench quality --model tiny-smol --windows 1 --seq-len 128   # smoke run

Each row is measured on the model READ BACK from the family's native checkpoint (the normalised
representation), so the table also certifies the readers. Perplexity uses the first
``max_windows`` non-overlapping windows of WikiText-2 test (a documented subset: the full split is
~140 windows of 2048 on SmolLM2); calibration uses ``calib_samples`` x ``calib_seq_len`` tokens of
WikiText-2 valid (seeded). Settings are written into the JSON next to the results.
"""
from __future__ import annotations

import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .. import families
from ..geometry import geometry

#: every compression method of the family registry, in table order (each is written in its own
#: native format: ``families.get_format(name)``; "svd" = plain SVD, kept in our own format)
METHOD_NAMES = tuple(f.name for f in families.methods())


@dataclass
class QualityConfig:
    model: str = "smollm2"
    keeps: tuple[float, ...] = (0.8, 0.6)
    families: tuple[str, ...] = METHOD_NAMES
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

    def slug(self) -> str:
        return f"{Path(self.model).name}_w{self.max_windows}x{self.seq_len}_c{self.calib_samples}x{self.calib_seq_len}"


def dir_bytes(path: Path) -> int:
    path = Path(path)
    return path.stat().st_size if path.is_file() else sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def compress_family(model, family: str, stats, keep: float, cfg: QualityConfig):
    fam = families.get(family)
    if not fam.needs_stats:
        return fam.compress(model, stats, keep)
    kw = {"progress": False}
    if fam.name == "basis_sharing":
        kw["group_size"] = cfg.basis_group_size
    if fam.name == "palu":
        kw["head_group_size"] = cfg.palu_head_group_size or geometry(model).n_kv_heads
        kw["align"] = cfg.palu_align
    return fam.compress(model, stats, keep, **kw)


def eval_tokens(model, tok, cfg: QualityConfig) -> torch.Tensor:
    from ..data import random_token_batches, tokens

    if tok is not None:
        return tokens(tok, "test")
    n = (cfg.max_windows or 4) * cfg.seq_len
    return random_token_batches(model.config.vocab_size, 1, n, seed=cfg.seed + 1)[0]


def run(cfg: QualityConfig, model=None, tok=None, stats=None, keep_dir: str | Path | None = None) -> dict:
    """Build the table; returns ``{"config", "rows"}`` (``bench quality`` writes it).

    ``model``/``tok``/``stats`` reuse an already loaded model and its calibration statistics.
    ``keep_dir``: keep the native checkpoints there (row["path"]) instead of deleting them.
    Each row's ``roundtrip_rel_err`` compares the read-back model's logits with the in-memory one
    on the first 64 evaluation tokens (fp16-stored families differ by their storage rounding).
    """
    from .. import account, models
    from ..compress.calib import calibration_data, collect_stats
    from ..formats import detect_format, load_checkpoint, write_native
    from .perplexity import perplexity

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
                fmt = families.get_format(fam).name
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
    return {"config": {**asdict(cfg), "calib_split": "wikitext-2 valid", "eval_split": "wikitext-2 test",
                       "eval_tokens_per_window": cfg.seq_len, "calib_seconds": round(calib_s, 1),
                       "torch": torch.__version__, "threads": torch.get_num_threads()},
            "rows": rows}


def format_table(result: dict) -> str:
    lines = ["| family | keep | PPL | params (M) | linear keep | disk MB |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        disk = "" if r["disk_bytes"] is None else f"{r['disk_bytes'] / 1e6:.1f}"
        lines.append(f"| {r['family']} | {r['keep']} | {r['ppl']:.2f} | {r['total_params'] / 1e6:.2f} | "
                     f"{r['linear_keep']:.3f} | {disk} |")
    return "\n".join(lines)
