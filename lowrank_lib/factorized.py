"""The ONE factorized representation: ``LowRankLinear`` inside an ordinary HF causal LM.

    y = U @ (V @ x) + b        U [out, r], V [r, in], b [out] or None

A factorized model is the same ``LlamaForCausalLM`` object with some ``nn.Linear`` projections
swapped for ``LowRankLinear``; ``model(input_ids).logits``, ``generate`` and every transformers
cache keep working. Shared bases (Basis Sharing) are one ``nn.Parameter`` object referenced by
several ``LowRankLinear`` modules; every count here deduplicates by storage, so a shared basis is
counted once.

Factors may also be quantized (issue 30): ``U`` and / or ``V`` a :class:`~lowrank_lib.quant.QuantizedTensor`
(int8 or int4 codes with fp16 group scales, :func:`quantize_factors`); the forward is then the portable product of
:func:`lowrank_lib.quant.qmatmul` on each stage, and a shared basis stays ONE quantized object.

Every family reader (formats/), compressor (compress/) and the runtime (runtime/) meet here and
nowhere else. Metadata about where the factors came from lives in ``model.lowrank_meta``
(a plain dict: family, canonical keep ratio, per-matrix ranks, shared groups).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from .quant import DEFAULT_GROUP, QuantizedTensor, gptq, qmatmul, quantize

__all__ = ["LLAMA_PROJ", "LLAMA_PARENT", "LowRankLinear", "thin_svd", "svd_factors", "split_sqrt", "iter_linears",
           "set_module", "untie_lm_head", "replace_with_factors", "factorize", "Accounting", "account",
           "lowrank_modules", "shared_groups", "quantize_factors", "factor_matrix", "MIXED_4_8"]

#: Projection names of a Llama-family decoder layer, in forward order.
LLAMA_PROJ = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
#: The submodule of a decoder layer that holds each projection (``model.layers.<i>.<parent>.<proj>``).
LLAMA_PARENT = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
                "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


class LowRankLinear(nn.Module):
    """``y = U (V x) + b`` with ``U`` [out, r], ``V`` [r, in].

    Parameters
    ----------
    U, V : Tensor, nn.Parameter or QuantizedTensor
        Factors. Passing an existing ``nn.Parameter`` (or ``QuantizedTensor``) shares it (no copy): that is
        how a Basis Sharing group holds ONE basis for several layers. A quantized factor runs
        :func:`~lowrank_lib.quant.qmatmul` (its stage's output in the input's dtype).
    bias : Tensor, optional
        [out].
    """

    def __init__(self, U: torch.Tensor, V: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        if U.dim() != 2 or V.dim() != 2:
            raise ValueError(f"LowRankLinear needs 2-D factors, got U {tuple(U.shape)} V {tuple(V.shape)}")
        if U.shape[1] != V.shape[0]:
            raise ValueError(f"rank mismatch: U is {tuple(U.shape)} [out, r] but V is {tuple(V.shape)} [r, in]")
        if bias is not None and bias.shape != (U.shape[0],):
            raise ValueError(f"bias has shape {tuple(bias.shape)}, expected ({U.shape[0]},)")
        keep = (nn.Parameter, QuantizedTensor)
        self.U = U if isinstance(U, keep) else nn.Parameter(U, requires_grad=False)
        self.V = V if isinstance(V, keep) else nn.Parameter(V, requires_grad=False)
        if bias is None:
            self.bias = None
        else:
            self.bias = bias if isinstance(bias, nn.Parameter) else nn.Parameter(bias, requires_grad=False)

    @property
    def rank(self) -> int:
        return self.U.shape[1]

    @property
    def in_features(self) -> int:
        return self.V.shape[1]

    @property
    def out_features(self) -> int:
        return self.U.shape[0]

    @property
    def quantized(self) -> bool:
        """Whether a factor is a :class:`~lowrank_lib.quant.QuantizedTensor`."""
        return isinstance(self.U, QuantizedTensor) or isinstance(self.V, QuantizedTensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (..., in) -> (..., out)
        if self.quantized:
            # the portable quantized product on each stage; h and y in x's dtype (QUANT_SPEC)
            h = qmatmul(x, self.V) if isinstance(self.V, QuantizedTensor) else F.linear(x, self.V.to(x.dtype))
            if isinstance(self.U, QuantizedTensor):
                return qmatmul(h, self.U, self.bias)
            return F.linear(h, self.U.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))
        if x.dtype != self.V.dtype:
            # a checkpoint loaded in the dtypes it stores (SVD-LLM: fp32 factors, fp16 embeddings and
            # norms): compute in the factors' dtype, hand back the caller's
            return F.linear(F.linear(x.to(self.V.dtype), self.V), self.U, self.bias).to(x.dtype)
        return F.linear(F.linear(x, self.V), self.U, self.bias)

    def dense_weight(self) -> torch.Tensor:
        """The [out, in] matrix this layer applies (for audits; never used in forward); quantized factors are
        dequantized (fp32)."""
        if self.quantized:
            return factor_matrix(self.U) @ factor_matrix(self.V)
        return self.U @ self.V

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, bias={self.bias is not None}"

    def factor_modules(self) -> list[nn.Module]:
        """The quantized factors among (U, V) (shared ones are the same object)."""
        return [f for f in (self.U, self.V) if isinstance(f, QuantizedTensor)]

    @classmethod
    def from_linear(cls, lin: nn.Linear, rank: int | None = None) -> "LowRankLinear":
        """Truncated SVD of a dense Linear, sqrt(S) on each side. ``rank=None`` is full rank (exact)."""
        U, V = svd_factors(lin.weight, rank)
        b = None if lin.bias is None else lin.bias.detach().clone()
        return cls(U, V, b)


def factor_matrix(f: torch.Tensor | QuantizedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A factor as a plain matrix: itself (a Parameter / tensor), or dequantized (fp32 unless ``dtype``)."""
    if isinstance(f, QuantizedTensor):
        return f.dequantize(dtype or torch.float32)
    return f if dtype is None else f.to(dtype)


