"""Rebuild the ONE representation from a config and plain tensors (shared by every reader).

Readers map their native keys to canonical names and hand over

* ``dense``: ``{state_dict key: tensor}`` for everything that stays dense (embeddings, norms,
  lm_head, dense projections) and any derived buffers the file carries;
* ``factors``: ``{module name: (U [out, r], V [r, in], bias [out] | None[, native names])}``;
  passing the SAME tensor object for several modules makes it ONE shared ``nn.Parameter`` (a
  shared basis). The optional fourth element ``{"U": key, "V": key, "bias": key}`` names the
  tensors as the file does, for error messages.

:func:`build_model` validates everything BEFORE it allocates anything:

1. the config (:func:`llama_config`): types and ranges of every size (a config claiming a
   million layers or a 2^40 vocabulary is refused, not allocated), then the geometry;
2. the model is instantiated on the ``meta`` device (no memory), which gives the expected
   shape of every tensor from transformers itself;
3. derived buffers (RoPE tables, masks, position ids) are checked against the config and dropped
   (:mod:`.derived`); every other tensor must be expected: unexpected, missing, mis-shaped or
   non-floating tensors are refused by name with expected vs found;
4. each factorization has 1 <= rank <= min(out, in) (for a basis shared by G modules: the sum of
   their out features), consistent shapes and bias;

all of that from the readers' :class:`~.lazy.LazyTensor` descriptions, before a byte of tensor data
is read. Then each distinct tensor is STREAMED once, in file order (:func:`~.lazy.stream`): its
CRC verified, cast to ``dtype`` (None keeps the stored dtype: the default) one chunk at a time with
the source pages handed back as it goes, and scanned for NaN/Inf after the cast (fp32 -> fp16 can
overflow to inf; refused by name unless ``allow_nonfinite=True``, which records them in
``lowrank_meta["nonfinite"]``). So the peak memory of a load is the loaded model plus one chunk,
never a second copy. Tensors kept in their stored dtype view the file's mapping (zero copy).

Only then are the tensors put into the model (``load_state_dict(assign=True)``: no copy) and the
RoPE buffers computed on the CPU. So a bad file raises :class:`CheckpointError` naming the file, the
tensor, the expected and the found value, and nothing half-built is ever returned.
``lowrank_meta["dtypes"]`` records the bytes per dtype as stored and as loaded.
"""
from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch
from torch import nn

from ..factorized import LowRankLinear, account, set_module, shared_groups, untie_lm_head
from ..quant import QuantizedTensor, storage_shapes
from .derived import split_derived
from .errors import CheckpointError, brief, fail
from .lazy import LazyTensor, count_nonfinite, one_thread, stream

#: Llama-family architecture fields read from a (pickled, 4.x or 5.x) config.
CONFIG_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
               "num_key_value_heads", "hidden_act", "max_position_embeddings", "rms_norm_eps",
               "tie_word_embeddings", "attention_bias", "mlp_bias", "head_dim", "bos_token_id", "eos_token_id",
               "pad_token_id", "rope_parameters", "initializer_range")
#: Accepted range of each size field: large enough for any released Llama-family model.
SIZE_LIMITS = {"vocab_size": (1, 1 << 22), "hidden_size": (1, 1 << 16), "intermediate_size": (1, 1 << 19),
               "num_hidden_layers": (1, 512), "num_attention_heads": (1, 1024), "num_key_value_heads": (1, 1024),
               "head_dim": (2, 2048), "max_position_embeddings": (1, 1 << 24)}
_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


