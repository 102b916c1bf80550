"""Rebuild the ONE representation from a config and plain tensors (shared by every reader).

Readers map their native keys to canonical names and hand over

* ``dense``: ``{state_dict key: tensor}`` for everything that stays dense (embeddings, norms,
  lm_head, dense projections),
* ``factors``: ``{module name: (U [out, r], V [r, in], bias [out] | None)}``; passing the SAME
  tensor object for several modules makes it ONE shared ``nn.Parameter`` (a shared basis).

:func:`build_model` checks every shape against the config BEFORE touching the model, so a bad file
raises :class:`CheckpointError` naming the file, the tensor, the expected and the found shape and
nothing half-built is returned.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..factorized import LowRankLinear, account, replace_with_factors, shared_groups

#: Llama-family architecture fields read from a (pickled, 4.x or 5.x) config.
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings", "attention_bias", "mlp_bias", "head_dim", "bos_token_id", "eos_token_id",
               "pad_token_id", "rope_parameters", "initializer_range")
#: Buffers some families carry that a rebuilt model recomputes (SVD-LLM's per-layer rotary).
IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


class CheckpointError(ValueError):
    """A checkpoint does not match what its layout promises (names file, tensor, shapes)."""


def llama_config(d: dict, source: str = "<config>"):
    """A ``LlamaConfig`` from plain config values (transformers 4.x or 5.x field names)."""
    from transformers import LlamaConfig

    missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                           "num_attention_heads") if d.get(k) is None]
    if missing:
        raise CheckpointError(f"{source}: config lacks {missing}; cannot rebuild the model")
    kw = {k: d[k] for k in CONFIG_KEYS if d.get(k) is not None}
    if "rope_parameters" not in kw:
        rp = {"rope_type": "default", "rope_theta": float(d.get("rope_theta") or 10000.0)}
        scaling = d.get("rope_scaling")
        if isinstance(scaling, dict):
            rp.update({k: v for k, v in scaling.items() if k != "type"})
            rp["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        kw["rope_parameters"] = rp
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    cfg = LlamaConfig(**kw, attn_implementation="sdpa")
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def config_dict(model) -> dict:
    """The architecture part of a model's config as plain JSON-able values."""
    d = model.config.to_dict()
    return {k: d[k] for k in CONFIG_KEYS if k in d}


def _shape(t) -> tuple:
    return tuple(t.shape)


def build_model(cfg, dense: dict[str, torch.Tensor], factors: dict[str, tuple], meta: dict, source: str | Path,
                dtype: torch.dtype | None = torch.float32, ignore_extra: tuple[str, ...] = IGNORED_SUFFIXES):
    """Construct ``LlamaForCausalLM(cfg)``, put in the factors and dense tensors; all shapes checked first.

    ``dtype=None`` keeps the stored dtype of each tensor (mixed dtypes cannot run a forward on the
    CPU; the default casts everything to float32).
    """
    from transformers import LlamaForCausalLM

    source = str(source)
    if not isinstance(cfg, dict):
        cfg_obj = cfg
    else:
        cfg_obj = llama_config(cfg, source)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(cfg_obj).eval()
    mods = dict(model.named_modules())
    # ---- check factors
    for name, (U, V, b) in factors.items():
        lin = mods.get(name)
        if not isinstance(lin, nn.Linear):
            raise CheckpointError(f"{source}: factors for '{name}', which is not a projection of this "
                                  f"{cfg_obj.num_hidden_layers}-layer model")
        o, i = lin.out_features, lin.in_features
        if U.dim() != 2 or V.dim() != 2 or U.shape[0] != o or V.shape[1] != i or U.shape[1] != V.shape[0]:
            raise CheckpointError(f"{source}: '{name}' factors U {_shape(U)} V {_shape(V)}; expected U [{o}, r] "
                                  f"and V [r, {i}] with the same r")
        if b is not None and _shape(b) != (o,):
            raise CheckpointError(f"{source}: '{name}' bias has shape {_shape(b)}, expected ({o},)")
    # ---- check dense tensors
    sd = model.state_dict()
    fact_keys = {f"{n}.{s}" for n in factors for s in ("weight", "bias")}
    tied = bool(getattr(cfg_obj, "tie_word_embeddings", False)) and "lm_head" not in factors
    expected = {k: v for k, v in sd.items() if k not in fact_keys and not k.endswith(ignore_extra)}
    if tied:
        expected.pop("lm_head.weight", None)
        dense = {k: v for k, v in dense.items() if k != "lm_head.weight"}
    extra = [k for k in dense if k not in expected and not k.endswith(ignore_extra)]
    if extra:
        raise CheckpointError(f"{source}: unexpected tensor(s) {extra[:5]} for this layout")
    missing = [k for k in expected if k not in dense]
    if missing:
        raise CheckpointError(f"{source}: missing tensor(s) {missing[:5]} (expected by the config)")
    for k, ref in expected.items():
        if _shape(dense[k]) != _shape(ref):
            raise CheckpointError(f"{source}: tensor '{k}' has shape {_shape(dense[k])}, expected {_shape(ref)}")
    # ---- assemble (nothing above touched the model)
    cast = (lambda t: t.to(dtype)) if dtype is not None else (lambda t: t)
    params: dict[int, nn.Parameter] = {}

    def param(t):
        if id(t) not in params:
            params[id(t)] = nn.Parameter(cast(t.detach()).contiguous(), requires_grad=False)
        return params[id(t)]

    new = {n: LowRankLinear(param(U), param(V), None if b is None else param(b)) for n, (U, V, b) in factors.items()}
    model = replace_with_factors(model, new)
    with torch.no_grad():
        own = dict(model.named_parameters(remove_duplicate=False))
        own.update(dict(model.named_buffers(remove_duplicate=False)))
        for k, v in dense.items():
            if k in own and not k.endswith(ignore_extra):
                tgt = own[k]
                tgt.data = cast(v.detach()).contiguous() if dtype is not None else v.detach().contiguous()
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    if dtype is not None:
        model.to(dtype)
    model.requires_grad_(False)
    info = dict(meta)
    info.setdefault("shared_groups", shared_groups(model))
    info["realised_keep"] = account(model).linear_keep
    info["source"] = source
    model.lowrank_meta.update(info)
    return model


def check_aliases(tensors: list[tuple[str, torch.Tensor]], source: str) -> torch.Tensor:
    """All named tensors must be equal (they are aliases of one shared basis); return the first."""
    name0, t0 = tensors[0]
    for name, t in tensors[1:]:
        if _shape(t) != _shape(t0):
            raise CheckpointError(f"{source}: shared tensor '{name}' has shape {_shape(t)}, its alias '{name0}' "
                                  f"has {_shape(t0)}")
        if t is not t0 and not torch.equal(t, t0):
            raise CheckpointError(f"{source}: '{name}' and '{name0}' should be the same shared basis but differ "
                                  f"(max abs diff {float((t.float() - t0.float()).abs().max()):.3g}); refusing")
    return t0
