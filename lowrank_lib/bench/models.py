"""Models for benchmarks: a named/dir model compressed by a family, a checkpoint, or random weights at the
geometries users run (in memory: :func:`random_llama`; on disk, memory-mapped: :func:`load_shape_model`)."""
from __future__ import annotations

import json
from pathlib import Path

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


# --------------------------------------------------------------------------- real geometries, random weights, on disk
#: The geometries users run (random weights: decode speed does not depend on the values). Llama-3.2-1B's
#: llama3 RoPE scaling is left out (plain RoPE at its theta): it changes no shape and no byte count.
SHAPES: dict[str, dict] = {
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0),
    "llama2-7b": dict(LLAMA7B, head_dim=128, tie_word_embeddings=False, rope_theta=10000.0),
}
#: std of the random weights (transformers' Llama initializer range)
INIT_STD = 0.02
_MARK = "lowrank_lib_random.json"
_FORMAT = 1


def shape_config(shape: str, layers: int | None = None, overrides: dict | None = None):
    """The ``LlamaConfig`` of a :data:`SHAPES` geometry; ``layers`` cuts the layer count, ``overrides`` replaces
    any other field (tests and dry runs: e.g. a smaller vocabulary)."""
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use one of {sorted(SHAPES)}")
    kw = dict(SHAPES[shape])
    theta = kw.pop("rope_theta")
    if layers is not None:
        kw["num_hidden_layers"] = int(layers)
    kw.update(overrides or {})
    return LlamaConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": theta},
                       attn_implementation="sdpa", dtype="bfloat16")


def _tensor_seed(seed: int, name: str) -> int:
    """A seed per (run seed, tensor name): every tensor is reproducible alone, in any order."""
    import hashlib

    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _randn(shape, seed: int, name: str, std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(_tensor_seed(seed, name))
    return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)


def proj_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out, in) of each decoder projection of one layer."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    return {"self_attn.q_proj": (q, H), "self_attn.k_proj": (kv, H), "self_attn.v_proj": (kv, H),
            "self_attn.o_proj": (H, q), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I)}


def shape_dir(shape: str, keep: float | None = None, seed: int = 0, layers: int | None = None,
              cache_dir=None, overrides: dict | None = None) -> Path:
    """Folder of the random weights of ``shape`` (dense) or of its random keep-``keep`` factors."""
    import hashlib

    from .. import models

    root = Path(cache_dir) if cache_dir is not None else models.default_cache_dir() / "random-models"
    o = "" if not overrides else "-o" + hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:8]
    name = f"{shape}{'' if layers is None else f'-L{layers}'}{o}-s{seed}" + ("" if keep is None else f"-keep{keep}")
    return root / name


def write_shape_weights(shape: str, keep: float | None = None, seed: int = 0, layers: int | None = None,
                        cache_dir=None, progress: bool = True, overrides: dict | None = None) -> Path:
    """Write (once) the random bf16 weights of a geometry as safetensors shards; returns the folder.

    Dense (``keep=None``): one shard per layer (its 7 projections and 2 norms, ``model.layers.<i>.*``
    names) and ``rest.safetensors`` (embedding, final norm, untied head); weights ~ N(0, 0.02), norms 1.
    ``keep``: one shard per layer with random factors ``U`` [out, r] ~ N(0, 1/r), ``V`` [r, in] ~ N(0, 1/in)
    of the canonical rank ``keep_rank(out, in, keep)`` (timing only: they are not factors of the dense
    weights); embedding, norms and head are the dense folder's. Every tensor has its own seed, so a file is
    the same whoever writes it. A marker written last says the folder is complete; an incomplete folder
    is rewritten. One layer is in memory at a time (a 7B model is written in ~400 MB steps).
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    cfg = shape_config(shape, layers, overrides)
    d = shape_dir(shape, keep, seed, layers, cache_dir, overrides)
    want = {"format": _FORMAT, "shape": shape, "keep": keep, "seed": seed, "layers": cfg.num_hidden_layers,
            "init_std": INIT_STD, "overrides": overrides or {}}
    mark = d / _MARK
    if mark.exists() and json.loads(mark.read_text()).get("spec") == want:
        return d
    if keep is not None:
        write_shape_weights(shape, None, seed, layers, cache_dir, progress, overrides)   # embedding, norms, head
    d.mkdir(parents=True, exist_ok=True)
    mark.unlink(missing_ok=True)
    shapes = proj_shapes(cfg)
    H = cfg.hidden_size
    for i in tqdm(range(cfg.num_hidden_layers), desc=f"random {d.name}", disable=not progress):
        p = f"model.layers.{i}."
        t = {}
        for n, (o, k) in shapes.items():
            if keep is None:
                t[p + n + ".weight"] = _randn((o, k), seed, p + n, INIT_STD)
            else:
                r = keep_rank(o, k, keep)
                t[p + n + ".U"] = _randn((o, r), seed, f"keep{keep}:{p}{n}.U", r ** -0.5)
                t[p + n + ".V"] = _randn((r, k), seed, f"keep{keep}:{p}{n}.V", k ** -0.5)
        if keep is None:
            t[p + "input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
            t[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        save_file(t, str(d / f"layer-{i:03d}.safetensors"))
    if keep is None:
        rest = {"model.embed_tokens.weight": _randn((cfg.vocab_size, H), seed, "model.embed_tokens", INIT_STD),
                "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
        if not cfg.tie_word_embeddings:
            rest["lm_head.weight"] = _randn((cfg.vocab_size, H), seed, "lm_head", INIT_STD)
        save_file(rest, str(d / "rest.safetensors"))
    cfg.save_pretrained(d)
    mark.write_text(json.dumps({"spec": want, "bytes": sum(f.stat().st_size for f in d.glob("*.safetensors"))}))
    return d


def load_shape_model(shape: str, keep: float | None = None, seed: int = 0, layers: int | None = None,
                     cache_dir=None, progress: bool = True, overrides: dict | None = None):
    """A bf16 ``LlamaForCausalLM`` of a geometry whose weights are the files of :func:`write_shape_weights`,
    memory-mapped (safetensors loads zero-copy: the pages are the OS's file cache, not this process's
    memory, so an engine built from it holds the only resident copy). ``keep``: the projections are
    ``LowRankLinear`` of the random factors. Written on first use."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    dense_d = write_shape_weights(shape, None, seed, layers, cache_dir, progress, overrides)
    cfg = shape_config(shape, layers, overrides)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    sd = {}
    for f in sorted(dense_d.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    if keep is not None:
        fd = write_shape_weights(shape, keep, seed, layers, cache_dir, progress, overrides)
        factors = {}
        for f in sorted(fd.glob("layer-*.safetensors")):
            factors.update(load_file(str(f)))
        new = {}
        for name, _ in iter_linears(model):
            sd.pop(name + ".weight")
            U, V = factors[name + ".U"], factors[name + ".V"]
            with torch.device("meta"):
                new[name] = LowRankLinear(torch.empty(U.shape, dtype=U.dtype), torch.empty(V.shape, dtype=V.dtype))
            sd[name + ".U"], sd[name + ".V"] = U, V
        replace_with_factors(model, new, {"family": "random", "keep": keep, "shared_groups": []})
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{dense_d}: weights missing {sorted(set(missing) - tied)[:4]}, unexpected {unexpected[:4]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)                                           # served, never trained
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)      # its buffers were on meta
    left = [k for k, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{dense_d}: tensors {left[:4]} were never loaded")
    return model.eval()
