"""Decode benchmark: every system on the same factors, side by side in one run.

The systems run in interleaved rounds, in a rotated order per round (:mod:`.timing`); the step times are those
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
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..runtime import Engine, run_generation
from ..runtime.baselines import make_runner
from ..runtime.profiling import per_token_counts
from .timing import interleaved_samples, summary, timed


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
    count_tokens: int = 3
    device: str = "cpu"
    seed: int = 0

    def slug(self) -> str:
        from .results import slug

        return slug(Path(str(self.model)).name, self.method, f"k{self.keep}", self.dtype, f"p{self.prompt_len}",
                    f"g{self.gen_len}", f"b{self.batch}")


def copy_bandwidth(device, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Copy bandwidth in GB/s: 2 * nbytes (read + write) / median time of ``dst.copy_(src)`` (one warm-up copy
    first; on CUDA every copy is bracketed by a device sync)."""
    n = nbytes // 4
    src = torch.ones(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    ts = timed(lambda d=dst, s=src: d.copy_(s), repeats + 1, sync)[1:]
    del src, dst
    return 2 * n * 4 / (summary(ts)["median_ms"] / 1e3) / 1e9


def read_bandwidth(device, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Read-only stream bandwidth in GB/s: nbytes / median time of ``src.sum()`` over fp32 (one warm-up first): what a
    decode GEMV, which only reads its weights, can reach. On some hosts it sits well below :func:`copy_bandwidth`
    (one AMD EPYC VM: 9.5 vs 12 GB/s), so a copy roofline of 1.0 is out of reach there."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else None
    ts = timed(lambda s=src: s.sum(), repeats + 1, sync)[1:]
    del src
    return nbytes / (summary(ts)["median_ms"] / 1e3) / 1e9


def model_weight_bytes_per_token(model) -> int:
    """Bytes of parameters one decode step reads: all unique parameters except the input embedding
    table (one row is read), plus the lm_head matrix even when tied to that table."""
    emb = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight if hasattr(model.get_output_embeddings(), "weight") else None
    seen, total = set(), 0
    for p in model.parameters():
        key = p.data_ptr()
        if key in seen or p is emb:
            continue
        seen.add(key)
        total += p.numel() * p.element_size()
    if head is not None and head is emb:
        total += head.numel() * head.element_size()
    return total


def weight_bytes(runner) -> int:
    if isinstance(runner, Engine):
        return runner.weight_bytes_per_token()
    return model_weight_bytes_per_token(runner.model)


def run_decode_bench(cfg: DecodeBenchConfig, models=None, progress: bool = True) -> dict:
    """Run the benchmark; ``models`` = (dense, compressed, tok) to skip loading. Returns the result dict."""
    from ..runtime.config import parse_dtype
    from .models import load_bench_models

    dt = parse_dtype(cfg.dtype)
    dev = torch.device(cfg.device)
    dense, comp, _ = models or load_bench_models(cfg.model, cfg.method, cfg.keep, cfg.checkpoint, cfg.device)
    S = cfg.prompt_len + cfg.gen_len
    g = torch.Generator().manual_seed(cfg.seed)
    ids = torch.randint(0, comp.config.vocab_size, (cfg.batch, cfg.prompt_len), generator=g).to(dev)
    runners = {s: make_runner(s, comp, dense, dtype=dt, max_seq_len=S, max_batch=cfg.batch) for s in cfg.systems}
    bw = copy_bandwidth(dev)
    capture = {}
    for s, r in runners.items():     # warm-up (and graph capture / compile, timed apart)
        run_generation(r, ids, min(4, cfg.gen_len))
        capture[s] = r.capture_s
    outs = {s: [] for s in runners}

    def generation(s):
        def run():
            o = run_generation(runners[s], ids, cfg.gen_len)
            outs[s].append(o)
            bar.update(1)
            return o.step_s
        return run

    bar = tqdm(total=cfg.repeats * len(runners), desc="decode bench", disable=not progress)
    # interleaved rounds in a rotated order (timing): drift hits every system alike
    steps = interleaved_samples({s: generation(s) for s in runners}, cfg.repeats)
    bar.close()
    pre = {s: [o.prefill_s for o in outs[s]] for s in runners}
    e2e = {s: [o.total_s for o in outs[s]] for s in runners}
    tokens = {s: outs[s][-1].tokens for s in runners}
    rows = {}
    for s, r in runners.items():
        c = per_token_counts(r, ids, cfg.count_tokens)
        st = summary(steps[s])
        e2e_s = summary(e2e[s])["median_ms"] / 1e3
        ms = st["median_ms"]
        wb = weight_bytes(r)
        rows[s] = {
            "decode_ms_per_token": ms, "decode_ms_q1": st["q1_ms"], "decode_ms_q3": st["q3_ms"],
            "prefill_ms": summary(pre[s])["median_ms"],
            "e2e_s": e2e_s, "tokens_per_s": cfg.batch * cfg.gen_len / e2e_s,
            "decode_tokens_per_s": 1e3 * cfg.batch / ms,
            "per_token_count": c["total"], "count_kind": c["kind"], "count_by_class": c["by_class"],
            "weight_bytes_per_token": wb, "achieved_GBps": wb / (ms / 1e3) / 1e9,
            "roofline_fraction": (wb / (ms / 1e3) / 1e9) / bw, "roofline_x": ms / 1e3 / (wb / (bw * 1e9)),
            "capture_s": capture[s], "step_ms": [1e3 * t for t in steps[s]],
            "info": r.report() if isinstance(r, Engine) else {"runner": type(r).__name__, "cache": r.kind},
        }
    base = rows.get("hf_static")
    for s, row in rows.items():
        if base:
            row["decode_speedup_vs_hf_static"] = base["decode_ms_per_token"] / row["decode_ms_per_token"]
            row["count_ratio_vs_hf_static"] = row["per_token_count"] / base["per_token_count"]
        ref = tokens.get("hf_dynamic")
        if ref is not None:
            row["tokens_match_hf_dynamic"] = float((tokens[s] == ref).float().mean())
    return {"config": asdict(cfg), "copy_bandwidth_GBps": bw, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "device_name": _device_name(dev), "systems": rows,
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}


def _device_name(dev) -> str:
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    import platform

    return f"cpu ({platform.processor() or platform.machine()}), {torch.get_num_threads()} threads"


COLUMNS = [("decode_ms_per_token", "decode ms/tok", "{:.2f}"), ("prefill_ms", "prefill ms", "{:.1f}"),
           ("e2e_s", "e2e s", "{:.2f}"), ("tokens_per_s", "tok/s", "{:.1f}"),
           ("per_token_count", "ops/tok", "{:.0f}"), ("weight_bytes_per_token", "MB/tok", None),
           ("achieved_GBps", "GB/s", "{:.2f}"), ("roofline_x", "x roofline", "{:.2f}"),
           ("decode_speedup_vs_hf_static", "speedup", "{:.2f}"), ("count_ratio_vs_hf_static", "ops ratio", "{:.3f}"),
           ("tokens_match_hf_dynamic", "match", "{:.2f}")]


def format_table(res: dict) -> str:
    hdr = ["system"] + [c[1] for c in COLUMNS]
    lines = [" | ".join(hdr), " | ".join("---" for _ in hdr)]
    for s, row in res["systems"].items():
        cells = [s]
        for key, _, fmt in COLUMNS:
            v = row.get(key)
            if v is None:
                cells.append("-")
            elif key == "weight_bytes_per_token":
                cells.append(f"{v / 1e6:.1f}")
            else:
                cells.append(fmt.format(v))
        lines.append(" | ".join(cells))
    c = res["config"]
    lines.append(f"\n{c['model']} {c['method']} keep={c['keep']} {c['dtype']} prompt={c['prompt_len']} "
                 f"gen={c['gen_len']} batch={c['batch']} repeats={c['repeats']}; copy bandwidth "
                 f"{res['copy_bandwidth_GBps']:.2f} GB/s; {res['device_name']}; ops/tok = "
                 f"{next(iter(res['systems'].values()))['count_kind']} (see JSON for each system)")
    return "\n".join(lines)