def quantize_factors(model: nn.Module, bits: int | dict[str, int] = 8, group: int = DEFAULT_GROUP, stats=None,
                     damp: float = 0.01) -> nn.Module:
    """Quantize every ``LowRankLinear`` factor of ``model`` in place (QUANT_SPEC: symmetric, fp16 scales per
    ``group`` columns of the reduction dim; the default group 32 is the measured choice, see
    :data:`lowrank_lib.quant.DEFAULT_GROUP`). A factor shared by several layers (Basis Sharing) becomes ONE
    :class:`~lowrank_lib.quant.QuantizedTensor` referenced by all of them. ``model.lowrank_meta["quant"]`` records
    ``{"bits", "group"}`` (and ``"method": "gptq"``). Raises ValueError if a factor is already quantized or not
    quantizable (NaN / Inf, an fp16 scale overflow) and leaves the model unchanged then.

    ``stats``: calibration statistics of THIS model's projections (``compress.calib.collect_stats(model, ids)``,
    or any mapping ``name -> object with .xtx``, the [in, in] sum of x x^T over tokens). With them each factor's
    codes come from GPTQ (:func:`lowrank_lib.quant.gptq`, ``damp``) instead of rounding to nearest: V (applied
    first) for the input moment H = X^T X, then U for the moment of its own input, deq(V) H deq(V)^T, so U's codes
    compensate V's rounding as well; a shared factor uses the sum of its layers' moments. Same storage, kernels and
    file format: only which codes are stored changes.

    ``bits`` may map projection types to widths, ``"*"`` for the others: :data:`MIXED_4_8` keeps the types int4
    hurts most at 8 bits. The engine packs q / k / v and gate / up as one group each, so give each group one width
    (it refuses a mixed group by name)."""
    mods = lowrank_modules(model)
    width = _widths(bits, mods)
    if stats is not None:
        missing = [n for n in mods if n not in stats]
        if missing:
            raise ValueError(f"stats has no entry for {missing[:3]} (collect them on this factorized model)")
    done: dict[int, QuantizedTensor] = {}

    def moments(side: str) -> dict[int, torch.Tensor]:
        """id(factor) -> the summed second moment of its input, over the layers using it."""
        acc: dict[int, torch.Tensor] = {}
        for name, m in mods.items():
            H = stats[name].xtx.to(torch.float64)
            if side == "U":
                Vd = done[id(m.V)].dequantize(torch.float64)
                H = Vd @ H @ Vd.T
            f = getattr(m, side)
            acc[id(f)] = acc[id(f)] + H if id(f) in acc else H
        return acc

    for side in ("V", "U"):             # V first: U's moment needs V's codes
        H = moments(side) if stats is not None else {}
        for name, m in mods.items():
            f = getattr(m, side)
            if isinstance(f, QuantizedTensor):
                raise ValueError(f"{name}.{side} is already quantized ({f.bits} bits, group {f.group})")
            if id(f) not in done:
                b = width[name]
                if any(width[n] != b for n, o in mods.items() if getattr(o, side) is f):
                    raise ValueError(f"{name}.{side} is shared by projections given different bits")
                try:
                    done[id(f)] = (gptq(f.detach(), H[id(f)], b, group, damp) if stats is not None
                                   else quantize(f.detach(), b, group))
                except ValueError as e:
                    raise ValueError(f"{name}.{side}: {e}") from None
    for m in mods.values():
        for side in ("U", "V"):
            q = done[id(getattr(m, side))]
            delattr(m, side)                # a Parameter slot cannot take a module: free the name first
            setattr(m, side, q)
    info = getattr(model, "lowrank_meta", None) or {}
    info["quant"] = {"bits": dict(bits) if isinstance(bits, dict) else int(bits), "group": int(group),
                     **({"method": "gptq"} if stats is not None else {})}
    model.lowrank_meta = info
    return model


