"""ASVD native checkpoints: the ``<name>-asvd<pct>/`` HF export (spec §3).

``model.safetensors`` (save_pretrained layout; a tied lm_head is not stored) with
``<module>.ALinear.weight`` = U sqrt(S) [out, r] (applied LAST, bias on ALinear) and
``<module>.BLinear.weight`` = sqrt(S) V^T / s [r, in]; untruncated modules keep ``<module>.weight``.
``config.json`` is the full config plus ``architectures: ["ASVDLlamaForCausalLM"]``, ``auto_map`` and
``truncation_ranks: {module: r}``; ``modeling_asvd_llama.py`` / ``configuration_asvd_llama.py``
sit beside it (here: short files of ours documenting the layout; lowrank_lib never executes them).
"ratio" (asvd90) is the KEEP fraction p. Sigma is split sqrt/sqrt.
"""
from __future__ import annotations

from pathlib import Path

from safetensors.torch import save_file

from .build import build_model, llama_config
from .common import (dense_state, factor_modules, family_config, finish_dir, keep_from_name, plain_config,
                     read_safetensors_dir)
from .errors import brief, fail, guarded

_MODELING = '''"""ASVD-layout Llama (written by lowrank_lib for layout fidelity).

Each truncated projection is ``ASVDLinear``: ``BLinear`` [r, in] then ``ALinear`` [out, r];
``config.truncation_ranks`` names them. lowrank_lib reads this folder without running this file:
``lowrank_lib.load_checkpoint(folder)``.
"""
'''
_CONFIGURATION = '''"""ASVD-layout Llama config (written by lowrank_lib): a LlamaConfig plus ``truncation_ranks``."""
'''


def native_dirname(model_name: str, keep: float) -> str:
    return f"{model_name.rstrip('/').split('/')[-1]}-asvd{int(keep * 100)}"


def write(model, path: str | Path, tokenizer=None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    facs = factor_modules(model)
    sd = dense_state(model, set(facs))
    if model.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    for name, f in facs.items():
        sd[f"{name}.ALinear.weight"] = f.U.detach()
        sd[f"{name}.BLinear.weight"] = f.V.detach()
        if f.bias is not None:
            sd[f"{name}.ALinear.bias"] = f.bias.detach()
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = plain_config(model, architectures=["ASVDLlamaForCausalLM"],
                       auto_map={"AutoConfig": "configuration_asvd_llama.ASVDLlamaConfig",
                                 "AutoModelForCausalLM": "modeling_asvd_llama.ASVDLlamaForCausalLM"},
                       truncation_ranks={n: f.rank for n, f in facs.items()})
    (path / "modeling_asvd_llama.py").write_text(_MODELING)
    (path / "configuration_asvd_llama.py").write_text(_CONFIGURATION)
    return finish_dir(path, cfg, tokenizer)


@guarded
def read(path: str | Path, dtype=None, allow_nonfinite: bool = False,
         progress: bool = False):
    path = Path(path)
    cfg, ranks = family_config(path, "truncation_ranks", "ASVD")
    cfg_obj = llama_config(cfg, str(path / "config.json"))
    if not isinstance(ranks, dict):
        fail(path / "config.json", f"truncation_ranks is {brief(ranks)}, expected {{module: rank}}",
             key="truncation_ranks")
    sd = read_safetensors_dir(path)
    factors = {}
    for name, r in ranks.items():
        ak, bk = f"{name}.ALinear.weight", f"{name}.BLinear.weight"
        if not isinstance(r, int) or isinstance(r, bool):
            fail(path / "config.json", f"truncation_ranks['{name}'] = {brief(r)}, expected an int", key=name)
        for k in (ak, bk):
            if k not in sd:
                fail(path, f"truncation_ranks lists '{name}' but tensor '{k}' is missing", key=k)
        A, B = sd.pop(ak), sd.pop(bk)
        if A.dim() != 2 or B.dim() != 2 or A.shape[1] != r or B.shape[0] != r:
            fail(path, f"'{name}' has ALinear {tuple(A.shape)} / BLinear {tuple(B.shape)}; truncation_ranks says "
                       f"rank {r}", key=ak)
        factors[name] = (A, B, sd.pop(f"{name}.ALinear.bias", None),
                         {"U": ak, "V": bk, "bias": f"{name}.ALinear.bias"})
    stray = [k for k in sd if ".ALinear." in k or ".BLinear." in k]
    if stray:
        fail(path, f"factor tensors {stray[:3]} are not listed in truncation_ranks", key=stray[0])
    meta = {"family": "asvd", "keep": (keep_from_name(path.name) or 0) / 100 or None, "shared_groups": []}
    return build_model(cfg_obj, sd, factors, meta, path, dtype, allow_nonfinite, progress=progress)
