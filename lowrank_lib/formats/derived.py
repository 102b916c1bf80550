"""Buffers a checkpoint may carry that the rebuilt model recomputes from its config.

Whole-model pickles keep every buffer of every module, including the non-persistent ones, and
old state dicts kept persistent rotary tables. Across the transformers versions the families pin
(4.35-4.45) and the families' own modules these are:

==================================================  ===================================  ================
key (relative to the model)                         written by                           check
==================================================  ===================================  ================
``layers.<i>.self_attn.rotary_emb.inv_freq``        all 4.x attention modules, SVD-LLM   = config RoPE
``rotary_emb.inv_freq`` / ``original_inv_freq``     4.4x / 5.x model-level rotary        = config RoPE
``...rotary_emb.cos_cached`` / ``sin_cached``       4.3x, SVD-LLM ``[1, 1, L, d]``        = cos/sin table
``...rotary_emb._cos_cached`` / ``_sin_cached``     4.38-4.39                             = cos/sin table
``causal_mask``                                     4.38 ``LlamaModel`` (bool ``[L, L]``)  = triu(1)
``position_ids``                                    position buffers (``[1, L]``)         = arange(L)
==================================================  ===================================  ================

:func:`split_derived` takes them out of a checkpoint's tensors after checking each against the
config it will be rebuilt from: RoPE frequencies against the frequencies transformers computes for
that config (``rope_theta``, ``head_dim``, scaling; a 4.x linear-scaling module stores unscaled
frequencies, also accepted), cos/sin tables against cos/sin of those frequencies, masks and
position ids against their closed forms. A mismatch means the checkpoint and its config disagree
and is refused naming the tensor. Anything not recognised here stays, and the builder refuses it
by name as an unexpected tensor.
"""
from __future__ import annotations

import re

import torch

from .errors import fail
from .lazy import LazyTensor


def _value(t):
    """The values of a (lazy) buffer, read only after its shape and dtype passed."""
    return t.load() if isinstance(t, LazyTensor) else t

_ROPE = re.compile(r"^(?P<at>model\.(?:layers\.(?P<layer>\d+)\.self_attn\.)?rotary_emb)\."
                   r"(?P<kind>inv_freq|original_inv_freq|_?cos_cached|_?sin_cached)$")
_MASK = re.compile(r"^model\.causal_mask$")
_POS = re.compile(r"^(?:.+\.)?position_ids$")


def is_derived_name(key: str) -> bool:
    return bool(_ROPE.match(key) or _MASK.match(key) or _POS.match(key))


def _tol(dtype: torch.dtype) -> float:
    return 4 * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _expected_rope(cfg, source):
    from .build import rope_frequencies

    inv, scale, rtype = rope_frequencies(cfg, source)      # CPU, tiny: [head_dim / 2]
    rp = getattr(cfg, "rope_parameters", None) or {}
    factor = float(rp.get("factor", 1.0)) if rtype == "linear" else None
    return inv.double(), scale, rtype, factor


def split_derived(tensors: dict[str, torch.Tensor], cfg, source, candidates=None) -> tuple[dict, list[str]]:
    """``(tensors without the derived buffers, sorted names dropped)``; each dropped buffer was checked.

    ``candidates``: keys allowed to be derived (the BUFFERS of a pickled module tree; a parameter
    named like a buffer stays and is refused as unexpected). None: any key.
    """
    from ..geometry import geometry

    keep, dropped = {}, []
    g = geometry(cfg)
    rope = None
    tables: dict[tuple, torch.Tensor] = {}
    for key, t in tensors.items():
        m = _ROPE.match(key)
        if not (m or _MASK.match(key) or _POS.match(key)) or (candidates is not None and key not in candidates):
            keep[key] = t
            continue
        if not isinstance(t, (torch.Tensor, LazyTensor)):
            fail(source, f"'{key}' is not a tensor", key=key)
        if m:
            layer = m.group("layer")
            if layer is not None and int(layer) >= g.n_layers:
                keep[key] = t      # a buffer of a layer the config does not have: unexpected, by name
                continue
            if rope is None:
                rope = _expected_rope(cfg, source)
            inv, scale, rtype, factor = rope
            kind = m.group("kind")
            if kind in ("inv_freq", "original_inv_freq"):
                _check_inv_freq(key, t, inv, rtype, factor, g.head_dim, source)
            else:
                _check_table(key, t, inv, scale, rtype, g.head_dim, "cos" if "cos" in kind else "sin", source, tables)
        elif _MASK.match(key):
            _check_mask(key, t, source)
        else:
            _check_positions(key, t, source)
        if isinstance(t, LazyTensor):
            t.release()            # checked and dropped: its pages go back
        dropped.append(key)
    return keep, sorted(dropped)


