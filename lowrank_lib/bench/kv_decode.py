"""The KV decode-speed benchmark behind ``python -m lowrank_lib.bench kv-decode`` (see that command's help):
the composed engine store against the dense one, the same context, interleaved repeats."""
from __future__ import annotations


def configs_of(a) -> list[tuple]:
    """(store, attention mode, budget, quant8) of every store timed: dense first."""
    out = [("dense", None, None, False)]
    for mode in a.attention:
        for b in a.budgets:
            for q8 in (False, True):
                out.append((f"composed-{a.scorer}{'-q8' if q8 else ''}", mode, b, q8))
    return out


def kv_decode(a) -> dict:
    """Run the benchmark ``a`` (the command's parsed options); writes and returns the result."""
    import copy
    import statistics
    import time

    import torch

    from .. import models
    from ..composed import ComposedConfig, ComposedStore, build
    from ..eval.kv_sweep import frontier_windows
    from ..runtime import Engine, EngineConfig
    from ..runtime.kv import DenseKV
    from .results import ResultFiles, load_average

    class Recording(DenseKV):
        """The dense store, also holding the prompt's post-RoPE q/k/v (to build the composed stores from)."""

        def reset(self, B, T):
            super().reset(B, T)
            self.prefill = []

        def store_prefill(self, layer, q, k, v):
            self.prefill.append((q, k, v))
            super().store_prefill(layer, q, k, v)

    name = a.model or ("tiny-gqa" if a.quick else "smollm2")
    contexts = a.contexts or ([96, 192] if a.quick else [8000, 2048, 4096])
    new, repeats = a.new or (4 if a.quick else 32), a.repeats or (2 if a.quick else 3)
    model, tok = models.load(name)
    model.eval()
    configs = configs_of(a)
    meta = {"command": a.command_line, "model": name, "contexts": contexts, "new": new, "repeats": repeats,
            "scorer": a.scorer, "threads": a.threads, "load_average": {"start": load_average()},
            "note": "decode steps interleaved over stores and thread counts; medians over every step of every round"}
    rows = []
    files = ResultFiles(a.out, "kv_decode")
    for C in contexts:
        ids = frontier_windows(tok, model, 1, C + new, a.seed)[:1]
        dense = Recording()
        eng = Engine(model, EngineConfig(max_batch=1, max_seq_len=C + new + 1), kv=dense)
        t0 = time.perf_counter()
        eng.prefill(ids[:, :C])
        print(f"context {C}: prefill {time.perf_counter() - t0:.1f} s", flush=True)
        stores, built = {}, {}
        imp = None
        for key in configs:
            label, mode, b, q8 = key
            if mode is None:
                stores[key] = dense
            else:
                s = ComposedStore(ComposedConfig(scorer=a.scorer, quant8=q8), b, attention=mode)
                s.allocate(dense.spec)
                s.reset(1, C)
                for i, (q, k, v) in enumerate(dense.prefill):
                    s.store_prefill(i, q, k, v)
                rec = s.record()
                if (b, q8) not in built:         # one scoring per context (budget and quant8 do not change it)
                    imp = imp or s.scores(rec)
                    built[(b, q8)] = build(rec, imp, b, s.config)
                # the same tiers for every mode; a packing store turns the heads into views, so each gets a copy
                s.load(copy.deepcopy(built[(b, q8)]))
                stores[key] = s
        imp = rec = None
        dense.prefill = []
        print(f"context {C}: {len(stores) - 1} composed stores built", flush=True)
        steps = {(key, th): [] for key in configs for th in a.threads}
        attn = {(key, th): [] for key in configs for th in a.threads}
        qa = torch.randn(1, eng.n_kv, eng.n_heads // eng.n_kv, eng.head_dim, generator=torch.Generator().manual_seed(1))
        for r in range(repeats):
            for th in a.threads:
                torch.set_num_threads(th)
                order = configs[r % len(configs):] + configs[:r % len(configs)]     # rotate the order per round
                for key in order:
                    eng.kv = stores[key]
                    eng.cursor.length.fill_(C)
                    eng.cursor.host = C
                    with torch.no_grad():
                        for j in range(new):
                            t0 = time.perf_counter()
                            logits = eng.step(ids[:, C + j])
                            steps[(key, th)].append(time.perf_counter() - t0)
                        if not torch.isfinite(logits).all():
                            raise RuntimeError(f"{key[0]}: non-finite logits")
                        ctx = eng.step_context(1, eng.cursor.host + 1)     # as the next step would read
                        for _ in range(5):
                            t0 = time.perf_counter()
                            for i in range(eng.n_layers):
                                eng.kv.attend(i, qa, ctx)
                            attn[(key, th)].append(time.perf_counter() - t0)
            print(f"context {C}: round {r + 1}/{repeats} done", flush=True)
        for th in a.threads:
            d_ms = statistics.median(steps[(configs[0], th)]) * 1e3
            d_at = statistics.median(attn[(configs[0], th)]) * 1e3
            for key in configs:
                label, mode, b, q8 = key
                s = stores[key]
                ms = statistics.median(steps[(key, th)]) * 1e3
                at = statistics.median(attn[(key, th)]) * 1e3
                prompt = (s.report().get("packed_bytes") if mode is not None else
                          2 * eng.n_layers * eng.n_kv * C * eng.head_dim * eng.dtype.itemsize)
                rows.append(dict(store=label, attention=mode, budget=b, quant8=q8, context=C, threads=th,
                                 decode_ms_per_token=round(ms, 3), attn_ms_per_token=round(at, 3),
                                 kv_bytes=s.nbytes, prompt_kv_bytes=prompt, ratio_vs_dense=round(ms / d_ms, 3),
                                 attn_ratio_vs_dense=round(at / d_at, 3)))
        meta["load_average"][f"after_context_{C}"] = load_average()
        files.write({"rows": rows, **meta}, txt=table(rows))
        del eng, stores, dense
    txt = table(rows)
    files.write({"rows": rows, **meta}, txt=txt)
    print(txt)
    print(f"\nwrote {files.path}")
    return {"rows": rows, **meta}


def table(rows: list[dict]) -> str:
    head = (f"{'context':>7} {'thr':>3} {'store':<24}{'attn':<7}{'budget':>7} {'ms/tok':>8} {'x dense':>8} "
            f"{'attn ms':>8} {'x dense':>8} {'prompt MB':>10}")
    lines = [head]
    for r in rows:
        b = "" if r["budget"] is None else f"{r['budget']:.3f}"
        lines.append(f"{r['context']:>7} {r['threads']:>3} {r['store']:<24}{r['attention'] or '':<7}{b:>7} "
                     f"{r['decode_ms_per_token']:>8.2f} {r['ratio_vs_dense']:>8.3f} {r['attn_ms_per_token']:>8.3f} "
                     f"{r['attn_ratio_vs_dense']:>8.3f} {r['prompt_kv_bytes'] / 1e6:>10.2f}")
    return "\n".join(lines)
