"""llama.cpp's GGUF files of a Llama model, both directions: the layout llama.cpp's converter writes, verified.

The peer benchmarks (``python -m lowrank_lib.bench peer``) time llama.cpp on the SAME weights our engine serves, so
this module writes them as llama.cpp reads them and reads them back:

- :func:`write_hf_gguf`: an HF ``LlamaForCausalLM`` -> a llama GGUF (gguf's tensor-name map, q/k rows in llama.cpp's
  order, the metadata its loader reads, a placeholder vocabulary when none is given), ``F32`` / ``BF16`` / any GGML
  type for the 2-D weights, 1-D tensors ``F32`` (as llama.cpp's converter and ``llama-quantize`` keep them);
- :func:`export_gguf`: any GGUF (e.g. the Q4_1 file our SmolLM2 cache was dequantised from) rewritten with every
  tensor dequantised (``gguf.quants.dequantize``, the code transformers uses) and stored as F32 or BF16
  (``gguf.quants.quantize``: round to nearest even, as ``torch.Tensor.to(bfloat16)``), metadata copied but
  ``general.file_type``;
- :func:`iter_gguf_state` / :func:`gguf_state_dict`: a llama GGUF -> HF names and row order, one tensor at a time;
- :func:`verify_gguf`: a file holds a state dict exactly (fp32 bit-equal; bf16 = torch's rounding), tensor by tensor.

Files are written one tensor in memory at a time (a memory-mapped 7B model is exported without a second copy), through
a temporary name. q/k rows: ``convert_hf_to_gguf.py`` interleaves the two RoPE halves of each head
(:func:`permute_qk`; transformers undoes it on load, :func:`unpermute_qk`).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..geometry import geometry

#: our dtype name -> GGML type name of the 2-D weights
DTYPE_TYPES = {"fp32": "F32", "bf16": "BF16"}
#: GGML type name of the 2-D weights -> ``general.file_type`` (llama.cpp's LlamaFileType)
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}
#: source GGUF keys that the writer sets itself
_WRITER_KEYS = ("general.architecture", "general.file_type")

__all__ = ["DTYPE_TYPES", "FILE_TYPES", "GGUFExportError", "decode_bytes_per_token", "export_gguf", "gguf_state_dict",
           "hf_to_gguf_names", "iter_gguf_state", "one_parse", "permute_qk", "placeholder_vocab", "unpermute_qk",
           "verify_gguf", "write_hf_gguf"]


class GGUFExportError(RuntimeError):
    """A GGUF could not be written or does not hold the weights it should; the message names the tensor."""


def permute_qk(W: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    """HF q/k rows [n_head * D, ...] -> llama.cpp's order (per head: the two RoPE halves interleaved)."""
    s = W.shape
    r = W.reshape(n_head, 2, s[0] // n_head // 2, *s[1:])
    return (r.swapaxes(1, 2) if isinstance(r, np.ndarray) else r.transpose(1, 2)).reshape(s)


def unpermute_qk(W: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    """llama.cpp's q/k rows -> HF's (the inverse of :func:`permute_qk`)."""
    s = W.shape
    r = W.reshape(n_head, s[0] // n_head // 2, 2, *s[1:])
    return (r.swapaxes(1, 2) if isinstance(r, np.ndarray) else r.transpose(1, 2)).reshape(s)


def hf_to_gguf_names(n_layers: int) -> dict[str, str]:
    """HF Llama parameter name -> GGUF tensor name, from gguf's own tensor-name map."""
    import gguf

    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    hf = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"] + [
        f"model.layers.{i}.{n}.weight" for i in range(n_layers)
        for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj", "self_attn.k_proj",
                  "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    out = {name: tmap.get_name(name, try_suffixes=(".weight",)) for name in hf}
    if None in out.values():
        raise GGUFExportError(f"gguf's LLAMA tensor map has no name for {[k for k, v in out.items() if v is None]}")
    return out


def _qk_heads(gguf_name: str, n_head: int, n_kv: int) -> int | None:
    return n_head if gguf_name.endswith("attn_q.weight") else n_kv if gguf_name.endswith("attn_k.weight") else None


# --------------------------------------------------------------------------- reading
@contextmanager
def one_parse(path: str | Path):
    """Within this block every read-only ``gguf.GGUFReader`` of ``path`` is the SAME reader, parsed once.

    transformers' GGUF config and tokenizer loaders take a path and parse the file's metadata afresh (two parses
    for ``AutoTokenizer``), as does :func:`iter_gguf_state`: for SmolLM2's 49k-entry vocabulary each parse took about
    3 s of the model cache's 12 s (measured). They import ``GGUFReader`` from ``gguf`` when called, so the name is
    swapped there for the block's duration (one thread: the cache's fetch) and put back after, also on error."""
    import gguf

    real, key, parsed = gguf.GGUFReader, os.path.realpath(path), {}

    def reader(p, mode="r"):
        if mode != "r" or os.path.realpath(p) != key:
            return real(p, mode)
        if "r" not in parsed:
            parsed["r"] = real(p, mode)
        return parsed["r"]

    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf.GGUFReader = real


def _open(path):
    """(reader, metadata {key: (value, types)}) of a GGUF file (memory-mapped; nothing dequantised)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    return r, {k: (f.contents(), list(f.types)) for k, f in r.fields.items() if not k.startswith("GGUF.")}


def _tensor(t) -> np.ndarray:
    """One tensor of a reader dequantised to a writable float32 array [out, in] or [n] (ggml's ne is [in, out])."""
    import gguf

    shape = tuple(int(x) for x in reversed(t.shape.tolist()))
    return np.array(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape), dtype=np.float32)


def iter_gguf_state(path: str | Path):
    """Yield ``(hf_name, float32 tensor)`` of a llama GGUF one tensor at a time (q/k rows unpermuted): a 7B
    file is read without holding it whole."""
    r, fields = _open(path)
    try:
        arch = fields["general.architecture"][0]
        n_layers, n_head = int(fields[f"{arch}.block_count"][0]), int(fields[f"{arch}.attention.head_count"][0])
        n_kv = int(fields.get(f"{arch}.attention.head_count_kv", (n_head,))[0])
    except KeyError as e:
        raise GGUFExportError(f"{path}: GGUF metadata lacks {e}: not a llama-architecture file") from None
    inv = {g: h for h, g in hf_to_gguf_names(n_layers).items()}
    for t in r.tensors:
        if t.name not in inv:
            raise GGUFExportError(f"{path}: tensor {t.name!r} has no HF Llama counterpart")
        a, heads = _tensor(t), _qk_heads(t.name, n_head, n_kv)
        yield inv[t.name], torch.from_numpy(unpermute_qk(a, heads) if heads else a)


def gguf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A llama GGUF -> HF Llama state dict (float32; q/k rows unpermuted; no lm_head when tied)."""
    return dict(iter_gguf_state(path))


# --------------------------------------------------------------------------- writing
def _encode(a: np.ndarray | torch.Tensor, qname: str) -> np.ndarray:
    """A float32 (or bf16 torch) array -> its bytes as GGML type ``qname``; a bf16 tensor written as BF16 is its
    own bits, everything else ``gguf.quants.quantize`` of the float32 values."""
    import gguf

    qt = gguf.GGMLQuantizationType[qname]
    if isinstance(a, torch.Tensor):
        if a.dtype == torch.bfloat16 and qname == "BF16":
            return a.contiguous().view(torch.int16).numpy().view(np.uint8)
        a = a.float().numpy()
    a = np.ascontiguousarray(a, dtype=np.float32)
    return a if qname == "F32" else gguf.quants.quantize(a, qt)


def _write(path: Path, arch: str, fields: dict, tensors, qname: str, progress: bool = False) -> Path:
    """Write ``tensors`` (``[(name, shape, get)]``, ``get()`` -> the float32 array, called once while writing) as
    ``qname`` (1-D ones as F32) with the metadata ``fields``: the tensor table first (from the shapes), then the
    data, one tensor in memory at a time; through a temporary name."""
    import gguf
    from tqdm.auto import tqdm

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    for key, (val, types) in fields.items():
        if key not in _WRITER_KEYS:
            vt = gguf.GGUFValueType(types[0])
            w.add_key_value(key, val, vt, sub_type=gguf.GGUFValueType(types[-1]) if vt == gguf.GGUFValueType.ARRAY
                            else None)
    w.add_file_type(FILE_TYPES.get(qname, 0))
    plan = []
    for name, shape, get in tensors:
        q = "F32" if len(shape) == 1 else qname
        if q == "F32":
            w.add_tensor_info(name, tuple(shape), np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            qt = gguf.GGMLQuantizationType[q]
            byte_shape = gguf.quant_shape_to_byte_shape(tuple(shape), qt)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qt)
        plan.append((q, get))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for q, get in tqdm(plan, desc=f"write {path.name}", disable=not progress, leave=False):
            w.write_tensor_data(_encode(get(), q))
    finally:
        w.close()
    os.replace(tmp, path)
    return path


def export_gguf(src: str | Path, dst: str | Path, dtype: str) -> Path:
    """Rewrite ``src`` (any GGUF, e.g. Q4_1) with every tensor dequantised and stored at ``dtype`` (``"fp32"``, or
    ``"bf16"``: BF16 2-D weights, F32 1-D tensors); tensor order, names and metadata copied, file type updated."""
    if dtype not in DTYPE_TYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(DTYPE_TYPES)}")
    r, fields = _open(src)
    tensors = [(t.name, tuple(int(x) for x in reversed(t.shape.tolist())), lambda t=t: _tensor(t)) for t in r.tensors]
    return _write(Path(dst), fields["general.architecture"][0], fields, tensors, DTYPE_TYPES[dtype])


def placeholder_vocab(n: int) -> dict:
    """GGUF tokenizer fields of a placeholder byte-level BPE vocabulary of ``n`` tokens: the 256 GPT-2 byte symbols,
    one merge (llama.cpp refuses a BPE vocabulary without merges) and ``<tokN>`` placeholders. llama.cpp's loader
    needs a vocabulary; token ids are fed directly, so it never tokenises."""
    import gguf

    if n < 257:
        raise ValueError(f"a byte-level vocabulary needs > 256 tokens, the model has {n}")
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:] + [256 + k for k in range(256 - len(bs))]        # GPT-2's bytes_to_unicode: every byte printable
    toks = [chr(c) for c in cs] + ["ab"] + [f"<tok{i}>" for i in range(257, n)]     # "ab": the one merge's product
    A, S, I32, U32 = (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.INT32,
                      gguf.GGUFValueType.UINT32)
    return {"tokenizer.ggml.model": ("gpt2", [S]), "tokenizer.ggml.pre": ("default", [S]),
            "tokenizer.ggml.tokens": (toks, [A, S]), "tokenizer.ggml.token_type": ([1] * n, [A, I32]),
            "tokenizer.ggml.merges": (["a b"], [A, S]), "tokenizer.ggml.bos_token_id": (0, [U32]),
            "tokenizer.ggml.eos_token_id": (0, [U32])}


def write_hf_gguf(model, path: str | Path, qtype: str = "F32", name: str = "lowrank_lib export",
                  tokenizer_fields: dict | None = None, progress: bool = False) -> Path:
    """Write an HF ``LlamaForCausalLM`` as a llama GGUF: ``qtype`` (a GGML type name: ``F32``, ``BF16``, ``Q8_0``,
    ``Q4_1``, ...) for the 2-D weights, ``tokenizer_fields`` (``{key: (value, [GGUFValueType, ...])}``, default
    :func:`placeholder_vocab`)."""
    import gguf

    c, g = model.config, geometry(model.config)
    rope = getattr(c, "rope_parameters", None) or {}                      # transformers >= 5 moved rope_theta here
    theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    U32, F32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
    fields = {"general.name": (name, [STR]), "llama.block_count": (g.n_layers, [U32]),
              "llama.context_length": (int(c.max_position_embeddings), [U32]),
              "llama.embedding_length": (int(c.hidden_size), [U32]),
              "llama.feed_forward_length": (int(c.intermediate_size), [U32]),
              "llama.attention.head_count": (g.n_heads, [U32]), "llama.attention.head_count_kv": (g.n_kv_heads, [U32]),
              "llama.rope.freq_base": (theta, [F32]),
              "llama.attention.layer_norm_rms_epsilon": (float(c.rms_norm_eps), [F32]),
              "llama.vocab_size": (int(c.vocab_size), [U32]), "llama.rope.dimension_count": (g.head_dim, [U32]),
              **(tokenizer_fields if tokenizer_fields is not None else placeholder_vocab(int(c.vocab_size)))}
    sd = model.state_dict()

    def get(hf_name, gname):
        a = sd[hf_name].detach().cpu()
        a = a if a.dtype == torch.bfloat16 else a.float()
        heads = _qk_heads(gname, g.n_heads, g.n_kv_heads)
        return permute_qk(a, heads) if heads else a

    tensors = []
    for hf_name, gname in hf_to_gguf_names(g.n_layers).items():
        if hf_name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if hf_name not in sd:
            raise GGUFExportError(f"model has no parameter {hf_name} (expected a LlamaForCausalLM)")
        tensors.append((gname, tuple(sd[hf_name].shape), lambda h=hf_name, n=gname: get(h, n)))
    return _write(Path(path), "llama", fields, tensors, qtype, progress)


def verify_gguf(path: str | Path, state_dict: dict[str, torch.Tensor], dtype: str = "fp32") -> dict:
    """Check that a GGUF holds ``state_dict`` (HF names) at ``dtype``, tensor by tensor: fp32 bit-equal; bf16: 2-D
    weights equal torch's round-to-nearest bf16 of the fp32 tensor, 1-D tensors bit-equal in fp32. Raises
    :class:`GGUFExportError` naming the first tensor that differs; returns a summary otherwise."""
    seen, n_el = set(), 0
    for k, got in iter_gguf_state(path):
        seen.add(k)
        if k not in state_dict:
            raise GGUFExportError(f"{path}: tensors missing [], unexpected [{k!r}]")
        want = state_dict[k].detach().float().cpu()
        if tuple(got.shape) != tuple(want.shape):
            raise GGUFExportError(f"{path}: {k} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if dtype == "bf16" and got.dim() == 2:
            want = want.to(torch.bfloat16).float()
        if not torch.equal(got.view(torch.int32), want.contiguous().view(torch.int32)):
            raise GGUFExportError(f"{path}: tensor {k} differs from the reference ({dtype}); max |diff| "
                                  f"{float((got - want).abs().max()):.3g}")
        n_el += got.numel()
    missing = sorted(k for k in set(state_dict) - seen if k != "lm_head.weight")      # a tied head is not stored
    if missing:
        raise GGUFExportError(f"{path}: tensors missing {missing[:5]}, unexpected []")
    return {"tensors": len(seen), "elements": n_el, "exact": True, "dtype": dtype}


def decode_bytes_per_token(path) -> int:
    """Bytes of the tensors one llama.cpp decode step reads: every tensor of the file but the input embedding when a
    separate ``output.weight`` exists (one row is read); a tied head's table counts in full."""
    r, _ = _open(path)
    names = {t.name for t in r.tensors}
    return sum(int(t.n_bytes) for t in r.tensors if not (t.name == "token_embd.weight" and "output.weight" in names))