def _close(a: torch.Tensor, b: torch.Tensor, atol: float, rtol: float) -> tuple[bool, float]:
    d = (a.double() - b.double()).abs()
    ok = bool((d <= atol + rtol * b.double().abs()).all())
    return ok, float(d.max()) if d.numel() else 0.0


def _check_inv_freq(key, t, inv, rtype, factor, head_dim, source):
    if tuple(t.shape) != (head_dim // 2,) or not t.dtype.is_floating_point:
        fail(source, f"derived buffer '{key}' has shape {tuple(t.shape)} {t.dtype}, expected ({head_dim // 2},) "
                     f"floating RoPE frequencies for head_dim {head_dim}", key=key)
    if rtype == "dynamic":   # 4.x dynamic NTK rewrote inv_freq at run time: the shape is all we can check
        return
    t = _value(t)
    rtol = max(1e-3, _tol(t.dtype))     # fp16-rounded frequencies pass; another theta / head_dim does not
    fi = torch.finfo(t.dtype)
    atol = 2 * fi.tiny * fi.eps         # fp16 subnormals (theta 500000 gives frequencies down to 3e-6)
    ok, diff = _close(t, inv, atol, rtol)
    if not ok and factor:
        ok, _ = _close(t, inv * factor, atol, rtol)    # 4.x LinearScaling stored the unscaled frequencies
    if not ok:
        fail(source, f"derived buffer '{key}' does not match the config's RoPE (rope_type {rtype}, head_dim "
                     f"{head_dim}): max abs diff {diff:.3g} from the expected frequencies {_head(inv)}, found "
                     f"{_head(t)}; the checkpoint and its config disagree", key=key)


def _check_table(key, t, inv, scale, rtype, head_dim, fn, source, cache):
    shape = tuple(t.shape)
    if len(shape) == 4 and shape[:2] == (1, 1):
        shape = shape[2:]
    if len(shape) != 2 or shape[1] != head_dim or not t.dtype.is_floating_point:
        fail(source, f"derived buffer '{key}' has shape {tuple(t.shape)} {t.dtype}, expected [L, {head_dim}] or "
                     f"[1, 1, L, {head_dim}] floating {fn} table", key=key)
    if rtype == "dynamic":
        return
    t = _value(t)
    L = shape[0]
    ck = (L, fn)
    if ck not in cache:
        pos = torch.arange(L, dtype=torch.float32)
        freqs = torch.outer(pos, inv.float())
        emb = torch.cat((freqs, freqs), dim=-1)
        cache[ck] = (emb.cos() if fn == "cos" else emb.sin()) * scale
    exp = cache[ck]
    atol = _tol(t.dtype) + 4 * L * torch.finfo(torch.float32).eps
    ok, diff = _close(t.reshape(shape), exp, atol, _tol(t.dtype))
    if not ok:
        fail(source, f"derived buffer '{key}' is not the {fn} table of the config's RoPE (rope_type {rtype}, "
                     f"head_dim {head_dim}, {L} positions): max abs diff {diff:.3g} > {atol:.2g}; the checkpoint "
                     f"and its config disagree", key=key)


def _check_mask(key, t, source):
    if t.dtype != torch.bool or t.dim() != 2 or t.shape[0] != t.shape[1]:
        fail(source, f"derived buffer '{key}' has shape {tuple(t.shape)} {t.dtype}, expected a square bool "
                     f"causal mask", key=key)
    L = t.shape[0]
    t = _value(t)
    if not torch.equal(t, torch.ones(L, L, dtype=torch.bool).triu(1)):
        fail(source, f"derived buffer '{key}' is not the causal mask (True strictly above the diagonal)", key=key)


def _check_positions(key, t, source):
    shape = tuple(t.shape)
    if t.dtype.is_floating_point or t.dtype == torch.bool or not (len(shape) == 1 or (len(shape) == 2 and
                                                                                      shape[0] == 1)):
        fail(source, f"derived buffer '{key}' has shape {shape} {t.dtype}, expected integer [L] or [1, L] "
                     f"position ids", key=key)
    t = _value(t)
    if not torch.equal(t.reshape(-1), torch.arange(t.numel(), dtype=t.dtype)):
        fail(source, f"derived buffer '{key}' is not arange({t.numel()})", key=key)


def _head(t: torch.Tensor) -> str:
    return "[" + ", ".join(f"{float(x):.4g}" for x in t.reshape(-1)[:3]) + ", ...]"


__all__ = ["is_derived_name", "split_derived"]
