"""Synthetic checkpoints: every family's native file at a real model's shape, with random weights, written without
holding the model in memory (the loader benchmark's files, ``bench load``; the small ones the tests read).

Per family the checkpoint is written by the library's native writer (``formats.write_native``: the layout, dtypes,
class paths and config fields each family's original code saves) at a model geometry (:data:`SHAPES`: Llama-3.2-1B,
LLaMA-7B, a 200-400 MB ``test`` shape and a tiny ``quick`` one). Writing a 4-21 GB file must not need the model
twice in memory, so the model is built from *zero-page placeholders* (:func:`zero_pages`: each tensor its own
private anonymous mapping, never touched, so it costs no RSS), the writer streams those zeros to disk, and
:func:`fill_random` then overwrites every all-zero tensor in the written files with random bytes that are finite in
every float dtype (each byte masked with ``0xBF``: |x| < 2), fixing the zip CRCs. Tensors the writer computed
itself (RoPE ``inv_freq``, Dobi's remap codes) keep their values. :class:`RefusedTokenizer` pickles a global no
allow-list holds (a file the reader must refuse).
"""
from __future__ import annotations

import mmap
import os
import zipfile
import zlib
from pathlib import Path

import torch
from torch import nn

from .factorized import LLAMA_PARENT, LLAMA_PROJ, LowRankLinear, set_module
from .models import LLAMA7B
from .models import SHAPES as MODEL_SHAPES
from .ranks import basis_sharing_num_basis, keep_rank

__all__ = ["FAMILIES", "MODEL_NAMES", "NATIVE_DTYPES", "SHAPES", "RefusedTokenizer", "families_format", "fill_random",
           "placeholder_model", "synthetic_tokenizer", "weight_files", "write_family", "zero_pages"]

#: Geometries (``LlamaConfig`` fields). ``llama-3.2-1b``: the issue's file (untied head, 2048 positions:
#: SVD-LLM's evaluation length; 4.18 GB as SVD-LLM v1 at keep 0.8). ``test``: files of 200-400 MB.
SHAPES: dict[str, dict] = {
    "quick": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512, max_position_embeddings=256),
    "test": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=16000, max_position_embeddings=2048),
    "llama-3.2-1b": dict(MODEL_SHAPES["llama3.2-1b"], max_position_embeddings=2048),
    "llama-7b": dict(LLAMA7B, max_position_embeddings=2048),
}
MODEL_NAMES = {"quick": "org/tiny", "test": "org/test-llama", "llama-3.2-1b": "meta-llama/Llama-3.2-1B",
               "llama-7b": "jeffwan/llama-7b-hf"}

#: (factor dtype, dense dtype) each family's original code stores.
NATIVE_DTYPES = {
    "svdllm": (torch.float32, torch.float16), "svdllm_v2": (torch.float32, torch.float16),   # W.float() factors
    "dobi": (torch.float16, torch.float16), "dobi-remap": (torch.float16, torch.float16),   # fp16 model, codes
    "basis_sharing": (torch.float32, torch.float32),                                        # fp32 checkpoints
    "asvd": (torch.float16, torch.float16), "palu": (torch.float16, torch.float16),         # save_pretrained fp16
    "lowrank": (torch.float32, torch.float16),                                              # an SVD-LLM file, ours
}
FAMILIES = tuple(NATIVE_DTYPES)
PALU_GROUP = 4          # Palu's head_group_size (``gs-4``)
V2_SPREAD = 0.1         # SVD-LLM v2 row: per-matrix keep uniform in keep +- V2_SPREAD (seeded)


