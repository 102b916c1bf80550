"""Models for benchmarks: a named/dir model compressed by a family, a checkpoint, or random 7B shapes."""
from __future__ import annotations

import torch
from torch import nn

from ..factorized import LLAMA_PROJ, LowRankLinear, iter_linears, replace_with_factors
from ..ranks import keep_rank

#: LLaMA-7B geometry (speed does not depend on weight values).
LLAMA7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-6)


def random_llama(shape: dict, dtype=torch.bfloat16, device="cpu", seed: int = 0, **overrides):
    """A ``LlamaForCausalLM`` of the given geometry with small random weights, built on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**shape, **overrides}, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        cfg.torch_dtype = dtype
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
    return model.eval()


@torch.no_grad()
def random_lowrank(model: nn.Module, keep: float, targets=LLAMA_PROJ) -> nn.Module:
    """Swap every target projection for random factors of the canonical keep rank (in place).

    For timing only: U [out, r], V [r, in] ~ N(0, 1/sqrt(fan)) so activations stay O(1).
    """
    new = {}
    for name, lin in list(iter_linears(model, targets)):
        r = keep_rank(lin.out_features, lin.in_features, keep)
        W = lin.weight
        U = torch.randn(lin.out_features, r, dtype=W.dtype, device=W.device) / r ** 0.5
        V = torch.randn(r, lin.in_features, dtype=W.dtype, device=W.device) / lin.in_features ** 0.5
        new[name] = LowRankLinear(U, V)
    return replace_with_factors(model, new, {"family": "random", "keep": keep, "shared_groups": []})


def load_bench_models(model: str, method: str = "svd", keep: float = 0.5, checkpoint: str | None = None,
                      device: str = "cpu", calib_samples: int = 8, calib_seq_len: int = 256):
    """-> (dense_model, compressed_model, tokenizer or None), both fp32 unless 7B-shaped (bf16).

    ``model``: ``smollm2``, a tiny preset, a local HF dir, or ``llama7b-random``.
    ``method``: ``svd`` (plain truncated SVD, default) or a name in ``lowrank_lib.compress.COMPRESSORS``
    (calibrated on ``calib_samples`` windows). ``checkpoint``: read factors with
    ``lowrank_lib.formats.load_checkpoint`` instead (imported only then).
    """
    import copy

    from .. import models
    from ..compress import compress_svd

    if model == "llama7b-random":
        dense = random_llama(LLAMA7B, torch.bfloat16, device)
        comp = random_lowrank(copy.deepcopy(dense), keep)
        return dense, comp, None
    dense, tok = models.load(model, device=device)
    if checkpoint:
        from ..formats import load_checkpoint

        return dense, load_checkpoint(checkpoint, dtype=dense.dtype).to(device).eval(), tok
    if method == "svd":
        return dense, compress_svd(dense, keep), tok
    from ..compress import COMPRESSORS, collect_stats
    from ..compress.calib import calibration_data

    if method not in COMPRESSORS:
        raise ValueError(f"unknown method {method!r}: use 'svd' or one of {sorted(COMPRESSORS)}")
    ids = calibration_data(tok, calib_samples, calib_seq_len, vocab_size=dense.config.vocab_size)
    stats = collect_stats(dense, ids)
    return dense, COMPRESSORS[method](dense, stats, keep), tok
