"""Describe a checkpoint's layout without building a model (for notebooks and debugging).

:func:`describe` lists the files, and the tensors of one decoder layer (key, shape, dtype) as
stored, reading pickles through the restricted unpickler. :data:`FAMILY_NOTES` says, per family,
which tensor is U / V in our convention, where Sigma lives and what the family's "ratio" means.
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

FAMILY_NOTES = {
    "svdllm": {"U": "<p>_u_proj.weight [out,r] fp32", "V": "<p>_v_proj.weight [r,in] fp32",
               "sigma": "sqrt on each side (after whitening)", "ratio": "file name = keep (CLI --ratio = removed)",
               "container": "pickled {'model','tokenizer'} (component.svd_llama.*)"},
    "asvd": {"U": "<m>.ALinear.weight [out,r]", "V": "<m>.BLinear.weight [r,in]",
             "sigma": "sqrt on each side (V divided by activation scale)", "ratio": "asvd<pct>: keep p",
             "container": "HF folder, model.safetensors + truncation_ranks"},
    "basis_sharing": {"U": "<t>_proj.weight (coefficient) [out,nb]", "V": "<t>_basis.weight [nb,in], shared by a group",
                      "sigma": "all in the basis (coefficients orthonormal)", "ratio": "compression_ratio = % removed",
                      "container": "HF folder, pytorch_model.bin + num_basis_*/*_groups"},
    "dobi": {"U": "<m>.BLinear.weight [out,r] fp16", "V": "<m>.ALinear.weight [r,in] fp16",
             "sigma": "sqrt on each side", "ratio": "target_ratio = keep of all Linear params",
             "container": "pickled {'model','tokenizer'} (modules.module.SVDTransformLayer), cuda:0 storages"},
    "dobi-remap": {"U": "deq(us_quan)^T (+ 'us' tail) [out,k]", "V": "deq(vt_quan) (+ 'vt' tail) [k,in]",
                   "sigma": "on U if out>=in, else on V", "ratio": "target_ratio = keep, budget k*max(m,n)",
                   "container": "folder: pytorch_model.bin (non-layer) + remapping_weight.pt (uint8 codes)"},
    "palu": {"U": "blockdiag(<m>.U.<g>.weight [gd,r_g])", "V": "<m>.VT.weight [sum r_g,in]",
             "sigma": "sqrt on each side (whitened)", "ratio": "param_ratio_target = kept k/v rank",
             "container": "HF folder, model.safetensors + head_wise_ranks (k/v only)"},
    "lowrank": {"U": "<m>.U [out,r]", "V": "<m>.V [r,in] (shared = one entry)", "sigma": "as the source family",
                "ratio": "canonical keep", "container": "model.safetensors + lowrank_manifest.json (mmap)"},
}


def _tensors(path: Path, family: str) -> dict[str, torch.Tensor]:
    from .common import read_safetensors_dir, read_torch_bin_dir
    from .safe_pickle import module_state, safe_torch_load

    if family in ("svdllm", "dobi"):
        f = path if path.is_file() else (path / "DobiSVD_Model.pt" if family == "dobi" else sorted(path.glob("*.pt"))[0])
        return module_state(safe_torch_load(f)["model"])
    if family == "dobi-remap":
        out = dict(read_torch_bin_dir(path))
        for name, e in safe_torch_load(path / "remapping_weight.pt").items():
            for k, v in e.items():
                if isinstance(v, torch.Tensor):
                    out[f"{name}[{k}]"] = v
                elif isinstance(v, tuple):
                    out[f"{name}[{k}:{v[0]}]"] = v[1]
        return out
    if family == "basis_sharing":
        return read_torch_bin_dir(path)
    return read_safetensors_dir(path)


def describe(path: str | Path, layer: int = 0) -> dict:
    """``{"family", "files": [(name, bytes)], "tensors": [(key, shape, dtype)] of one layer}``."""
    from . import detect_format

    path = Path(path)
    fam = detect_format(path)
    files = [(path.name, path.stat().st_size)] if path.is_file() else \
        sorted((str(p.relative_to(path)), p.stat().st_size) for p in path.rglob("*") if p.is_file())
    pat = re.compile(rf"(^|\.)layers\.{layer}\.|_basis\.{layer}\.")
    rows = [(k, list(v.shape), str(v.dtype).replace("torch.", "")) for k, v in _tensors(path, fam).items()
            if pat.search(k) and "norm" not in k]
    return {"family": fam, "files": files, "tensors": rows, "notes": FAMILY_NOTES[fam]}
