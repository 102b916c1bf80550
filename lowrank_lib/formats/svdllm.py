"""SVD-LLM v1 / v2 native checkpoints: ``<model>_whitening_only_<keep>.pt`` (pickled whole model).

Layout (spec §1): ``torch.save({'model': LlamaForCausalLM, 'tokenizer': tok})`` where every
``layers[i].self_attn`` is ``component.svd_llama.SVD_LlamaAttention`` holding
``{q,k,v,o}_u_proj`` ([out, r], fp32) / ``{q,k,v,o}_v_proj`` ([r, in], fp32) and a per-layer
``rotary_emb`` (``component.svd_llama.LlamaRotaryEmbedding``, persistent ``inv_freq``), and every
``mlp`` is ``component.svd_llama.SVD_LlamaMLP`` with ``{gate,up,down}_{u,v}_proj`` and
``transformers.activations.SiLUActivation``. Embeddings, norms and lm_head stay fp16; the model
carries ``seqlen = 2048``. Sigma is split sqrt/sqrt. "ratio" in the file name is the KEEP fraction.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from ..factorized import LLAMA_PROJ
from ..geometry import geometry
from .build import build_model, llama_config
from .errors import fail, guarded
from .common import factor_modules, fake_class, keep_from_name, linear_from, pickle_copy, registered
from .pickled import pair_factors, read_pickled_model

ATTN = fake_class("component.svd_llama.SVD_LlamaAttention")
MLP = fake_class("component.svd_llama.SVD_LlamaMLP")
ROPE = fake_class("component.svd_llama.LlamaRotaryEmbedding")
FAMILY_CLASSES = ("component.svd_llama.", "component.svd_mistral.", "component.svd_opt.")


def native_filename(model_name: str, keep: float, variant: str = "v1") -> str:
    """``jeffwan/llama-7b-hf``, 0.8 -> ``jeffwan_llama_7b_hf_whitening_only_0.8.pt`` (v2: ``_v2_``)."""
    stem = model_name.replace("/", "_").replace("-", "_")
    return f"{stem}_{'whitening_only' if variant == 'v1' else 'v2'}_{keep}.pt"


def write(model, path: str | Path, tokenizer=None, model_name: str = "model", keep: float | None = None,
          base_dtype: torch.dtype | None = torch.float16) -> Path:
    """Write ``model`` (all 7 projections factorized) as an SVD-LLM pickle; ``path`` a file or a folder.

    Factors are stored fp32 (as SVD-LLM does); the rest in ``base_dtype`` (fp16 natively, None keeps it).
    """
    facs = factor_modules(model, LLAMA_PROJ, "SVD-LLM")
    meta = getattr(model, "lowrank_meta", {}) or {}
    path = Path(path)
    if path.suffix != ".pt":
        path.mkdir(parents=True, exist_ok=True)
        path = path / native_filename(model_name, keep if keep is not None else meta.get("keep", 1.0),
                                      meta.get("variant", "v1"))
    inv_freq = model.model.rotary_emb.inv_freq.detach().float().clone()   # SVD-LLM's rotary is built in fp32
    m = pickle_copy(model, base_dtype)
    cfg = m.config
    for i, layer in enumerate(m.model.layers):
        mlp = layer.mlp
        new_at = ATTN()
        new_at.config = cfg
        new_at.hidden_size = cfg.hidden_size
        new_at.num_heads = geometry(cfg).n_heads
        new_at.head_dim = geometry(cfg).head_dim
        new_at.max_position_embeddings = cfg.max_position_embeddings
        rope = ROPE()
        rope.register_buffer("inv_freq", inv_freq.clone(), persistent=True)
        rope.max_seq_len_cached = cfg.max_position_embeddings
        for p in ("q", "k", "v", "o"):
            f = facs[f"model.layers.{i}.self_attn.{p}_proj"]
            setattr(new_at, f"{p}_u_proj", linear_from(f.U.float(), None if f.bias is None else f.bias.float()))
            setattr(new_at, f"{p}_v_proj", linear_from(f.V.float()))
        new_at.rotary_emb = rope
        layer.self_attn = new_at
        new_mlp = MLP()
        for p in ("gate", "up", "down"):
            f = facs[f"model.layers.{i}.mlp.{p}_proj"]
            setattr(new_mlp, f"{p}_u_proj", linear_from(f.U.float(), None if f.bias is None else f.bias.float()))
            setattr(new_mlp, f"{p}_v_proj", linear_from(f.V.float()))
        new_mlp.act_fn = mlp.act_fn
        layer.mlp = new_mlp
    m.seqlen = 2048
    m.__dict__.pop("lowrank_meta", None)
    with registered([ATTN, MLP, ROPE]):
        torch.save({"model": m, "tokenizer": tokenizer}, path)
    return path


_FACTOR = re.compile(r"^(?P<base>.*)\.(?P<p>\w+)_(?P<side>[uv])_proj\.(?P<kind>weight|bias)$")


@guarded
def read(path: str | Path, dtype=None, allow_nonfinite: bool = False,
         progress: bool = False):
    """SVD-LLM pickle -> the ONE representation (tensors only; nothing unpickled is executed)."""
    path = Path(path)
    tree, cfg = read_pickled_model(path, "svdllm")
    if any(c.startswith("component.svd_opt.") for c in tree.classes):
        fail(path, "an SVD-LLM OPT checkpoint (component.svd_opt): lowrank_lib rebuilds Llama-family models only")
    if not any(c.startswith(FAMILY_CLASSES) for c in tree.classes):
        fail(path, "no component.svd_* modules in the pickle; not an SVD-LLM checkpoint")
    dense, factors = pair_factors(tree.state(), _FACTOR, lambda g: f"{g['base']}.{g['p']}_proj",
                                  lambda g, side, kind: f"{g['base']}.{g['p']}_{side}_proj.{kind}", "u", "v", path,
                                  "SVD-LLM keeps a bias on the u projection only")
    cfg_obj = llama_config(cfg, str(path))
    variant = "v2" if "_v2_" in path.name else "v1"
    meta = {"family": "svdllm", "variant": variant, "keep": keep_from_name(path.name), "shared_groups": []}
    return build_model(cfg_obj, dense, factors, meta, path, dtype, allow_nonfinite, buffers=set(tree.buffers), progress=progress)


__all__ = ["native_filename", "read", "write"]