class QuantizedFactor:
    """A quantized factor as a reader hands it over (issue 30): codes and fp16 scales (:class:`~.lazy.LazyTensor`,
    the spec's canonical storage, never cast) with bits, group and the matrix's [out, in]; ``keys`` names the two
    tensors as the file does. Passing the SAME object for several modules makes one shared quantized basis."""

    def __init__(self, data, scale, bits: int, group: int, shape, keys: tuple[str, str] = ("codes", "scales")):
        self.data, self.scale, self.bits, self.group, self.keys = data, scale, bits, group, keys
        self.shape = torch.Size(int(s) for s in shape)

    def dim(self) -> int:
        return len(self.shape)

    def check(self, source) -> None:
        """The stored codes and scales are what ``bits``, ``group`` and ``shape`` say (CheckpointError if not)."""
        try:
            want = storage_shapes(*self.shape, self.bits, self.group)
        except (ValueError, TypeError) as e:
            fail(source, f"quantized factor '{self.keys[0]}' {tuple(self.shape)}: {e}", key=self.keys[0])
        for key, t, (dt, shp) in zip(self.keys, (self.data, self.scale), want):
            if not isinstance(t, LazyTensor) or t.dtype != dt or _shape(t) != shp:
                found = brief(t) if not isinstance(t, LazyTensor) else f"{t.dtype} {_shape(t)}"
                fail(source, f"quantized factor tensor '{key}' is {found}, expected {dt} {shp} ({self.bits} bits, "
                             f"group {self.group}, matrix {tuple(self.shape)})", key=key)


def check_factor_bits(source, bits, group) -> None:
    """A ``factor_bits`` / ``factor_group`` request (``load_checkpoint``, a reader that serves codes) the spec can
    serve, else a CheckpointError naming ``source``, before anything is read."""
    try:
        storage_shapes(1, 1, bits, group)
    except ValueError as e:
        raise CheckpointError(f"{source}: factor_bits={bits!r}, factor_group={group!r}: {e}", path=source) from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _finite_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _token_ids(v) -> bool:
    return v is None or (_is_int(v) and v >= 0) or (isinstance(v, list) and len(v) <= 64 and
                                                    all(_is_int(x) and x >= 0 for x in v))


