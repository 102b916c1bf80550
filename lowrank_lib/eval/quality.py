"""Quality table: every family at each keep, compressed -> written natively -> read back -> perplexity.

    python -m lowrank_lib.bench quality --threads 1                 # SmolLM2, keep 0.8 / 0.6 + dense
    python -m lowrank_lib.bench quality --model tiny-smol --windows 1 --prompt-len 128   # smoke run

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

from .. import families
from ..geometry import geometry

__all__ = ["checkpoint_rows", "compress_family", "dense_rows", "dir_bytes", "eval_tokens", "family_rows",
           "format_table", "METHOD_NAMES", "normalisation_facts", "QualityConfig", "run"]

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


#: per process: (model, tok, ids, stats, calib_s) of a configuration, so each Ray worker loads and
#: calibrates once for all its tasks; the serial run fills it (or takes the caller's model) and clears it
_PREPARED: dict = {}


def _key(cfg: QualityConfig) -> tuple:
    return (cfg.model, cfg.seed, cfg.calib_samples, cfg.calib_seq_len, cfg.seq_len, cfg.max_windows)


def _prepare(cfg: QualityConfig, model=None, tok=None, stats=None):
    from .. import models
    from ..compress.calib import calibration_data, collect_stats

    if _key(cfg) not in _PREPARED:
        torch.manual_seed(cfg.seed)
        if model is None:
            model, tok = models.load(cfg.model)
        ids = eval_tokens(model, tok, cfg)
        t0 = time.perf_counter()
        if stats is None:
            calib = calibration_data(tok, cfg.calib_samples, cfg.calib_seq_len, cfg.seed, model.config.vocab_size)
            stats = collect_stats(model, calib, progress=cfg.progress)
        _PREPARED[_key(cfg)] = (model, tok, ids, stats, time.perf_counter() - t0)
    return _PREPARED[_key(cfg)]


def _ppl(m, ids, cfg: QualityConfig, desc: str) -> float:
    from .perplexity import perplexity

    return perplexity(m, ids, seq_len=cfg.seq_len, max_windows=cfg.max_windows, progress=cfg.progress, desc=desc).ppl


def dense_rows(cfg: QualityConfig) -> dict:
    """One sweep task: the dense model's row (and the calibration time of this process)."""
    from ..factorized import account

    model, _, ids, _, calib_s = _prepare(cfg)
    torch.manual_seed(cfg.seed)         # each task seeded alike: its rows do not depend on what ran before
    acc = account(model)
    return {"calib_seconds": round(calib_s, 1),
            "rows": [{"family": "dense", "format": None, "keep": 1.0, "ppl": _ppl(model, ids, cfg, "dense"),
                      "total_params": acc.total_params, "linear_params": acc.linear_params, "linear_keep": 1.0,
                      "memory_bytes": acc.total_bytes, "disk_bytes": None}]}


def normalisation_facts(model) -> dict:
    """What reading a checkpoint produced: layer 0's ``q_proj`` (class and rank), how many projections are
    factorized and how many shared groups (one parameter each) the model holds (``lowrank_meta`` of the reader)."""
    from ..factorized import LowRankLinear

    meta = getattr(model, "lowrank_meta", None) or {}
    q = model.model.layers[0].self_attn.q_proj
    return {"q_proj_layer0": type(q).__name__ + (f" r={q.rank}" if isinstance(q, LowRankLinear) else ""),
            "factorized": len(meta.get("ranks", {})), "shared_groups": len(meta.get("shared_groups", []))}


def _logits(model, probe: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(probe).logits.float()


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a - ref).norm() / ref.norm())