# --------------------------------------------------------------------------- placeholders
def zero_pages(shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of zeros that costs no memory until written: its own private anonymous mapping.

    (``torch.empty`` of a few MB comes from the heap and may hold old bytes; a fresh mapping is zero
    pages, and reading it, as ``torch.save`` does, maps the shared zero page without new RSS.)"""
    n = torch.Size(shape).numel() * dtype.itemsize
    if n == 0:
        return torch.empty(shape, dtype=dtype)
    mm = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    return torch.frombuffer(mm, dtype=dtype).view(shape)


def _factor(out_f: int, in_f: int, r: int, dtype) -> LowRankLinear:
    return LowRankLinear(zero_pages((out_f, r), dtype), zero_pages((r, in_f), dtype))


def placeholder_model(shape: str | dict, family: str, keep: float = 0.8, seed: int = 0):
    """A compressed ``LlamaForCausalLM`` of ``family``'s structure whose weights are zero-page placeholders.

    Ranks as each family derives them: ``keep_rank`` (SVD-LLM v1, ASVD, Dobi, ours), a per-matrix
    keep around ``keep`` (SVD-LLM v2), Basis Sharing's ``num_basis`` over groups of 2 layers sharing
    q, k, v, gate and up, Palu's aligned head-group ranks of k/v only."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from .compress.basis_sharing import layer_groups
    from .compress.palu import palu_group_rank
    from .geometry import geometry

    geo = SHAPES[shape] if isinstance(shape, str) else shape
    cfg = LlamaConfig(**{**geo, "tie_word_embeddings": False}, attn_implementation="sdpa")
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).eval()
    fdt, ddt = NATIVE_DTYPES[family]
    g = torch.Generator().manual_seed(seed)
    n = cfg.num_hidden_layers
    meta = {"family": families_format(family), "keep": keep, "shared_groups": []}
    if family == "svdllm_v2":
        meta["variant"] = "v2"
    if family == "palu":
        gg = geometry(cfg)
        G = max(1, gg.n_kv_heads // PALU_GROUP)
        gd = gg.kv_dim // G
        hw = {}
        for i in range(n):
            for p in ("k_proj", "v_proj"):
                name = f"model.layers.{i}.self_attn.{p}"
                ranks = [palu_group_rank(gd, keep)] * G
                U = zero_pages((G * gd, sum(ranks)), fdt)        # zeros: block-diagonal for any blocks
                set_module(model, name, LowRankLinear(U, zero_pages((sum(ranks), cfg.hidden_size), fdt)))
                hw[name] = ranks
        meta["head_wise_ranks"] = hw
    else:
        shared = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj") if family == "basis_sharing" else ()
        for p in LLAMA_PROJ:
            lin = model.model.layers[0].get_submodule(f"{LLAMA_PARENT[p]}.{p}")
            o, i_f = lin.out_features, lin.in_features
            groups = layer_groups(n, 2) if p in shared else [[i] for i in range(n)]
            for grp in groups:
                if family == "basis_sharing":
                    nb = basis_sharing_num_basis(i_f, o, len(grp), keep)
                    V = nn.Parameter(zero_pages((nb, i_f), fdt), requires_grad=False)   # ONE basis per group
                    for i in grp:
                        set_module(model, f"model.layers.{i}.{LLAMA_PARENT[p]}.{p}",
                                   LowRankLinear(zero_pages((o, nb), fdt), V))
                    continue
                k = keep
                if family == "svdllm_v2":
                    k = keep + V2_SPREAD * (2 * float(torch.rand((), generator=g)) - 1)
                r = keep_rank(o, i_f, k)
                set_module(model, f"model.layers.{grp[0]}.{LLAMA_PARENT[p]}.{p}", _factor(o, i_f, r, fdt))
    for mod in model.modules():                      # every dense parameter: a placeholder in the dense dtype
        if isinstance(mod, LowRankLinear):
            continue
        for k, v in list(mod.named_parameters(recurse=False)):
            if v.is_meta:
                setattr(mod, k, nn.Parameter(zero_pages(v.shape, ddt), requires_grad=False))
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)
    model.requires_grad_(False)
    model.lowrank_meta = meta
    return model


def families_format(family: str) -> str:
    from . import families

    return families.get_format(family).name


