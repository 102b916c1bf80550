"""Engine configuration: one dataclass, passed explicitly (no environment variables)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from .attention import BACKENDS as ATTENTION_REGISTRY
from .kernels.gemv import KERNEL_MODES
from .kernels.layer import FUSED_MODES
from .kv import STORES
from .lm_head import LM_HEADS
from .packing import LAYOUTS

GRAPH_MODES = ("none", "split", "per-layer", "whole-step")
KV_MODES = tuple(STORES)
ATTENTION_BACKENDS = ("auto", *ATTENTION_REGISTRY)

_DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
           "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(d) -> torch.dtype | None:
    """``"bf16"``/``"fp32"``/``"fp16"``/a torch.dtype/None -> torch.dtype or None."""
    if d is None or isinstance(d, torch.dtype):
        return d
    try:
        return _DTYPES[str(d).lower()]
    except KeyError:
        raise ValueError(f"unknown dtype {d!r}; use one of {sorted(_DTYPES)}") from None


@dataclass
class EngineConfig:
    """Switches of the decode runtime (each one is a mechanism of the FlashSVD v1.5 ablation).

    Parameters
    ----------
    max_batch, max_seq_len : the KV store is allocated ONCE for this many rows and slots (the dense
        store: [max_batch, Hkv, max_seq_len, D] per layer). A request with prompt + new tokens >
        max_seq_len is refused (``CacheFullError``) before any work: no silent truncation, no sliding window.
    dtype, device : None = the model's own.
    kv : the default store when ``Engine(..., kv=None)``: ``"dense"`` (reconstruct only the current
        token, append to the dense cache) or ``"rebuild"`` (the slow route: keep the k/v history as
        rank-space latents and rebuild dense K/V of the whole history every step, the paper's naive
        low-rank path). Any other ``runtime.kv.KVStore`` is passed as ``Engine(..., kv=store)``.
    pack_qkv, pack_mlp : one GEMM into rank space for q,k,v (resp. gate,up), then the per-projection
        U factors. Exact algebra; a basis shared by several projections is applied once.
    fold_rope : store [U; P U] for q and k (P = RoPE's signed rotate-half permutation, exact in
        floating point) so one GEMM yields q and rotate_half(q); RoPE is then 1 mul + 1 sum.
        Applied only when every q/k projection is low rank (for a dense W it doubles the bytes read).
    fold_norm : fold each RMSNorm weight into the next stage-1 GEMM (S diag(w)), saving one
        elementwise op per norm. Exact in real arithmetic but NOT in floating point: on SmolLM2
        (norm weights with outliers) logits drift by ~1e-3 in fp32, so it is off by default.
    weight_layout : ``"auto"`` (default), ``"out_major"`` (nn.Linear's [out, in]) or ``"in_major"``:
        how each GEMM operand is stored (``runtime.packing.pick_layout``). Same bytes and dot
        products; on CPU a one-row GEMM over a wide matrix runs ~2x faster with the long side
        contiguous, so ``auto`` stores those [in, out]. On CUDA ``auto`` keeps out_major.
    attention : backend name or ``"auto"`` (flash_attn > triton > sdpa on CUDA; on CPU ``lrk_attend``, our
        compiled decode-attention kernel, when ``kernels`` allows it and it can run, else sdpa).
    kernels : our compiled CPU kernels (``runtime/kernels``): ``"auto"`` (where they can run: the
        library loads or builds, the CPU has the ISA, fp32/bf16; else the portable path, and
        ``Engine.report()`` says why), ``"portable"`` (never: aten / inductor only) or ``"lrk"`` (always;
        an error says why when they cannot run). Covers EVERY native kernel: the decode GEMVs, the
        certified head's kernel, and with ``attention="auto"`` the decode attention and a ``MethodStore``'s
        tiered attention (``"portable"`` with a native backend requested by name is an error).
    graph : ``"none"``, ``"split"`` (attention and MLP captured apart), ``"per-layer"``,
        ``"whole-step"`` (embedding to logits). CUDA graphs on CUDA; on CPU the same regions are
        ``torch.compile``-d (inductor, fixed shapes, ``fullgraph=True``); compile/capture time is
        reported in ``Engine.capture_s``.
    fused_compile : only when the step is ``torch.compile``-d (CPU graphs): one-row GEMMs over
        out_major operands and the sdpa decode attention are traced as broadcast-multiply-reduce
        expressions that inductor fuses into single vectorised loops (``runtime.packing._mm``,
        ``runtime.attention.fused_decode``). False keeps aten mm / SDPA calls inside the graph.
    compile_backend : torch.compile backend used for CPU "graphs" and ``graph_compile`` (``"inductor"``;
        ``"aot_eager"`` checks tracing without code generation).
    graph_compile : CUDA graphs, ``graph="whole-step"`` only: the captured step is first ``torch.compile``-d (``compile_backend``,
        fullgraph, static shapes; the decode-attention kernel stays one opaque op), so the graph replays
        inductor's fused kernels (norms, RoPE, SiLU, residual adds, one-row GEMMs as fused reductions) instead of
        one kernel per ATen op. Measured on an H200 (2026-12-04): the plain capture of a LLaMA-7B-shaped keep 0.5
        step still runs ~1100 kernels and reads its 7.3 GB at 3.5x the copy roofline. No effect on the CPU,
        whose "graphs" are compiled already.
    skip_guards : CPU compiled step only: dynamo evaluates no guard before each call (its
        ``skip_all_guards_unsafe`` filter). Safe here: every capture compiles its OWN code object, whose
        one cache entry is only ever called by its GraphRunner with the inputs it was made for (the
        batch size and store shape key are the capture's key; every tensor the step reads is owned by
        the engine and never replaced while the capture lives; ``GraphRunner.invalidate()`` drops it
        otherwise). Saves the per-step guard evaluation (hundreds of tensor checks).
    cpp_wrapper : CPU compiled step only: inductor's C++ wrapper instead of its Python wrapper (no
        Python between the kernels of a step; a longer cold compile).
    fused_layer : ``"auto"`` (default), ``"off"`` or ``"on"``: the decode step as ONE compiled call for all layers
        (``decode_stack`` on the dense store, ``decode_stack_tiers`` on a tiered one; one call per layer while a
        profiler marks layers)
        (``runtime/kernels/layer.cpp``: norms, packed GEMVs, RoPE, KV write, attention, MLP, residuals), where what it
        fuses is what would run anyway (packed GEMVs, the dense store with our attention kernel, packed fp32 / bf16 groups
        and int8 / int4 quantized groups through ``qgemv`` where this CPU has it, SiLU,
        ``max_batch`` <= 8; ``kernels="portable"`` rules it out); ``Engine.report()["fused_layer_reason"]`` says why
        (not). ``"on"`` raises where it cannot run. Prefill and the other stores keep the per-op layer.
    lm_head : ``"exact"`` (default) or ``"certified"``: decode logits from an int8 copy of the head with
        per-row error bounds, the exact head multiplied only on the 64-row blocks whose rows can still be
        the argmax (all of them when more than a quarter would be). Greedy decoding gives exactly the
        exact head's tokens (provably, ties included); the returned logits are exact on the evaluated
        rows and the approximate scores (within their bound) elsewhere, so SAMPLING draws from those
        logits, not the exact distribution: use ``"exact"`` to sample. Prefill logits stay exact. See
        ``runtime/lm_head.py``; ``Engine.report()["lm_head"]`` counts each path. ``"certified_q8"`` /
        ``"certified_q4"``: the same guarantee over a group-wise int8 / int4 copy (``quant``, scored by
        ``qgemv``). ``"q8"`` / ``"q4"``: APPROXIMATE, the decode logits are the group-wise quantized head's
        (greedy tokens may differ from the exact head's; for heads without margins, e.g. random weights).
    """

    max_batch: int = 1
    max_seq_len: int = 2048
    dtype: torch.dtype | str | None = None
    device: str | None = None
    kv: str = "dense"
    pack_qkv: bool = True
    pack_mlp: bool = True
    fold_rope: bool = True
    fold_norm: bool = False
    weight_layout: str = "auto"
    attention: str = "auto"
    graph: str = "none"
    fused_compile: bool = True
    compile_backend: str = "inductor"
    graph_compile: bool = False
    kernels: str = "auto"
    skip_guards: bool = True
    cpp_wrapper: bool = False
    lm_head: str = "exact"
    fused_layer: str = "auto"

    def __post_init__(self):
        self.dtype = parse_dtype(self.dtype)
        if self.kv not in KV_MODES:
            raise ValueError(f"kv={self.kv!r}: use one of {KV_MODES}")
        if self.graph not in GRAPH_MODES:
            raise ValueError(f"graph={self.graph!r}: use one of {GRAPH_MODES}")
        if self.weight_layout not in LAYOUTS:
            raise ValueError(f"weight_layout={self.weight_layout!r}: use one of {LAYOUTS}")
        if self.kernels not in KERNEL_MODES:
            raise ValueError(f"kernels={self.kernels!r}: use one of {KERNEL_MODES}")
        if self.fused_layer not in FUSED_MODES:
            raise ValueError(f"fused_layer={self.fused_layer!r}: use one of {FUSED_MODES}")
        if self.lm_head not in LM_HEADS:
            raise ValueError(f"lm_head={self.lm_head!r}: use one of {LM_HEADS}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention={self.attention!r}: use one of {ATTENTION_BACKENDS}")
        if self.graph_compile and self.graph != "whole-step":
            raise ValueError("graph_compile compiles the captured step: it needs graph='whole-step' (the per-region "
                             "modes exist to count launches; compiled, they are untested)")
        if self.kv == "rebuild" and self.graph != "none":
            raise ValueError("kv='rebuild' grows its work with the history: it runs eagerly (graph='none')")
        if self.max_batch < 1 or self.max_seq_len < 2:
            raise ValueError(f"max_batch={self.max_batch}, max_seq_len={self.max_seq_len}: need >= 1 and >= 2")

    def to_dict(self) -> dict:
        d = asdict(self)
        d["dtype"] = None if self.dtype is None else str(self.dtype).replace("torch.", "")
        return d


#: Named configurations used by benchmarks and notebooks (the paper's systems + our extras).
PRESETS: dict[str, dict] = {
    "engine": dict(),
    # the paper's baselines run the portable path (aten GEMMs, sdpa): our kernels are a mechanism of the engine
    "dense_kv": dict(pack_qkv=False, pack_mlp=False, fold_rope=False, fold_norm=False, weight_layout="out_major",
                     graph="none", kernels="portable"),
    "naive": dict(kv="rebuild", pack_qkv=False, pack_mlp=False, fold_rope=False, fold_norm=False,
                  weight_layout="out_major", graph="none", kernels="portable"),
}