def checkpoint_rows(checkpoint: str | Path, model: str | Path | None = None, cfg: QualityConfig | None = None,
                    dtype: torch.dtype | None = None, probe_len: int = 64) -> dict:
    """The quality table of ONE checkpoint you bring (notebook 01 with ``CHECKPOINT``): ``{"config", "rows"}`` with
    the rows of :func:`run` (the dense reference's row when ``model`` is given, then the checkpoint's).

    The checkpoint is detected and read through the normalised-model cache
    (:func:`lowrank_lib.resolve.load_normalised`; an unreadable file raises the loader's ``CheckpointError`` before
    anything else loads); its row: the family and keep its reader reports, perplexity on the first
    ``cfg.max_windows`` windows of ``cfg.seq_len`` WikiText-2 test tokens (None without a tokenizer: no number on
    random ids), the parameters and bytes really held, the file's bytes, :func:`normalisation_facts`,
    ``roundtrip_rel_err`` (logits of the normalised copy against the native file's, on ``probe_len`` tokens) and,
    with a reference, ``ref_logit_rel_err`` / ``ref_top1_agree`` (the compressed logits against the dense model's).
    Only one model is in memory at a time (a 7B checkpoint and its reference do not fit together in 24 GB).
    ``dtype`` None: :func:`lowrank_lib.resolve.load_dtype` (fp32, or bf16 when fp32 copies would not fit)."""
    import gc

    from .. import models
    from ..factorized import account
    from ..formats import detect_format, load_checkpoint, save_checkpoint
    from ..resolve import check_reference, checkpoint_tokenizer, load_dtype, load_normalised

    dtype = load_dtype(checkpoint) if dtype is None else dtype
    cfg = cfg or QualityConfig(model=None, families=())
    torch.manual_seed(cfg.seed)
    fmt = detect_format(checkpoint)
    t0 = time.perf_counter()
    comp = load_normalised(checkpoint, dtype=dtype)
    load_s = time.perf_counter() - t0
    first_hit = bool(comp.lowrank_meta.get("normalised_cache_hit"))
    entry = comp.lowrank_meta.get("normalised_cache")
    rows, ref = [], None
    if model is not None:                     # the reference alone in memory: its logits, perplexity, tokenizer
        comp_config = comp.config
        del comp
        gc.collect()
        dense, tok = models.load(model, dtype=dtype)
        check_reference(checkpoint, comp_config, model, dense.config)
        ids = eval_tokens(dense, tok, cfg)
        ref = _logits(dense, ids[None, :probe_len])
        a = account(dense)
        rows.append({"family": "dense", "format": None, "keep": 1.0,
                     "ppl": _ppl(dense, ids, cfg, "dense") if tok is not None else None,
                     "total_params": a.total_params, "linear_params": a.linear_params, "linear_keep": 1.0,
                     "memory_bytes": a.total_bytes, "disk_bytes": None, "path": None})
        del dense
        gc.collect()
        comp = load_normalised(checkpoint, dtype=dtype)       # mapped back from the cache
    else:
        tok = checkpoint_tokenizer(checkpoint)
        ids = eval_tokens(comp, tok, cfg)
    probe = ids[None, :probe_len]
    meta = comp.lowrank_meta
    lc = _logits(comp, probe)
    a = account(comp)
    row = {"family": meta.get("family", fmt), "format": fmt, "keep": meta.get("keep"),
           "ppl": _ppl(comp, ids, cfg, Path(checkpoint).name) if tok is not None else None,
           "total_params": a.total_params, "linear_params": a.linear_params, "linear_keep": a.linear_keep,
           "dense_params": a.total_params - a.linear_params + a.dense_linear_params,
           "memory_bytes": a.total_bytes, "disk_bytes": dir_bytes(Path(checkpoint)),
           "shared_params_saved": a.shared_params_saved, "load_s": round(load_s, 2), "normalised_cache": entry,
           "normalised_cache_hit": first_hit, **normalisation_facts(comp), "path": str(checkpoint)}
    if ref is not None:
        row["ref_logit_rel_err"] = _rel(lc, ref)
        row["ref_top1_agree"] = float((lc.argmax(-1) == ref.argmax(-1)).float().mean())
    from_cache = bool(meta.get("normalised_cache_hit"))
    del comp
    gc.collect()
    tmp = None
    if entry is None:                          # our own format (or no cache): write it out and read it back
        tmp = Path(tempfile.mkdtemp(prefix="lowrank_roundtrip_"))
        other = load_checkpoint(save_checkpoint(load_checkpoint(checkpoint, dtype=dtype), tmp / "m"), dtype=dtype)
    elif from_cache:                           # the model above was the normalised copy: now the native file
        other = load_checkpoint(checkpoint, dtype=dtype)
    else:
        other = load_checkpoint(entry, family="lowrank", dtype=dtype)
    lo = _logits(other, probe)
    del other
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    native, normalised = (lo, lc) if from_cache else (lc, lo)
    row["roundtrip_rel_err"] = _rel(normalised, native)
    rows.append(row)
    return {"config": {**asdict(cfg), "checkpoint": str(checkpoint), "reference": None if model is None else str(model),
                       "tokenizer": tok is not None, "probe_tokens": int(probe.shape[1]),
                       "eval_split": "wikitext-2 test" if tok is not None else None, "torch": torch.__version__,
                       "threads": torch.get_num_threads()},
            "rows": rows}