#: int4 factors except q / k / v and down at int8 (the projection groups the engine packs stay one width each): k, v
#: and down are the types int4 hurts most on SmolLM2's SVD-LLM factors (README, "Quantized factors")
MIXED_4_8 = {"q_proj": 8, "k_proj": 8, "v_proj": 8, "down_proj": 8, "*": 4}


def _widths(bits, mods: dict) -> dict[str, int]:
    """Each module name -> its bits, from an int or a ``{projection type or "*": bits}`` mapping."""
    if not isinstance(bits, dict):
        return dict.fromkeys(mods, bits)
    unknown = sorted(set(bits) - set(LLAMA_PROJ) - {"*"})
    if unknown:
        raise ValueError(f"bits keys {unknown}: use projection types {LLAMA_PROJ} or '*' (the others)")
    out = {}
    for name in mods:
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in bits and "*" not in bits:
            raise ValueError(f"bits has no width for {name} (no {leaf!r} and no '*')")
        out[name] = bits.get(leaf, bits.get("*"))
    return out


#: singular values at or below this fraction of the largest are zero in :func:`thin_svd` (their components too)
SVD_DEAD = 1e-12


def thin_svd(M: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The thin SVD of M [m, n]: (U [m, k], S [k], Vh [k, n]), k = min(m, n), components by decreasing singular
    value, U diag(S) Vh = M; what ``torch.linalg.svd(M, full_matrices=False)`` returns, in ``dtype`` (default: M's
    floating dtype), computed in float64 from the symmetric eigenproblem of the smaller Gram matrix: M^T M = V S^2 V^T
    and U = M V S^-1 (or M M^T = U S^2 U^T and Vh = S^-1 U^T M for a wide M). On the CPU LAPACK solves that faster
    than the SVD of a rectangular M (2 threads: 2048 x 8192 in 2.6 s against 8.4 s for float32's SVD and 14.9 s for
    float64's; 576 x 3072 in 69 against 295 ms for float64's; a square 2048 x 2048 as fast as float32's SVD), and every
    compressor's decomposition goes through it.

    Precision: the Gram matrix squares the singular values, so each is exact to about sqrt(k eps64) S[0] (1e-8 to
    1e-6 of the largest, absolute: float32's SVD of M resolves 6e-8 S[0]); a component's vectors are orthonormal to
    ~1e-8 while S_i > 1e-3 S[0], and a rank-r map U_r S_r Vh_r is off by about eps64 S[0]^2 / (S_r^2 - S_r+1^2)
    (tests/test_factorized.py checks all three against LAPACK). Below that the components are the Gram's rounding,
    not unit vectors on the side the product computes, but U S Vh = M holds whatever they are (M V V^T = M). Components
    with S <= SVD_DEAD * S[0] are zero (S, and those columns of U or rows of Vh), so no entry blows up (what is
    dropped has norm at most SVD_DEAD * S[0] each). Signs of a component (u_i, v_i) may differ from torch's SVD."""
    if M.dim() != 2:
        raise ValueError(f"thin_svd: a matrix [m, n], got shape {tuple(M.shape)}")
    out_dt = dtype or (M.dtype if M.is_floating_point() else torch.float64)
    Md = M.detach().to(torch.float64)
    wide = Md.shape[0] < Md.shape[1]
    lam, E = torch.linalg.eigh(Md @ Md.T if wide else Md.T @ Md)
    s = lam.flip(0).clamp_min(0).sqrt()
    E = E.flip(1)
    alive = s > s[0] * SVD_DEAD if s.numel() else s > 0
    s = torch.where(alive, s, torch.zeros_like(s))
    inv = torch.where(alive, 1.0 / torch.where(alive, s, torch.ones_like(s)), torch.zeros_like(s))
    if wide:
        U, Vh = E, (E.T @ Md) * inv[:, None]
    else:
        U, Vh = (Md @ E) * inv, E.T
    return U.to(out_dt), s.to(out_dt), Vh.to(out_dt).contiguous()


def svd_factors(W: torch.Tensor, rank: int | None = None, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Best rank-r factors of W [out, in] (Eckart-Young): U_r sqrt(S_r) [out, r], sqrt(S_r) Vh_r [r, in], from
    :func:`thin_svd`, split in float64 and rounded once to ``dtype`` (default: W's dtype)."""
    out_f, in_f = W.shape
    full = min(out_f, in_f)
    r = full if rank is None else int(rank)
    if not 1 <= r <= full:
        raise ValueError(f"rank {r} outside [1, {full}] for a {out_f}x{in_f} matrix")
    U, S, Vh = thin_svd(W, torch.float64)
    return split_sqrt(U, S, Vh, r, dtype or W.dtype)


def split_sqrt(U: torch.Tensor, S: torch.Tensor, Vh: torch.Tensor, r: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncate an SVD to rank r and put sqrt(S) on each side: (U_r sqrt(S_r), sqrt(S_r) Vh_r)."""
    s = S[:r].sqrt()
    return (U[:, :r] * s).to(dtype).contiguous(), (s[:, None] * Vh[:r]).to(dtype).contiguous()


# --------------------------------------------------------------------------- model surgery
def iter_linears(model: nn.Module, targets: Iterable[str] = LLAMA_PROJ, include_lm_head: bool = False):
    """Yield ``(full_name, module)`` of the decoder projections whose last name is in ``targets``."""
    targets = set(targets)
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in targets and isinstance(mod, (nn.Linear, LowRankLinear)):
            yield name, mod
        elif include_lm_head and name == "lm_head" and isinstance(mod, (nn.Linear, LowRankLinear)):
            yield name, mod


def set_module(model: nn.Module, name: str, new: nn.Module) -> None:
    """Replace the submodule at dotted ``name``."""
    parent_name, _, leaf = name.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, leaf, new)


def untie_lm_head(model: nn.Module) -> None:
    """Give lm_head its own weight Parameter so factorizing it leaves the embedding intact."""
    head = model.get_output_embeddings()
    emb = model.get_input_embeddings()
    if isinstance(head, nn.Linear) and head.weight is emb.weight:
        head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=False)
        model.config.tie_word_embeddings = False
        if hasattr(model, "_tied_weights_keys"):
            model._tied_weights_keys = {} if isinstance(model._tied_weights_keys, dict) else []


def replace_with_factors(model: nn.Module, factors: dict[str, "LowRankLinear"], meta: dict | None = None) -> nn.Module:
    """Swap each named projection for the given ``LowRankLinear`` (shapes checked). In place."""
    for name, lr in factors.items():
        old = model.get_submodule(name)
        if isinstance(old, (nn.Linear, LowRankLinear)):
            exp = (old.out_features, old.in_features)
            got = (lr.out_features, lr.in_features)
            if exp != got:
                raise ValueError(f"{name}: factors give a {got[0]}x{got[1]} map, the model expects {exp[0]}x{exp[1]}")
        if name == "lm_head":
            untie_lm_head(model)
        ref = next(iter(old.parameters()), None)
        if ref is not None and lr.U.device != ref.device:
            lr = lr.to(ref.device)
        set_module(model, name, lr)
    info = getattr(model, "lowrank_meta", None) or {}
    info.update(meta or {})
    info["ranks"] = {n: m.rank for n, m in model.named_modules() if isinstance(m, LowRankLinear)}
    model.lowrank_meta = info
    return model


def factorize(model: nn.Module, ranks: dict[str, int] | None = None, keep: float | None = None,
              targets: Iterable[str] = LLAMA_PROJ, include_lm_head: bool = False,
              full_rank: bool = False) -> nn.Module:
    """Plain truncated-SVD factorization of a dense model, in place.

    Exactly one of ``ranks`` (per full module name), ``keep`` (canonical keep ratio, see
    :func:`lowrank_lib.ranks.keep_rank`) or ``full_rank=True`` (rank min(out, in): exact).
    """
    from .ranks import keep_rank

    if sum(x is not None and x is not False for x in (ranks, keep, full_rank)) != 1:
        raise ValueError("give exactly one of ranks=, keep=, full_rank=True")
    new = {}
    for name, lin in list(iter_linears(model, targets, include_lm_head)):
        if isinstance(lin, LowRankLinear):
            raise ValueError(f"{name} is already factorized")
        if full_rank:
            r = None
        elif ranks is not None:
            if name not in ranks:
                continue
            r = ranks[name]
        else:
            r = keep_rank(lin.out_features, lin.in_features, keep)
        new[name] = LowRankLinear.from_linear(lin, r)
    meta = {"family": "svd", "keep": keep if keep is not None else (1.0 if full_rank else None), "shared_groups": []}
    return replace_with_factors(model, new, meta)


# --------------------------------------------------------------------------- accounting
def _unique_params(model: nn.Module) -> list[torch.Tensor]:
    seen, out = set(), []
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape)) if t.numel() else id(t)
        if key in seen:
            continue
        seen.add(key)
        out.append(t)
    return out


@dataclass
class Accounting:
    """Parameter and byte counts of a model, shared tensors counted once.

    ``linear_*`` covers the decoder projections (dense Linear or LowRankLinear, lm_head when
    factorized); ``dense_linear_params`` is what those projections would hold as dense matrices.
    """

    total_params: int
    total_bytes: int
    linear_params: int
    linear_bytes: int
    dense_linear_params: int
    shared_params_saved: int = 0
    per_module: dict[str, dict] = field(default_factory=dict)

    @property
    def linear_keep(self) -> float:
        """Fraction of projection parameters kept (the canonical keep ratio, realised)."""
        return self.linear_params / max(self.dense_linear_params, 1)


def account(model: nn.Module, targets: Iterable[str] = LLAMA_PROJ) -> Accounting:
    """Count parameters and bytes; a Parameter referenced by several modules counts once. A quantized factor
    counts its matrix's elements as parameters and its real bytes (codes + fp16 scales)."""
    params = [p for p in _unique_params(model) if isinstance(p, nn.Parameter)]
    quant = {id(q): q for q in model.modules() if isinstance(q, QuantizedTensor)}.values()
    total_p = sum(p.numel() for p in params) + sum(q.shape.numel() for q in quant)
    total_b = sum(p.numel() * p.element_size() for p in params) + sum(q.nbytes for q in quant)
    seen: set[int] = set()
    lin_p = lin_b = dense_p = naive_p = 0
    per = {}
    for name, m in iter_linears(model, targets, include_lm_head=True):
        if name == "lm_head" and not isinstance(m, LowRankLinear):
            continue
        dense_p += m.out_features * m.in_features
        ps = [m.U, m.V] if isinstance(m, LowRankLinear) else [m.weight]
        if m.bias is not None:
            ps.append(m.bias)
        own = 0
        for p in ps:
            n = p.shape.numel()             # a quantized factor: its matrix's elements, bytes = codes + scales
            naive_p += n
            if id(p) in seen:
                continue
            seen.add(id(p))
            own += n
            lin_p += n
            lin_b += p.nbytes if isinstance(p, QuantizedTensor) else n * p.element_size()
        per[name] = {"shape": [m.out_features, m.in_features],
                     "rank": m.rank if isinstance(m, LowRankLinear) else None, "params": own}
    return Accounting(total_p, total_b, lin_p, lin_b, dense_p, naive_p - lin_p, per)


def lowrank_modules(model: nn.Module) -> dict[str, LowRankLinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LowRankLinear)}


def shared_groups(model: nn.Module) -> list[list[str]]:
    """Groups of factor names that are the same Parameter object (e.g. a shared basis)."""
    by_id: dict[int, list[str]] = {}
    for n, m in lowrank_modules(model).items():
        for side in ("U", "V"):
            by_id.setdefault(id(getattr(m, side)), []).append(f"{n}.{side}")
    return [g for g in by_id.values() if len(g) > 1]
