"""Basis Sharing native checkpoints: ``share_llama`` HF folder with ``pytorch_model.bin`` (spec §5).

Keys (Llama): shared basis ``model.layers.<i>.self_attn.q_basis.weight`` [nb, in] (ALL of Sigma),
its alias ``model.q_basis.<i>.weight`` (ModuleDict entry per layer, same tensor), coefficient
``model.layers.<i>.self_attn.q_proj.weight`` [out, nb]; same for k, v, o (self_attn) and gate,
up, down (mlp). Every aliased key is written (transformers' .bin save keeps them) and shares one
storage on disk. ``config.json`` adds ``architectures: ["ShareLlamaForCausalLM"]``,
``num_basis_<t>``, ``<t>_groups`` (lists of layer lists) and ``use_cache: false``; fp32.
"ratio" (``compression_ratio``) is the percent REMOVED over a group.

Reading: for each group, every alias of its basis must be equal (else refused) and becomes ONE
``nn.Parameter`` shared by the group's ``LowRankLinear`` modules (their ``V``).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from ..factorized import LLAMA_PARENT as PARENT
from ..factorized import LLAMA_PROJ
from .build import build_model, check_aliases, llama_config
from .common import dense_state, factor_modules, family_config, finish_dir, plain_config, read_torch_bin_dir
from .errors import brief, fail, guarded

TYPES = [p.replace("_proj", "") for p in LLAMA_PROJ]


def native_dirname(model_name: str, keep: float) -> str:
    return f"share_{model_name.rstrip('/').split('/')[-1]}_{round((1 - keep) * 100)}"


def write(model, path: str | Path, tokenizer=None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    facs = factor_modules(model, LLAMA_PROJ, "Basis Sharing")
    n_layers = model.config.num_hidden_layers
    sd = dense_state(model, set(facs))
    extra = {}
    for t in TYPES:
        parent = PARENT[f"{t}_proj"]
        groups: dict[int, list[int]] = {}
        bases = {}
        for i in range(n_layers):
            f = facs[f"model.layers.{i}.{parent}.{t}_proj"]
            groups.setdefault(id(f.V), []).append(i)
            bases[id(f.V)] = f.V.detach()
        for i in range(n_layers):
            f = facs[f"model.layers.{i}.{parent}.{t}_proj"]
            basis = bases[id(f.V)]            # the one tensor: aliases share storage on disk
            sd[f"model.layers.{i}.{parent}.{t}_basis.weight"] = basis
            sd[f"model.{t}_basis.{i}.weight"] = basis
            sd[f"model.layers.{i}.{parent}.{t}_proj.weight"] = f.U.detach()
            if f.bias is not None:
                sd[f"model.layers.{i}.{parent}.{t}_proj.bias"] = f.bias.detach()
        glist = sorted(groups.values())
        extra[f"num_basis_{t}"] = int(bases[next(iter(groups))].shape[0])
        extra[f"{t}_groups"] = glist
    torch.save(sd, path / "pytorch_model.bin")
    return finish_dir(path, plain_config(model, architectures=["ShareLlamaForCausalLM"], use_cache=False, **extra),
                      tokenizer)


def _groups(cfg: dict, t: str, n_layers: int, src) -> list[list[int]]:
    groups = cfg.get(f"{t}_groups") or [[i] for i in range(n_layers)]
    ok = isinstance(groups, list) and all(isinstance(g, list) and g and all(
        isinstance(i, int) and not isinstance(i, bool) for i in g) for g in groups)
    if not ok or sorted(i for g in groups for i in g) != list(range(n_layers)):
        fail(src, f"{t}_groups {brief(groups)} do not cover layers 0..{n_layers - 1} once", key=f"{t}_groups")
    return groups


@guarded
def read(path: str | Path, dtype=None, allow_nonfinite: bool = False,
         progress: bool = False):
    path = Path(path)
    cfg, _ = family_config(path, "num_basis_q", "Basis Sharing")
    cfg_obj = llama_config(dict(cfg, model_type="llama"), str(path / "config.json"))
    src = str(path / "pytorch_model.bin")
    sd = read_torch_bin_dir(path)
    n_layers = cfg_obj.num_hidden_layers
    factors, shared = {}, []
    for t in TYPES:
        parent = PARENT[f"{t}_proj"]
        groups = _groups(cfg, t, n_layers, path / "config.json")
        for g in groups:
            aliases = []
            for i in g:
                for k in (f"model.layers.{i}.{parent}.{t}_basis.weight", f"model.{t}_basis.{i}.weight"):
                    if k in sd:
                        aliases.append((k, sd.pop(k)))
                    elif k.startswith("model.layers."):
                        fail(src, f"basis tensor '{k}' is missing (group {g})", key=k)
            basis = check_aliases(aliases, src)
            if basis.dim() != 2:
                fail(src, f"basis '{aliases[0][0]}' has shape {tuple(basis.shape)}, expected [num_basis, in]",
                     key=aliases[0][0])
            nb = cfg.get(f"num_basis_{t}")
            if len(g) == len(groups[0]) and nb is not None and basis.shape[0] != nb:
                fail(src, f"'{aliases[0][0]}' has shape {tuple(basis.shape)}, config says num_basis_{t} = {brief(nb)}",
                     key=aliases[0][0])
            for i in g:
                ck = f"model.layers.{i}.{parent}.{t}_proj.weight"
                if ck not in sd:
                    fail(src, f"coefficient '{ck}' is missing", key=ck)
                coef = sd.pop(ck)
                if coef.dim() != 2 or coef.shape[1] != basis.shape[0]:
                    fail(src, f"coefficient '{ck}' has shape {tuple(coef.shape)}, expected [out, {basis.shape[0]}] "
                              f"to match its basis", key=ck)
                bk = f"{ck[:-7]}.bias"
                factors[f"model.layers.{i}.{parent}.{t}_proj"] = (coef, basis, sd.pop(bk, None),
                                                                  {"U": ck, "V": aliases[0][0], "bias": bk})
            if len(g) > 1:
                shared.append([f"model.layers.{i}.{parent}.{t}_proj.V" for i in g])
    m = re.search(r"_(\d+(?:\.\d+)?)$", path.name)      # share_<model>_<compression_ratio %>
    meta = {"family": "basis_sharing", "keep": round(1 - float(m.group(1)) / 100, 6) if m else None,
            "shared_groups": shared,
            "groups": {t: cfg.get(f"{t}_groups") for t in TYPES},
            "num_basis": {t: cfg.get(f"num_basis_{t}") for t in TYPES}}
    return build_model(cfg_obj, sd, factors, meta, path, dtype, allow_nonfinite, progress=progress)