def family_rows(cfg: QualityConfig, fam: str, keep_dir: str | None = None) -> dict:
    """One sweep task: family ``fam`` at every keep of ``cfg``, each row measured on the read-back model."""
    from ..factorized import account
    from ..formats import detect_format, load_checkpoint, write_native

    model, _, ids, stats, _ = _prepare(cfg)
    torch.manual_seed(cfg.seed)
    probe = ids[None, :64]
    rows = []
    tmp = Path(keep_dir) if keep_dir is not None else Path(tempfile.mkdtemp(prefix="lowrank_quality_"))
    try:
        for keep in cfg.keeps:
            t1 = time.perf_counter()
            cm = compress_family(model, fam, stats, keep, cfg)
            t_comp = time.perf_counter() - t1
            fmt = families.get_format(fam).name
            disk = err = p = None
            facts = {}
            if cfg.roundtrip:
                p = write_native(cm, fmt, tmp / f"{fam}-{keep}", tokenizer=None)
                if detect_format(p) != fmt:
                    raise RuntimeError(f"{p}: detected {detect_format(p)!r}, wrote {fmt!r}")
                disk = dir_bytes(p)
                back = load_checkpoint(p, dtype=torch.float32)     # the evaluations run in fp32
                err = _rel(_logits(back, probe), _logits(cm, probe))
                cm = back
                facts = normalisation_facts(back)
                if keep_dir is None:
                    shutil.rmtree(p) if p.is_dir() else p.unlink()
            a = account(cm)
            rows.append({"family": fam, "format": fmt, "keep": keep, "ppl": _ppl(cm, ids, cfg, f"{fam}@{keep}"),
                         "total_params": a.total_params, "linear_params": a.linear_params,
                         "linear_keep": a.linear_keep, "memory_bytes": a.total_bytes, "disk_bytes": disk,
                         "shared_params_saved": a.shared_params_saved, "compress_s": round(t_comp, 2),
                         "roundtrip_rel_err": err, "path": None if keep_dir is None or p is None else str(p),
                         **facts})
            del cm
    finally:
        if keep_dir is None:
            shutil.rmtree(tmp, ignore_errors=True)
    return {"rows": rows}


def run(cfg: QualityConfig, model=None, tok=None, stats=None, keep_dir: str | Path | None = None,
        executor=None, on_partial=None) -> dict:
    """Build the table; returns ``{"config", "rows"}`` (``bench quality`` writes it).

    One sweep task per family (every keep) plus the dense row, run by ``executor``
    (:mod:`lowrank_lib.executor`; default serial); ``on_partial(result)`` gets the table of the tasks
    finished so far, in table order, after each one (``bench quality`` writes it as it grows).
    ``model``/``tok``/``stats`` reuse an already loaded model and its calibration statistics (serial only).
    ``keep_dir``: keep the native checkpoints there (row["path"]) instead of deleting them.
    Each row's ``roundtrip_rel_err`` compares the read-back model's logits with the in-memory one
    on the first 64 evaluation tokens (fp16-stored families differ by their storage rounding).
    """
    from ..executor import SerialExecutor, Task, run_sweep

    executor = executor or SerialExecutor()
    local = isinstance(executor, SerialExecutor)
    if not local and (model is not None or stats is not None):
        raise ValueError("model=/stats= live in this process: use the serial executor, or pass neither")
    kd = None if keep_dir is None else str(keep_dir)
    tasks = [Task("dense", dense_rows, (cfg,))] + [Task(f, family_rows, (cfg, f, kd)) for f in cfg.families]
    done: dict = {}

    def result(parts: dict) -> dict:
        calib = parts.get("dense", {}).get("calib_seconds")
        return {"config": {**asdict(cfg), "calib_split": "wikitext-2 valid", "eval_split": "wikitext-2 test",
                           "eval_tokens_per_window": cfg.seq_len, "calib_seconds": calib,
                           "torch": torch.__version__, "threads": torch.get_num_threads(),
                           "executor": executor.name},
                "rows": [r for t in tasks if t.name in parts for r in parts[t.name]["rows"]]}

    def finished(name, value):
        done[name] = value
        if on_partial is not None:
            on_partial(result(done))

    try:
        if local:
            _prepare(cfg, model, tok, stats)
        parts = run_sweep(tasks, executor, on_result=finished, progress=cfg.progress, desc="quality")
    finally:
        if local:
            _PREPARED.pop(_key(cfg), None)
    return result(parts)


def format_table(result: dict) -> str:
    lines = ["| family | keep | PPL | params (M) | linear keep | disk MB |", "|---|---|---|---|---|---|"]
    for r in result["rows"]:
        disk = "" if r["disk_bytes"] is None else f"{r['disk_bytes'] / 1e6:.1f}"
        lines.append(f"| {r['family']} | {r['keep']} | {r['ppl']:.2f} | {r['total_params'] / 1e6:.2f} | "
                     f"{r['linear_keep']:.3f} | {disk} |")
    return "\n".join(lines)
