"""The ONE registry of compression families: compressor, checkpoint format, reader, writer, native knob, notes.

Every place that needs a family by name asks here (``compress.COMPRESSORS``, ``formats.load_checkpoint``
/ ``write_native`` / ``detect_format``, ``formats.inspect.describe``, ``ranks.native_to_keep``), so a
family has one spelling and one set of facts. Old spellings are accepted as aliases
(``"dobi_remap"``, ``"basis-sharing"``, ``"svd-llm"``, ...); an unknown name raises
:class:`UnknownFamily` listing the known ones.

    >>> from lowrank_lib import families
    >>> f = families.get("basis-sharing")            # -> the "basis_sharing" entry
    >>> f.format, f.knob, f.to_keep(20)               # ('basis_sharing', 'compression_ratio ...', 0.8)
    >>> model = f.compress(dense, stats, keep=0.8)    # its compressor (uniform signature)
    >>> f.read("share_llama2-7b_20")                  # its checkpoint reader

Two kinds of entries share the table: *methods* (``compressor`` set; ``format`` names the
checkpoint layout they are written in) and *formats* (``reader``/``writer`` set). ``svdllm_v2`` is a
method written in the ``svdllm`` format; ``svd`` (plain truncated SVD) is written in ``lowrank``
(ours); ``lowrank`` is a format only.

Implementations are referenced as ``"module:function"`` and imported on first use: this module
imports neither ``compress/`` nor ``formats/``, so both may consult it and still never import
each other. ``tests/test_families.py`` resolves every reference.

Canonical names keep the spellings already written into checkpoints and results
(``lowrank_meta["family"]``, manifests, JSON tables): ``"dobi-remap"`` keeps its hyphen.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Callable


class UnknownFamily(ValueError):
    """A family name that is neither a canonical name nor an alias."""


def _identity(x: float) -> float:
    return float(x)


@dataclass(frozen=True)
class Family:
    name: str
    title: str
    format: str                                  # the checkpoint format it is written in (an entry with a reader)
    knob: str                                    # the family's own ratio knob, in its own words
    to_keep: Callable[[float], float]            # native knob -> canonical keep (see lowrank_lib.ranks)
    from_keep: Callable[[float], float]          # canonical keep -> native knob
    compressor: str | None = None                # "module:function"; called (model, stats, keep, **kw)
    needs_stats: bool = True                     # False: compressor(model, keep, **kw) (plain SVD)
    reader: str | None = None                    # "module:function"(path, dtype=, allow_nonfinite=)
    writer: str | None = None                    # "module:function"(model, path, tokenizer=None, **kw)
    notes: dict = field(default_factory=dict)    # U / V / sigma / ratio / container, for describe()
    aliases: tuple[str, ...] = ()
    #: the file holds quantized factor codes and the reader serves them at ``factor_bits`` itself (requantized from
    #: the codes while streaming, never widened); other families are read, then quantized
    reads_codes: bool = False

    # -- implementations, imported on first use
    def _resolve(self, ref: str | None, what: str) -> Callable:
        if ref is None:
            raise UnknownFamily(f"family {self.name!r} has no {what}")
        mod, _, fn = ref.partition(":")
        return getattr(importlib.import_module(mod), fn)

    @property
    def compressor_fn(self) -> Callable:
        return self._resolve(self.compressor, "compressor")

    @property
    def reader_fn(self) -> Callable:
        return self._resolve(self.reader, "checkpoint reader")

    @property
    def writer_fn(self) -> Callable:
        return self._resolve(self.writer, "checkpoint writer")

    def compress(self, model, stats, keep: float, **kw):
        """Run the compressor with one signature for every family (plain SVD ignores ``stats``)."""
        fn = self.compressor_fn
        return fn(model, stats, keep, **kw) if self.needs_stats else fn(model, keep, **kw)

    def read(self, path, **kw):
        return self.reader_fn(path, **kw)


def _removed_fraction(x: float) -> float:
    return 1.0 - float(x)


def _percent_removed(x: float) -> float:
    return 1.0 - float(x) / 100.0


def _to_percent_removed(keep: float) -> float:
    return round((1.0 - float(keep)) * 100, 6)


def _notes(u: str, v: str, sigma: str, ratio: str, container: str) -> dict:
    return {"U": u, "V": v, "sigma": sigma, "ratio": ratio, "container": container}


_SVDLLM_NOTES = _notes("<p>_u_proj.weight [out,r] fp32", "<p>_v_proj.weight [r,in] fp32",
                       "sqrt on each side (after whitening)", "file name = keep (CLI --ratio = removed)",
                       "pickled {'model','tokenizer'} (component.svd_llama.*)")
_LOWRANK_NOTES = _notes("<m>.U [out,r]", "<m>.V [r,in] (shared = one entry)", "as the source family",
                        "canonical keep", "model.safetensors + lowrank_manifest.json (mmap)")

_ENTRIES = (
    Family("svd", "plain truncated SVD", format="lowrank", knob="keep (canonical)", to_keep=_identity,
           from_keep=_identity, compressor="lowrank_lib.compress.svd:compress_svd", needs_stats=False,
           notes=_LOWRANK_NOTES),
    Family("asvd", "ASVD", format="asvd", knob="param_ratio_target p = keep (asvd90 -> 0.9)", to_keep=_identity,
           from_keep=_identity, compressor="lowrank_lib.compress.asvd:compress_asvd",
           reader="lowrank_lib.formats.asvd:read", writer="lowrank_lib.formats.asvd:write",
           notes=_notes("<m>.ALinear.weight [out,r]", "<m>.BLinear.weight [r,in]",
                        "sqrt on each side (V divided by activation scale)", "asvd<pct>: keep p",
                        "HF folder, model.safetensors + truncation_ranks")),
    Family("svdllm", "SVD-LLM v1", format="svdllm", knob="CLI --ratio = fraction removed (the file name holds keep)",
           to_keep=_removed_fraction, from_keep=_removed_fraction,
           compressor="lowrank_lib.compress.svdllm:compress_svdllm",
           reader="lowrank_lib.formats.svdllm:read", writer="lowrank_lib.formats.svdllm:write",
           notes=_SVDLLM_NOTES, aliases=("svd-llm", "svd_llm", "svdllm_v1", "svdllm-v1", "svdllm-cli")),
    Family("svdllm_v2", "SVD-LLM v2", format="svdllm",
           knob="CLI --ratio = fraction removed (mean; per-matrix keep varies)", to_keep=_removed_fraction,
           from_keep=_removed_fraction,
           compressor="lowrank_lib.compress.svdllm:compress_svdllm_v2", notes=_SVDLLM_NOTES,
           aliases=("svd-llm-v2", "svdllmv2")),
    Family("basis_sharing", "Basis Sharing", format="basis_sharing", knob="compression_ratio cr = percent removed",
           to_keep=_percent_removed, from_keep=_to_percent_removed,
           compressor="lowrank_lib.compress.basis_sharing:compress_basis_sharing",
           reader="lowrank_lib.formats.basis_sharing:read", writer="lowrank_lib.formats.basis_sharing:write",
           notes=_notes("<t>_proj.weight (coefficient) [out,nb]", "<t>_basis.weight [nb,in], shared by a group",
                        "all in the basis (coefficients orthonormal)", "compression_ratio = % removed",
                        "HF folder, pytorch_model.bin + num_basis_*/*_groups"),
           aliases=("basissharing", "share")),
    Family("dobi", "Dobi-SVD (no remap)", format="dobi", knob="target_ratio = keep of all Linear parameters",
           to_keep=_identity, from_keep=_identity, compressor="lowrank_lib.compress.dobi:compress_dobi",
           reader="lowrank_lib.formats.dobi:read", writer="lowrank_lib.formats.dobi:write",
           notes=_notes("<m>.BLinear.weight [out,r] fp16", "<m>.ALinear.weight [r,in] fp16", "sqrt on each side",
                        "target_ratio = keep of all Linear params",
                        "pickled {'model','tokenizer'} (modules.module.SVDTransformLayer), cuda:0 storages"),
           aliases=("dobi-svd", "dobi_svd", "dobisvd")),
    Family("dobi-remap", "Dobi-SVD (remap)", format="dobi-remap",
           knob="target_ratio = keep; budget k*max(m,n) fp16-equivalents", to_keep=_identity, from_keep=_identity,
           compressor="lowrank_lib.compress.dobi:compress_dobi_remap",
           reader="lowrank_lib.formats.dobi:read_remap", writer="lowrank_lib.formats.dobi:write_remap",
           notes=_notes("deq(us_quan)^T (+ 'us' tail) [out,k]", "deq(vt_quan) (+ 'vt' tail) [k,in]",
                        "on U if out>=in, else on V", "target_ratio = keep, budget k*max(m,n)",
                        "folder: pytorch_model.bin (non-layer) + remapping_weight.pt (uint8 codes)"),
           aliases=("dobi_remap", "dobiremap", "dobi-svd-remap"), reads_codes=True),
    Family("palu", "Palu", format="palu", knob="param_ratio_target = kept fraction of k/v rank", to_keep=_identity,
           from_keep=_identity, compressor="lowrank_lib.compress.palu:compress_palu",
           reader="lowrank_lib.formats.palu:read", writer="lowrank_lib.formats.palu:write",
           notes=_notes("blockdiag(<m>.U.<g>.weight [gd,r_g])", "<m>.VT.weight [sum r_g,in]",
                        "sqrt on each side (whitened)", "param_ratio_target = kept k/v rank",
                        "HF folder, model.safetensors + head_wise_ranks (k/v only)")),
    Family("lowrank", "lowrank_lib's own format", format="lowrank", knob="keep (canonical)", to_keep=_identity,
           from_keep=_identity, reader="lowrank_lib.formats.lowrank:read", writer="lowrank_lib.formats.lowrank:write",
           notes=_LOWRANK_NOTES, aliases=("ours", "lowrank_lib")),
)

FAMILIES: dict[str, Family] = {f.name: f for f in _ENTRIES}


def _norm(name: str) -> str:
    return name.strip().lower().replace("-", "_").replace(" ", "_")


_LOOKUP: dict[str, str] = {}
for _f in _ENTRIES:
    for _n in (_f.name, *_f.aliases):
        if _norm(_n) in _LOOKUP and _LOOKUP[_norm(_n)] != _f.name:
            raise RuntimeError(f"family alias {_n!r} is ambiguous")
        _LOOKUP[_norm(_n)] = _f.name


def canonical(name: str) -> str:
    """The one spelling of a family name or alias; :class:`UnknownFamily` for anything else."""
    if isinstance(name, str) and _norm(name) in _LOOKUP:
        return _LOOKUP[_norm(name)]
    raise UnknownFamily(f"unknown family {name!r}; known: {', '.join(FAMILIES)} "
                        f"(aliases accepted: {', '.join(a for f in _ENTRIES for a in f.aliases)})")


def get(name: str) -> Family:
    return FAMILIES[canonical(name)]


def methods() -> tuple[Family, ...]:
    """Entries with a compressor, in table order."""
    return tuple(f for f in _ENTRIES if f.compressor)


def formats() -> tuple[Family, ...]:
    """Entries that are checkpoint formats (have a reader), in table order."""
    return tuple(f for f in _ENTRIES if f.reader)


def get_format(name: str) -> Family:
    """The format entry for a family or format name (``svdllm_v2`` -> ``svdllm``, ``svd`` -> ``lowrank``)."""
    return FAMILIES[get(name).format]


def native_to_keep(family: str, value: float) -> float:
    """A family's native ratio knob as the canonical keep fraction."""
    return get(family).to_keep(value)


__all__ = ["FAMILIES", "Family", "UnknownFamily", "canonical", "formats", "get", "get_format", "methods",
           "native_to_keep"]