def llama_config(d: dict, source="<config>"):
    """A validated ``LlamaConfig`` from plain config values (transformers 4.x or 5.x field names)."""
    from transformers import LlamaConfig
    from transformers.activations import ACT2FN

    from ..geometry import geometry

    if not isinstance(d, dict):
        fail(source, f"config is {brief(d)}, expected a mapping of config fields")
    missing = [k for k in _REQUIRED if d.get(k) is None]
    if missing:
        fail(source, f"config lacks {missing}; cannot rebuild the model")
    kw = {}
    for k in CONFIG_KEYS:
        v = d.get(k)
        if v is None:
            continue
        if k in SIZE_LIMITS:
            lo, hi = SIZE_LIMITS[k]
            if not _is_int(v) or not lo <= v <= hi:
                fail(source, f"config {k} = {brief(v)}: expected an int in [{lo}, {hi}]", key=k)
        elif k in ("rms_norm_eps", "initializer_range"):
            if not _finite_number(v) or v < 0 or (k == "rms_norm_eps" and not 0 < v <= 1):
                fail(source, f"config {k} = {brief(v)}: expected a finite non-negative number", key=k)
        elif k in ("tie_word_embeddings", "attention_bias", "mlp_bias"):
            if not isinstance(v, bool):
                fail(source, f"config {k} = {brief(v)}: expected true or false", key=k)
        elif k == "hidden_act":
            if not isinstance(v, str) or v not in ACT2FN:
                fail(source, f"config hidden_act = {brief(v)}: not an activation transformers knows", key=k)
        elif k.endswith("_token_id"):
            if not _token_ids(v):
                fail(source, f"config {k} = {brief(v)}: expected a token id or a list of them", key=k)
        elif k == "rope_parameters" and not isinstance(v, dict):
            fail(source, f"config rope_parameters = {brief(v)}: expected an object", key=k)
        kw[k] = v
    if "rope_parameters" not in kw:
        theta = d.get("rope_theta", 10000.0)
        if theta is None:
            theta = 10000.0
        if not _finite_number(theta) or theta <= 0:
            fail(source, f"config rope_theta = {brief(theta)}: expected a positive number", key="rope_theta")
        rp = {"rope_type": "default", "rope_theta": float(theta)}
        scaling = d.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            fail(source, f"config rope_scaling = {brief(scaling)}: expected an object or null", key="rope_scaling")
        if isinstance(scaling, dict):
            rp.update({k: v for k, v in scaling.items() if k != "type"})
            rp["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
        kw["rope_parameters"] = rp
    kw.setdefault("num_key_value_heads", kw["num_attention_heads"])
    _check_rope_values(kw["rope_parameters"], source)
    try:
        cfg = LlamaConfig(**kw, attn_implementation="sdpa")
    except Exception as e:  # transformers' own validation (rope parameters, ...)
        fail(source, f"config rejected by transformers ({type(e).__name__}: {str(e)[:300]})")
    cfg.architectures = ["LlamaForCausalLM"]
    try:
        g = geometry(cfg)
    except (ValueError, TypeError) as e:
        fail(source, f"config geometry: {e}")
    if g.head_dim % 2:
        fail(source, f"config head_dim {g.head_dim} is odd; rotary embeddings need an even head_dim", key="head_dim")
    if (cfg.rope_parameters or {}).get("rope_type", "default") not in _rope_types():
        fail(source, f"config rope type {cfg.rope_parameters.get('rope_type')!r} is not one transformers implements")
    rope_frequencies(cfg, source)
    return cfg


def _check_rope_values(rp: dict, source) -> None:
    """RoPE parameters are a type name and numbers (or lists of numbers, for long-context scalings)."""
    for k, v in rp.items():
        if not isinstance(k, str):
            fail(source, f"config RoPE parameter key {brief(k)} is not a string", key="rope_parameters")
        if k in ("rope_type", "type"):
            if not isinstance(v, str):
                fail(source, f"config RoPE {k} = {brief(v)}: expected a name", key="rope_parameters")
            continue
        vals = v if isinstance(v, list) else [v]
        if v is not None and not all(_finite_number(x) for x in vals):
            fail(source, f"config RoPE parameter {k} = {brief(v)}: expected finite numbers", key="rope_parameters")
    theta = rp.get("rope_theta", 10000.0)
    if not _finite_number(theta) or theta <= 0:
        fail(source, f"config rope_theta = {brief(theta)}: expected a positive number", key="rope_theta")
    if rp.get("factor") is not None and rp["factor"] < 1:
        fail(source, f"config RoPE factor = {brief(rp['factor'])}: expected >= 1", key="rope_parameters")


def rope_frequencies(cfg, source) -> tuple[torch.Tensor, float, str]:
    """``(inv_freq, attention_scaling, rope_type)`` transformers computes for ``cfg``; CheckpointError if it
    cannot, or if they are not finite (so a bad config fails here, not inside the model)."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    try:
        rot = LlamaRotaryEmbedding(config=cfg)
        inv, scale = rot.inv_freq, float(getattr(rot, "attention_scaling", 1.0) or 1.0)
    except Exception as e:  # transformers' RoPE initialisers on odd parameters
        fail(source, f"config RoPE parameters {brief(str(cfg.rope_parameters), 200)} cannot be computed "
                     f"({type(e).__name__}: {str(e)[:200]})", key="rope_parameters")
    if not bool(torch.isfinite(inv).all()) or not math.isfinite(scale) or not bool((inv > 0).all()):
        fail(source, f"config RoPE parameters {brief(str(cfg.rope_parameters), 200)} give non-finite or "
                     f"non-positive frequencies", key="rope_parameters")
    return inv, scale, rot.rope_type


def _rope_types() -> set[str]:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    return {"default", *ROPE_INIT_FUNCTIONS}


def config_dict(model) -> dict:
    """The architecture part of a model's config as plain JSON-able values."""
    d = model.config.to_dict()
    return {k: d[k] for k in CONFIG_KEYS if k in d}


def _shape(t) -> tuple:
    return tuple(t.shape)


def _meta_model(cfg, source):
    from transformers import LlamaForCausalLM

    try:
        with torch.device("meta"):
            return LlamaForCausalLM(cfg).eval()
    except Exception as e:
        fail(source, f"transformers cannot build a model from this config ({type(e).__name__}: {str(e)[:300]})")


def _lazy_values(d: dict, seen: dict) -> dict:
    """Tensors in memory become :class:`LazyTensor` (one per tensor object, so sharing is kept)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, torch.Tensor):
            v = seen.setdefault(id(v), LazyTensor.of(v))
        out[k] = v
    return out


def _dtype_name(dt: torch.dtype) -> str:
    return str(dt).replace("torch.", "")


#: Seconds a load runs before its progress bar appears (tqdm's ``delay``).
PROGRESS_DELAY = 2.0


class _Progress:
    """tqdm on stderr (bytes and tensors) for a load that takes more than ~2 s; silent otherwise."""

    def __init__(self, total: int, n: int, source: str, enabled: bool):
        self.bar, self.n, self.done = None, n, 0
        if enabled and total:
            import sys

            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, delay=PROGRESS_DELAY,
                            file=sys.stderr,
                            desc=f"loading {Path(source).name}", leave=False, postfix=f"0/{n} tensors")

    def update(self, nbytes: int) -> None:
        if self.bar is not None:
            self.bar.update(nbytes)

    def tensor_done(self) -> None:
        self.done += 1
        if self.bar is not None:
            self.bar.set_postfix_str(f"{self.done}/{self.n} tensors", refresh=self.done == self.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def build_model(cfg, dense: dict, factors: dict[str, tuple], meta: dict, source: str | Path,
                dtype: torch.dtype | None = None, allow_nonfinite: bool = False,
                buffers: set[str] | None = None, progress: bool = False):
    """Construct ``LlamaForCausalLM(cfg)`` with the factors and dense tensors; everything checked first.

    Values are :class:`~.lazy.LazyTensor` (what the readers hand over) or tensors in memory.
    ``dtype=None`` keeps the stored dtype of each tensor (SVD-LLM: fp32 factors, fp16 rest;
    ``LowRankLinear`` computes in its factors' dtype); a dtype casts every tensor while streaming.
    ``buffers``: which ``dense`` keys were buffers in the file (only those may be derived buffers);
    None when the file does not say (state dicts). ``progress``: a tqdm bar if the load takes > ~2 s.
    """
    source = str(source)
    seen: dict[int, LazyTensor] = {}
    dense = _lazy_values(dense, seen)
    factors = {n: tuple(seen.setdefault(id(x), LazyTensor.of(x)) if isinstance(x, torch.Tensor) else x
                        for x in f) if isinstance(f, tuple) else f for n, f in factors.items()}
    cfg_obj = llama_config(cfg, source) if isinstance(cfg, dict) else cfg
    if cfg_obj.tie_word_embeddings and "lm_head" in factors:
        cfg_obj.tie_word_embeddings = False      # a factorized head cannot be the embedding
    model = _meta_model(cfg_obj, source)
    mods = dict(model.named_modules())
    dense, dropped = split_derived(dict(dense), cfg_obj, source, buffers)
    for k, v in dense.items():
        if not isinstance(v, LazyTensor):
            fail(source, f"'{k}' is {brief(v)}, expected a tensor", key=k)

    # ---- factors: modules, shapes, ranks, dtypes
    norm: dict[str, tuple] = {}
    for name, f in factors.items():
        if not isinstance(f, tuple) or len(f) not in (3, 4):
            raise TypeError(f"factors[{name!r}] must be (U, V, bias[, names])")
        U, V, b = f[:3]
        names = {"U": f"{name}.U", "V": f"{name}.V", "bias": f"{name}.bias", **(f[3] if len(f) == 4 else {})}
        lin = mods.get(name)
        if not isinstance(lin, nn.Linear):
            fail(source, f"factors '{names['U']}' / '{names['V']}' are for '{name}', which is not a projection of "
                         f"this {cfg_obj.num_hidden_layers}-layer model", key=names["U"])
        for side, t in (("U", U), ("V", V), ("bias", b)):
            if t is None and side == "bias":
                continue
            if isinstance(t, QuantizedFactor) and side != "bias":
                t.check(source)
                continue
            if not isinstance(t, LazyTensor) or not t.dtype.is_floating_point:
                fail(source, f"factor '{names[side]}' is {brief(t) if not isinstance(t, LazyTensor) else t.dtype}, "
                             f"expected a floating-point tensor", key=names[side])
        o, i = lin.out_features, lin.in_features
        if U.dim() != 2 or V.dim() != 2 or U.shape[0] != o or V.shape[1] != i or U.shape[1] != V.shape[0]:
            fail(source, f"'{name}' factors '{names['U']}' {_shape(U)} and '{names['V']}' {_shape(V)}; expected "
                         f"[{o}, r] and [r, {i}] with the same r", key=names["U"])
        if b is not None and _shape(b) != (o,):
            fail(source, f"'{names['bias']}' has shape {_shape(b)}, expected ({o},)", key=names["bias"])
        norm[name] = (U, V, b, names)
    out_by_v: dict[int, int] = {}
    in_by_u: dict[int, int] = {}
    for U, V, _, _ in norm.values():
        out_by_v[id(V)] = out_by_v.get(id(V), 0) + U.shape[0]
        in_by_u[id(U)] = in_by_u.get(id(U), 0) + V.shape[1]
    for name, (U, V, _, names) in norm.items():
        r, cap = U.shape[1], min(out_by_v[id(V)], in_by_u[id(U)])
        if r < 1:
            fail(source, f"'{name}' has rank 0 ('{names['U']}' {_shape(U)}); a factorization needs rank >= 1",
                 key=names["U"])
        if r > cap:
            fail(source, f"'{name}' has rank {r} > min(out, in) = {cap} ('{names['U']}' {_shape(U)}, "
                         f"'{names['V']}' {_shape(V)}): more parameters than the dense matrix and no more "
                         f"expressive; refusing", key=names["U"])

    # ---- dense tensors against the meta model's state dict
    expected = dict(model.state_dict())
    fact_keys = {f"{n}.{s}" for n in norm for s in ("weight", "bias")}
    tied = bool(getattr(cfg_obj, "tie_word_embeddings", False))
    expected = {k: v for k, v in expected.items() if k not in fact_keys}
    if tied:
        expected.pop("lm_head.weight", None)
        dense.pop("lm_head.weight", None)   # HF omits it when tied; a stored copy is the embedding again
    extra = sorted(k for k in dense if k not in expected)
    if extra:
        fail(source, f"unexpected tensor(s) {extra[:5]}{' ...' if len(extra) > 5 else ''} for this layout "
                     f"(not part of a {cfg_obj.num_hidden_layers}-layer Llama model, not a derived buffer)",
             key=extra[0])
    missing = [k for k in expected if k not in dense]
    if missing:
        fail(source, f"missing tensor(s) {missing[:5]} (expected by the config)", key=missing[0])
    for k, ref in expected.items():
        t = dense[k]
        if _shape(t) != _shape(ref):
            fail(source, f"tensor '{k}' has shape {_shape(t)}, expected {_shape(ref)}", key=k)
        if not t.dtype.is_floating_point:
            fail(source, f"tensor '{k}' has dtype {t.dtype}, expected a floating-point dtype", key=k)

    # ---- stream: each distinct tensor read once, in file order; cast; NaN/Inf refused after the cast
    named = [(names[s], t) for U, V, b, names in norm.values() for s, t in (("U", U), ("V", V), ("bias", b))
             if t is not None and not isinstance(t, QuantizedFactor)] + list(dense.items())
    quant = [t for U, V, _, _ in norm.values() for t in (U, V) if isinstance(t, QuantizedFactor)]
    as_stored = {id(x) for t in quant for x in (t.data, t.scale)}       # codes and scales are never cast
    named += [(k, x) for t in quant for k, x in zip(t.keys, (t.data, t.scale))]
    distinct: dict[int, tuple[str, LazyTensor]] = {}
    for key, t in named:
        distinct.setdefault(id(t), (key, t))
    order = sorted(distinct.values(), key=lambda kt: kt[1].position())
    bar = _Progress(sum(t.stored_bytes() for _, t in order), len(order), source, progress)
    loaded: dict[int, torch.Tensor] = {}
    bad = {}
    stored_b: dict[str, int] = {}
    try:
        with one_thread():
            for key, t in order:
                c, ok = stream(t, None if id(t) in as_stored else dtype, bar.update)
                stored_b[_dtype_name(t.dtype)] = stored_b.get(_dtype_name(t.dtype), 0) + t.nbytes
                loaded[id(t)] = c
                bar.tensor_done()
                if ok:
                    continue
                nan, inf, first = count_nonfinite(c)
                after = ""
                if dtype is not None and t.dtype != dtype and count_nonfinite(t.load()) is None:
                    after = f" after casting to {dtype}"
                if not allow_nonfinite:
                    fail(source, f"tensor '{key}' holds {nan} NaN and {inf} Inf values{after} (first at index "
                                 f"{first}); refusing. load_checkpoint(..., allow_nonfinite=True) loads it for "
                                 f"inspection", key=key)
                bad[key] = {"nan": nan, "inf": inf, "first": list(first)}
    finally:
        bar.close()

    # ---- assemble (nothing above allocated model memory beyond the streamed tensors)
    params: dict[int, nn.Parameter] = {}

    def cast(t):
        return loaded[id(t)]

    def param(t):
        if id(t) not in params and isinstance(t, QuantizedFactor):
            params[id(t)] = QuantizedTensor(cast(t.data), cast(t.scale), t.bits, t.group, t.shape)
        if id(t) not in params:
            params[id(t)] = nn.Parameter(cast(t), requires_grad=False)
        return params[id(t)]

    if "lm_head" in norm:
        untie_lm_head(model)
    for name, (U, V, b, _) in norm.items():
        set_module(model, name, LowRankLinear(param(U), param(V), None if b is None else param(b)))
    try:
        model.load_state_dict({k: cast(v) for k, v in dense.items()}, strict=False, assign=True)
    except Exception as e:
        raise CheckpointError(f"{source}: tensors do not fit the model ({type(e).__name__}: {e})",
                              path=source) from e
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    _materialize_buffers(model, cfg_obj, source)
    if dtype is not None:
        model.to(dtype)
    model.eval().requires_grad_(False)
    info = dict(meta)
    info["ranks"] = {n: m.rank for n, m in model.named_modules() if isinstance(m, LowRankLinear)}
    info.setdefault("shared_groups", shared_groups(model))
    info["realised_keep"] = account(model).linear_keep
    info["source"] = source
    loaded_b: dict[str, int] = {}
    for c in loaded.values():
        loaded_b[_dtype_name(c.dtype)] = loaded_b.get(_dtype_name(c.dtype), 0) + c.numel() * c.element_size()
    info["dtypes"] = {"stored": stored_b, "loaded": loaded_b, "requested": None if dtype is None else
                      _dtype_name(dtype)}
    if dropped:
        info["derived_buffers_dropped"] = dropped
    if bad:
        info["nonfinite"] = bad
        warnings.warn(f"{source}: loaded with non-finite values in {sorted(bad)[:5]} (allow_nonfinite=True)",
                      stacklevel=3)
    model.lowrank_meta = info
    return model


def _materialize_buffers(model, cfg, source) -> None:
    """Recompute on the CPU the buffers the meta model left empty (RoPE), then check nothing is left on meta."""
    for name, mod in list(model.named_modules()):
        if any(b.is_meta for b in mod.buffers(recurse=False)):
            if not type(mod).__name__.endswith("RotaryEmbedding"):
                fail(source, f"internal: module '{name}' ({type(mod).__name__}) has buffers left unset")
            set_module(model, name, type(mod)(config=cfg))
    left = [k for k, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        fail(source, f"internal: tensors {left[:5]} were never loaded")


def check_aliases(tensors: list[tuple[str, LazyTensor]], source: str) -> LazyTensor:
    """All named tensors must be equal (they are aliases of one shared basis); return the first.

    Aliases reading the same bytes of the file (what transformers' ``.bin`` save writes: one storage)
    are equal without reading them; others are read, compared and the dropped copy handed back."""
    name0, t0 = tensors[0]
    for name, t in tensors[1:]:
        if _shape(t) != _shape(t0) or t.dtype != t0.dtype:
            raise CheckpointError(f"{source}: shared tensor '{name}' has shape {_shape(t)} {t.dtype}, its alias "
                                  f"'{name0}' has {_shape(t0)} {t0.dtype}", path=source, key=name)
        if t is t0 or t.same_bytes(t0):
            continue
        a, b = t.load(), t0.load()
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs()
            diff = diff[torch.isfinite(diff)]
            raise CheckpointError(f"{source}: '{name}' and '{name0}' should be the same shared basis but differ "
                                  f"(max abs diff {float(diff.max()) if diff.numel() else float('nan'):.3g}); "
                                  f"refusing", path=source, key=name)
        del a
        t.release()
    return t0
