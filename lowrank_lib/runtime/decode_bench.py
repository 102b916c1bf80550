"""Decode benchmark (``bench decode``, gpu-session's speed checks): every system on the same factors, side by side in
one run.

The systems run in interleaved rounds, in a rotated order per round (:mod:`lowrank_lib.timing`); the step times are those
the shared decode loop (``run_generation``) measures. Per system: median decode ms/token (over all steps of all
repeats) with its quartiles (``decode_ms_q1`` / ``decode_ms_q3``), prefill ms, end-to-end s,
tokens/s, ATen dispatches (CPU) or kernel launches (CUDA) per token, weight bytes read per token,
achieved GB/s = bytes / decode time, and the roofline measured in the same run: the machine's copy
bandwidth (bytes read + written per second of a large ``copy_``); ``roofline_x`` = decode time /
(weight bytes / copy bandwidth), 1.0 = at the roofline.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass

import torch

from ..host import copy_bandwidth, cpu_name
from ..timing import summary
from .baselines import make_runner
from .config import parse_dtype
from .engine import Engine
from .profiling import per_token_counts, timed_generations

__all__ = ["COLUMNS", "DecodeBenchConfig", "format_table", "model_weight_bytes_per_token", "run_decode_bench",
           "weight_bytes"]


@dataclass
class DecodeBenchConfig:
    """One decode benchmark: every system on the same factors, interleaved repeats."""

    model: str = "smollm2"
    method: str = "svd"
    keep: float = 0.5
    checkpoint: str | None = None
    prompt_len: int = 512
    gen_len: int = 64
    batch: int = 1
    dtype: str = "fp32"
    systems: tuple[str, ...] = ("hf_dynamic", "hf_static", "naive", "dense_kv", "engine", "engine_step")
    repeats: int = 3
    count_tokens: int = 3                 # decode steps whose dispatches / launches are counted
    device: str = "cpu"
    seed: int = 0


def model_weight_bytes_per_token(model) -> int:
    """Bytes of parameters one decode step reads: all unique parameters except the input embedding
    table (one row is read), plus the lm_head matrix even when tied to that table."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings()
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen and p is not emb:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    if head is not None and head.weight is emb:
        total += emb.numel() * emb.element_size()
    return total


def weight_bytes(runner) -> int:
    return runner.weight_bytes_per_token() if isinstance(runner, Engine) else model_weight_bytes_per_token(runner.model)


def run_decode_bench(cfg: DecodeBenchConfig, models, progress: bool = True) -> dict:
    """Run the benchmark on ``models`` = (dense, compressed, tok) (``lowrank_lib.resolve.resolve_models`` of the
    config's model, checkpoint, method and keep). Returns the result dict."""
    dt, dev = parse_dtype(cfg.dtype), torch.device(cfg.device)
    dense, comp, _ = models
    g = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, comp.config.vocab_size, (cfg.batch, cfg.prompt_len), generator=g).to(dev)
    runners = {s: make_runner(s, comp, dense, dtype=dt, max_seq_len=cfg.prompt_len + cfg.gen_len,
                              max_batch=cfg.batch) for s in cfg.systems}
    bw = copy_bandwidth(dev)
    # interleaved rounds in a rotated order (timing): drift hits every system alike
    outs = timed_generations(runners, ids, cfg.gen_len, cfg.repeats, progress=progress)
    steps = {s: [t for o in outs[s] for t in o.step_s] for s in runners}
    rows = {}
    for s, r in runners.items():
        c = per_token_counts(r, ids, cfg.count_tokens)
        st, ms = summary(steps[s]), summary(steps[s])["median_ms"]
        e2e_s = summary([o.total_s for o in outs[s]])["median_ms"] / 1e3
        wb = weight_bytes(r)
        rows[s] = {
            "decode_ms_per_token": ms, "decode_ms_q1": st["q1_ms"], "decode_ms_q3": st["q3_ms"],
            "prefill_ms": summary([o.prefill_s for o in outs[s]])["median_ms"],
            "e2e_s": e2e_s, "tokens_per_s": cfg.batch * cfg.gen_len / e2e_s, "decode_tokens_per_s": 1e3 * cfg.batch / ms,
            "per_token_count": c["total"], "count_kind": c["kind"], "count_by_class": c["by_class"],
            "weight_bytes_per_token": wb, "achieved_GBps": wb / (ms / 1e3) / 1e9,
            "roofline_fraction": (wb / (ms / 1e3) / 1e9) / bw, "roofline_x": ms / 1e3 / (wb / (bw * 1e9)),
            "capture_s": r.capture_s, "step_ms": [1e3 * t for t in steps[s]],
            "info": r.report() if isinstance(r, Engine) else {"runner": type(r).__name__, "cache": r.kind},
        }
    base, ref = rows.get("hf_static"), outs.get("hf_dynamic")
    for s, row in rows.items():
        if base:
            row["decode_speedup_vs_hf_static"] = base["decode_ms_per_token"] / row["decode_ms_per_token"]
            row["count_ratio_vs_hf_static"] = row["per_token_count"] / base["per_token_count"]
        if ref:
            row["tokens_match_hf_dynamic"] = float((outs[s][-1].tokens == ref[-1].tokens).float().mean())
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"cpu ({cpu_name()}), {torch.get_num_threads()} threads"
    return {"config": asdict(cfg), "copy_bandwidth_GBps": bw, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "device_name": name, "systems": rows,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


#: (row key, column, format; None: MB)
COLUMNS = [("decode_ms_per_token", "decode ms/tok", "{:.2f}"), ("prefill_ms", "prefill ms", "{:.1f}"),
           ("e2e_s", "e2e s", "{:.2f}"), ("tokens_per_s", "tok/s", "{:.1f}"),
           ("per_token_count", "ops/tok", "{:.0f}"), ("weight_bytes_per_token", "MB/tok", None),
           ("achieved_GBps", "GB/s", "{:.2f}"), ("roofline_x", "x roofline", "{:.2f}"),
           ("decode_speedup_vs_hf_static", "speedup", "{:.2f}"), ("count_ratio_vs_hf_static", "ops ratio", "{:.3f}"),
           ("tokens_match_hf_dynamic", "match", "{:.2f}")]


def format_table(res: dict) -> str:
    lines = [" | ".join(["system"] + [c[1] for c in COLUMNS]), " | ".join("---" for _ in range(len(COLUMNS) + 1))]
    for s, row in res["systems"].items():
        cells = ["-" if row.get(k) is None else f"{row[k] / 1e6:.1f}" if fmt is None else fmt.format(row[k])
                 for k, _, fmt in COLUMNS]
        lines.append(" | ".join([s] + cells))
    c = res["config"]
    lines.append(f"\n{c['model']} {c['method']} keep={c['keep']} {c['dtype']} prompt={c['prompt_len']} "
                 f"gen={c['gen_len']} batch={c['batch']} repeats={c['repeats']}; copy bandwidth "
                 f"{res['copy_bandwidth_GBps']:.2f} GB/s; {res['device_name']}; ops/tok = "
                 f"{next(iter(res['systems'].values()))['count_kind']} (see JSON for each system)")
    return "\n".join(lines)