def synthetic_tokenizer(vocab_size: int):
    """A fast tokenizer with a ``vocab_size``-entry vocabulary (what the pickled families save beside the
    model; its state is a few MB of the pickle)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"t{i}": i for i in range(3, vocab_size)}}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")),
                                   bos_token="<s>", eos_token="</s>", unk_token="<unk>")


class RefusedTokenizer:
    """Pickles as a call of ``builtins.print``: a global no allow-list holds (the refusal row). Our reader
    refuses it when the unpickler reaches it, after every tensor of the model; nothing is ever run."""

    def __reduce__(self):
        return print, ("a global the restricted unpickler refuses",)


# --------------------------------------------------------------------------- writing, filling
def write_family(family: str, shape: str | dict, folder: str | Path, keep: float = 0.8, seed: int = 0,
                 tokenizer=None, fill: bool = True) -> Path:
    """Write ``family`` at ``shape`` into ``folder`` as its native layout (random weights); returns the path
    :func:`lowrank_lib.formats.load_checkpoint` takes (the ``.pt`` file or the folder)."""
    from .formats import asvd, basis_sharing, dobi, palu, write_native

    folder = Path(folder)
    shape_name = shape if isinstance(shape, str) else "custom"
    model_name = MODEL_NAMES.get(shape_name, "org/model")
    base = model_name.split("/")[-1]
    model = placeholder_model(shape, family, keep, seed)
    fmt = families_format(family)
    kw = {}
    if fmt == "svdllm":
        target, kw = folder / f"svdllm{'_v2' if family == 'svdllm_v2' else ''}", {"model_name": model_name,
                                                                                    "keep": keep}
    elif fmt in ("dobi", "dobi-remap"):
        target = folder / dobi.native_dirname(model_name, keep, remap=fmt == "dobi-remap")
    elif fmt == "basis_sharing":
        target = folder / basis_sharing.native_dirname(model_name, keep)
    elif fmt == "asvd":
        target = folder / asvd.native_dirname(model_name, keep)
    elif fmt == "palu":
        target = folder / palu.native_dirname(base, keep, PALU_GROUP)
    else:
        target = folder / f"lowrank-{base}"
    path = write_native(model, fmt, target, tokenizer=tokenizer, **kw)
    del model
    if fill:
        fill_random(path, seed)
    return Path(path)


def weight_files(path: Path) -> list[Path]:
    path = Path(path)
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir() if p.is_file() and p.suffix in (".pt", ".bin", ".safetensors"))


def _pool(seed: int, nbytes: int = 32 << 20) -> bytes:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g) & 0xBF).numpy().tobytes()


class _Filler:
    """Overwrites all-zero byte ranges of one file with masked random bytes (pread / pwrite: the page
    cache, never a mapping, so this process's RSS stays small)."""

    def __init__(self, path: Path, seed: int):
        self.fd = os.open(path, os.O_RDWR)
        self.pool = _pool(seed)
        self.at = seed * 7919 % len(self.pool)

    def zero(self, off: int, n: int, step: int = 8 << 20) -> bool:
        for a in range(off, off + n, step):
            b = os.pread(self.fd, min(step, off + n - a), a)
            if b.count(0) != len(b):
                return False
        return True

    def fill(self, off: int, n: int, step: int = 8 << 20) -> int:
        crc = 0
        for a in range(off, off + n, step):
            m = min(step, off + n - a)
            if self.at + m > len(self.pool):
                self.at = 0
            chunk = self.pool[self.at:self.at + m]
            self.at = (self.at + 4099 * 8) % len(self.pool)
            os.pwrite(self.fd, chunk, a)
            crc = zlib.crc32(chunk, crc)
        return crc

    def close(self):
        os.close(self.fd)


def _fill_zip(path: Path, seed: int) -> int:
    """Fill the all-zero storage records of a torch.save zip archive; patch their CRC-32 in the local header,
    the data descriptor (if any) and the central directory. Returns the bytes filled."""
    import struct

    with zipfile.ZipFile(path) as zf:
        infos = zf.infolist()
        start_dir = zf.start_dir
    f = _Filler(path, seed)
    done = 0
    try:
        cd = {}
        pos = start_dir
        while True:
            head = os.pread(f.fd, 46, pos)
            if head[:4] != b"PK\x01\x02":
                break
            nl, el, cl = struct.unpack_from("<HHH", head, 28)
            cd[os.pread(f.fd, nl, pos + 46).decode()] = pos
            pos += 46 + nl + el + cl
        for info in infos:
            if "/data/" not in info.filename or info.compress_type != zipfile.ZIP_STORED or not info.file_size:
                continue
            lh = os.pread(f.fd, 30, info.header_offset)
            nl, el = struct.unpack_from("<HH", lh, 26)
            off = info.header_offset + 30 + nl + el
            if not f.zero(off, info.file_size):
                continue
            crc = struct.pack("<L", f.fill(off, info.file_size))
            os.pwrite(f.fd, crc, info.header_offset + 14)
            os.pwrite(f.fd, crc, cd[info.filename] + 16)
            if info.flag_bits & 0x8:
                dd = off + info.compress_size
                sig = os.pread(f.fd, 4, dd)
                os.pwrite(f.fd, crc, dd + (4 if sig == b"PK\x07\x08" else 0))
            done += info.file_size
    finally:
        f.close()
    return done


def _fill_safetensors(path: Path, seed: int) -> int:
    from .formats.safetensors_file import check_safetensors

    h = check_safetensors(path)
    f = _Filler(path, seed)
    done = 0
    try:
        for t in h.tensors.values():
            n = t.end - t.begin
            if n and t.dtype.is_floating_point and f.zero(h.data_start + t.begin, n):
                f.fill(h.data_start + t.begin, n)
                done += n
    finally:
        f.close()
    return done


def fill_random(path: str | Path, seed: int = 0) -> int:
    """Random finite values for every all-zero tensor of a written checkpoint (zip archives and safetensors)."""
    done = 0
    for i, p in enumerate(weight_files(Path(path))):
        done += _fill_safetensors(p, seed + i) if p.suffix == ".safetensors" else _fill_zip(p, seed + i)
    return done
