"""Checkpoints as each family's ORIGINAL code saved them under the transformers it pins, made without it.

transformers 4.x is not installed here (we run 5.x), and neither is any family's code. So each file
is rebuilt from what those versions put on disk:

* **whole-model pickles** (SVD-LLM, transformers 4.35.2; Dobi-SVD no-remap, 4.37.2): a tree of
  stand-in ``nn.Module`` subclasses whose ``__module__`` / ``__qualname__`` are the 4.x class
  paths (``transformers.models.llama.modeling_llama.LlamaSdpaAttention``,
  ``component.svd_llama.SVD_LlamaAttention``, ...). Each stand-in holds exactly the attributes,
  submodules, parameters and buffers that class's 4.x ``__init__`` created (listed at each builder
  below), with the weights of a known compressed tiny model. :func:`impersonating` installs the
  stand-ins at those paths for the duration of ``torch.save`` (replacing a transformers 5 class of
  the same path, or creating the missing module), so the pickle's GLOBAL opcodes record the 4.x
  paths exactly as ``torch.save({'model': model, 'tokenizer': tok})`` did. Real ``torch.nn``
  classes, real ``tokenizers`` objects (``Tokenizer``, ``AddedToken``) and plain containers are
  pickled as themselves.
* buffers as the era had them: SVD-LLM's own rotary module (``inv_freq`` persistent,
  ``cos_cached`` / ``sin_cached`` ``[1, 1, L, d]`` fp32); 4.37's per-attention rotary
  (``inv_freq`` fp32, ``cos_cached`` / ``sin_cached`` ``[L, d]`` in the load dtype, fp16); 4.38's
  ``LlamaModel.causal_mask`` (bool ``[L, L]``) and ``_cos_cached`` / ``_sin_cached``; 4.45's
  model-level ``rotary_emb`` (``inv_freq`` buffer, ``original_inv_freq`` plain attribute) next to
  the deprecated per-layer one;
* dtypes and devices as saved: fp16 embeddings / norms / lm_head (fp32 SVD-LLM factors), storages
  tagged ``cuda:0`` where the family saved from a GPU (``torch.serialization.location_tag`` is
  patched during the save, so the tag is right for every pickle protocol), pickle protocols 2 to 5;
* **HF folders** (ASVD 4.41, Palu 4.37.2, Basis Sharing 4.45.1, Dobi remap 4.37.2): the tensors our
  writers produce, with ``config.json`` rewritten as those versions serialised it (``rope_theta`` /
  ``rope_scaling`` instead of 5.x ``rope_parameters``, ``torch_dtype``, ``transformers_version``,
  4.45's ``head_dim``), and optionally the pre-1.6 (non-zip) ``torch.save`` container.

Every builder returns the path and the reference model (the same weights, rounded as the family
stores them) whose logits the loaded checkpoint must reproduce.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from lowrank_lib.factorized import LowRankLinear
from lowrank_lib.formats.common import fake_class, registered

# --------------------------------------------------------------------------- stand-in classes
_CLASSES: dict[str, type] = {}


def standin(path: str, base: type = nn.Module) -> type:
    """A class whose pickled GLOBAL reads ``path`` (once installed by :func:`impersonating`)."""
    if path not in _CLASSES:
        _CLASSES[path] = fake_class(path, base)
    return _CLASSES[path]


class _Plain:
    """Base of non-module stand-ins (configs, tokenizers): pickled by ``__dict__``, as 4.x did."""


def impersonating(classes):
    """Install ``classes`` at their ``__module__`` paths (shadowing transformers 5 classes) during a save."""
    return registered(classes, shadow=True)


def new(path: str, _base: type = nn.Module, **attrs):
    """An instance of the stand-in ``path``: ``nn.Module.__init__`` state, then ``attrs`` set in order."""
    cls = standin(path, _base)
    obj = cls.__new__(cls)
    if _base is nn.Module:
        nn.Module.__init__(obj)
    for k, v in attrs.items():
        setattr(obj, k, v)
    return obj


def buffers(mod: nn.Module, persistent: bool = True, **bufs) -> nn.Module:
    for k, v in bufs.items():
        mod.register_buffer(k, v, persistent=persistent)
    return mod


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None, stale: tuple[int, int] | None = None) -> nn.Linear:
    """A real ``torch.nn.Linear`` holding ``weight``; ``stale`` = (out, in) features left as the original
    code built the layer before swapping ``.weight.data`` (SVD-LLM does)."""
    lin = nn.Linear(1, 1, bias=bias is not None)
    lin.in_features, lin.out_features = (stale[1], stale[0]) if stale else (weight.shape[1], weight.shape[0])
    lin.weight = nn.Parameter(weight.detach().clone(), requires_grad=True)
    if bias is not None:
        lin.bias = nn.Parameter(bias.detach().clone())
    return lin


LLAMA = "transformers.models.llama.modeling_llama"


# --------------------------------------------------------------------------- configs, as 4.x serialised them
def config_4x(cfg, version: str, **extra) -> dict:
    """The plain ``LlamaConfig.__dict__`` / ``config.json`` of transformers ``version`` for a 5.x config."""
    d = {
        "vocab_size": cfg.vocab_size, "max_position_embeddings": cfg.max_position_embeddings,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads, "hidden_act": cfg.hidden_act,
        "initializer_range": 0.02, "rms_norm_eps": cfg.rms_norm_eps, "pretraining_tp": 1, "use_cache": True,
        "rope_theta": float(cfg.rope_parameters["rope_theta"]), "rope_scaling": None, "attention_bias": False,
        "return_dict": True, "output_hidden_states": False, "output_attentions": False, "torchscript": False,
        "torch_dtype": "float16", "use_bfloat16": False, "tie_word_embeddings": cfg.tie_word_embeddings,
        "architectures": ["LlamaForCausalLM"], "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
        "id2label": {0: "LABEL_0", 1: "LABEL_1"}, "label2id": {"LABEL_0": 0, "LABEL_1": 1},
        "_name_or_path": "meta-llama/Llama-2-7b-hf", "transformers_version": version, "model_type": "llama",
    }
    if version >= "4.38":
        d["attention_dropout"] = 0.0
    if version >= "4.41":
        d["mlp_bias"] = False
    if version >= "4.45":
        d["head_dim"] = cfg.hidden_size // cfg.num_attention_heads
    d.update(extra)
    return d


def config_object(cfg, version: str):
    """A pickled ``LlamaConfig`` of that version (its ``__dict__``; ``model_type`` is a class attribute)."""
    d = config_4x(cfg, version)
    d.pop("model_type")
    d["torch_dtype"] = torch.float16
    obj = new(f"{LLAMA.replace('modeling', 'configuration')}.LlamaConfig", _Plain)
    obj.__dict__.update(d)
    return obj


def generation_config(version: str):
    g = new("transformers.generation.configuration_utils.GenerationConfig", _Plain)
    g.__dict__.update({"max_length": 20, "do_sample": False, "num_beams": 1, "temperature": 1.0, "top_k": 50,
                       "top_p": 1.0, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": None,
                       "_from_model_config": True, "transformers_version": version, "_commit_hash": None})
    return g


# --------------------------------------------------------------------------- tokenizers, as pickled
def slow_llama_tokenizer():
    """transformers 4.35 ``LlamaTokenizer`` state (``__getstate__``: ``sp_model`` None, proto bytes kept)."""
    from tokenizers import AddedToken

    trie = new("transformers.tokenization_utils.Trie", _Plain)
    trie.__dict__.update({"data": {}, "_tokens": set(), "_termination_char": ""})
    tok = new("transformers.models.llama.tokenization_llama.LlamaTokenizer", _Plain)
    tok.__dict__.update({
        "init_kwargs": {"add_bos_token": True, "add_eos_token": False, "clean_up_tokenization_spaces": False,
                        "legacy": True, "model_max_length": 1000000000000000019884624838656,
                        "sp_model_kwargs": {}, "vocab_file": "/hf/tokenizer.model"},
        "name_or_path": "meta-llama/Llama-2-7b-hf", "_processor_class": None, "model_max_length": 10 ** 30,
        "padding_side": "left", "truncation_side": "right", "model_input_names": ["input_ids", "attention_mask"],
        "clean_up_tokenization_spaces": False, "split_special_tokens": False, "deprecation_warnings": {},
        "_in_target_context_manager": False,
        "_added_tokens_decoder": {0: AddedToken("<unk>", special=True), 1: AddedToken("<s>", special=True),
                                  2: AddedToken("</s>", special=True)},
        "_added_tokens_encoder": {"<unk>": 0, "<s>": 1, "</s>": 2}, "tokens_trie": trie,
        "_decode_use_source_tokenizer": False, "vocab_file": "/hf/tokenizer.model", "add_bos_token": True,
        "add_eos_token": False, "legacy": True, "sp_model_kwargs": {}, "sp_model": None,
        "sp_model_proto": bytes(range(256)) * 4,        # the serialized SentencePiece model (opaque bytes)
    })
    return tok


def fast_llama_tokenizer():
    """transformers 4.37 ``LlamaTokenizerFast``: its ``__dict__`` around a real ``tokenizers.Tokenizer``."""
    from tokenizers import AddedToken, Tokenizer
    from tokenizers.models import WordLevel

    backend = Tokenizer(WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2, "a": 3}, unk_token="<unk>"))
    backend.add_special_tokens([AddedToken("<s>", special=True), AddedToken("</s>", special=True)])
    tok = new("transformers.models.llama.tokenization_llama_fast.LlamaTokenizerFast", _Plain)
    tok.__dict__.update({
        "_tokenizer": backend, "_decode_use_source_tokenizer": False,
        "init_kwargs": {"add_bos_token": True, "add_eos_token": False, "legacy": False,
                        "bos_token": AddedToken("<s>", special=True)},
        "name_or_path": "meta-llama/Llama-2-7b-hf", "model_max_length": 10 ** 30, "padding_side": "left",
        "split_special_tokens": False, "deprecation_warnings": {}, "_in_target_context_manager": False,
        "vocab_file": None, "add_bos_token": True, "add_eos_token": False, "use_default_system_prompt": False,
        "legacy": False,
    })
    return tok


# --------------------------------------------------------------------------- 4.x Llama model skeleton
def rope_tables(inv_freq: torch.Tensor, length: int, dtype=torch.float32):
    t = torch.arange(length, dtype=inv_freq.dtype)
    freqs = torch.einsum("i,j->ij", t, inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def inv_freq_of(cfg) -> torch.Tensor:
    d = cfg.hidden_size // cfg.num_attention_heads
    return 1.0 / (float(cfg.rope_parameters["rope_theta"]) ** (torch.arange(0, d, 2).float() / d))


def rms_norm(weight, eps, path=f"{LLAMA}.LlamaRMSNorm"):
    return new(path, weight=nn.Parameter(weight.detach().clone()), variance_epsilon=eps)


def hf_rotary_4x(cfg, version: str, dtype):
    """transformers 4.37 / 4.38 ``LlamaRotaryEmbedding`` (per attention module)."""
    d = cfg.hidden_size // cfg.num_attention_heads
    inv = inv_freq_of(cfg)
    rot = new(f"{LLAMA}.LlamaRotaryEmbedding", dim=d, max_position_embeddings=cfg.max_position_embeddings,
              base=float(cfg.rope_parameters["rope_theta"]))
    buffers(rot, persistent=False, inv_freq=inv)
    rot.max_seq_len_cached = cfg.max_position_embeddings
    cos, sin = rope_tables(inv, cfg.max_position_embeddings, dtype)
    if version.startswith("4.38"):
        buffers(rot, persistent=False, _cos_cached=cos, _sin_cached=sin)
    elif version < "4.40":
        buffers(rot, persistent=False, cos_cached=cos, sin_cached=sin)
    return rot


def hf_rotary_445(cfg):
    """transformers 4.45 ``LlamaRotaryEmbedding(config=...)``: inv_freq buffer + plain original_inv_freq."""
    inv = inv_freq_of(cfg)
    rot = new(f"{LLAMA}.LlamaRotaryEmbedding", rope_kwargs={}, rope_type="default",
              max_seq_len_cached=cfg.max_position_embeddings, original_max_seq_len=cfg.max_position_embeddings,
              config=None)
    buffers(rot, persistent=False, inv_freq=inv)
    rot.__dict__["original_inv_freq"] = inv.clone()      # an attribute, not a buffer, in 4.45
    rot.attention_scaling = 1.0
    return rot


def llama_skeleton(cm, version: str, layers: list, dense_dtype=torch.float16):
    """``LlamaForCausalLM`` of ``version`` around ``layers`` (already-built decoder layers)."""
    cfg = cm.config
    config = config_object(cfg, version)
    inner = new(f"{LLAMA}.LlamaModel", config=config, padding_idx=None, vocab_size=cfg.vocab_size)
    inner.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    inner.embed_tokens.weight = nn.Parameter(cm.model.embed_tokens.weight.detach().to(dense_dtype).clone())
    inner.layers = nn.ModuleList(layers)
    inner.norm = rms_norm(cm.model.norm.weight.to(dense_dtype), cfg.rms_norm_eps)
    inner.gradient_checkpointing = False
    if version.startswith("4.38"):
        L = cfg.max_position_embeddings
        buffers(inner, persistent=False, causal_mask=torch.full((L, L), True, dtype=torch.bool).triu(1))
    if version >= "4.45":
        inner.rotary_emb = hf_rotary_445(cfg)
    top = new(f"{LLAMA}.LlamaForCausalLM", config=config, model=inner, vocab_size=cfg.vocab_size,
              name_or_path="meta-llama/Llama-2-7b-hf", warnings_issued={}, generation_config=generation_config(version))
    if cfg.tie_word_embeddings:
        top.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        top.lm_head.weight = inner.embed_tokens.weight
    else:
        top.lm_head = linear(cm.lm_head.weight.to(dense_dtype))
    return top


def decoder_layer(cm, i: int, attn, mlp, dense_dtype=torch.float16):
    layer = cm.model.layers[i]
    dl = new(f"{LLAMA}.LlamaDecoderLayer", hidden_size=cm.config.hidden_size)
    dl.self_attn = attn
    dl.mlp = mlp
    dl.input_layernorm = rms_norm(layer.input_layernorm.weight.to(dense_dtype), cm.config.rms_norm_eps)
    dl.post_attention_layernorm = rms_norm(layer.post_attention_layernorm.weight.to(dense_dtype),
                                           cm.config.rms_norm_eps)
    return dl


def _save(obj, path: Path, protocol: int, location: str, zipfile_format: bool = True) -> None:
    classes = list(_CLASSES.values())
    tag = mock.patch.object(torch.serialization, "location_tag", lambda storage: location)
    import warnings

    with impersonating(classes), tag, warnings.catch_warnings():
        warnings.simplefilter("ignore")        # the pre-1.6 container looks for the stand-ins' source code
        torch.save(obj, path, pickle_protocol=protocol, _use_new_zipfile_serialization=zipfile_format)


def rounded(cm, keep_factors_fp32: bool):
    """The in-memory model with the rounding the file applies: fp16 everywhere, or fp16 outside the factors."""
    ref = copy.deepcopy(cm)
    factor_ids = {id(p) for m in ref.modules() if isinstance(m, LowRankLinear) for p in (m.U, m.V)}
    with torch.no_grad():
        for p in ref.parameters():
            if not (keep_factors_fp32 and id(p) in factor_ids):
                p.copy_(p.half().float())
    return ref


def stored_as(cm, fam: str):
    """``cm`` rounded as family ``fam``'s files store it (Dobi: fp16; SVD-LLM: fp16 outside the factors)."""
    if fam in ("dobi", "dobi-remap"):
        return rounded(cm, keep_factors_fp32=False)
    if fam == "svdllm":
        return rounded(cm, keep_factors_fp32=True)
    return cm


# --------------------------------------------------------------------------- SVD-LLM (transformers 4.35.2)
def svdllm_pickle(cm, folder: Path, version: str = "4.35.2", protocol: int = 2, location: str = "cpu",
                  zipfile_format: bool = True, tokenizer: str = "slow", keep: float = 0.6,
                  variant: str = "whitening_only") -> tuple[Path, nn.Module]:
    """SVD-LLM's ``torch.save({'model': model, 'tokenizer': tokenizer}, <model>_whitening_only_<keep>.pt)``.

    Per layer (component/svd_llama.py): ``self_attn`` = ``SVD_LlamaAttention`` {config, hidden_size,
    num_heads, head_dim, max_position_embeddings, ratio, {q,k,v,o}_{u,v}_proj (nn.Linear, fp32,
    stale in/out features), rotary_emb = component ``LlamaRotaryEmbedding`` (inv_freq persistent,
    cos_cached / sin_cached [1, 1, L, d] fp32, max_seq_len_cached)}; ``mlp`` = ``SVD_LlamaMLP``
    {ratio, {gate,down,up}_{u,v}_proj, act_fn = transformers.activations.SiLUActivation}; the rest is
    the fp16 4.x Llama (``model.seqlen = 2048`` set on top).
    """
    cfg = cm.config
    d = cfg.hidden_size // cfg.num_attention_heads
    layers = []
    for i, layer in enumerate(cm.model.layers):
        at = new("component.svd_llama.SVD_LlamaAttention", config=None, hidden_size=cfg.hidden_size,
                 num_heads=cfg.num_attention_heads, head_dim=d, max_position_embeddings=cfg.max_position_embeddings,
                 ratio=keep)
        for p in ("q", "k", "v", "o"):
            f = getattr(layer.self_attn, f"{p}_proj")
            setattr(at, f"{p}_u_proj", linear(f.U.float(), stale=(f.U.shape[0], int(cfg.hidden_size * keep / 2))))
            setattr(at, f"{p}_v_proj", linear(f.V.float(), stale=(int(cfg.hidden_size * keep / 2), f.V.shape[1])))
        rot = new("component.svd_llama.LlamaRotaryEmbedding", max_seq_len_cached=cfg.max_position_embeddings)
        inv = inv_freq_of(cfg)
        buffers(rot, persistent=True, inv_freq=inv)
        cos, sin = rope_tables(inv, cfg.max_position_embeddings)
        buffers(rot, persistent=False, cos_cached=cos[None, None], sin_cached=sin[None, None])
        at.rotary_emb = rot
        mlp = new("component.svd_llama.SVD_LlamaMLP", ratio=[keep] * 3)
        for p in ("gate", "down", "up"):
            f = getattr(layer.mlp, f"{p}_proj")
            setattr(mlp, f"{p}_u_proj", linear(f.U.float()))
            setattr(mlp, f"{p}_v_proj", linear(f.V.float()))
        mlp.act_fn = new("transformers.activations.SiLUActivation")
        layers.append(decoder_layer(cm, i, at, mlp))
    model = llama_skeleton(cm, version, layers)
    for layer in model.model.layers:
        layer.self_attn.config = model.config          # the same config object, as in the original
    model.seqlen = 2048
    tok = slow_llama_tokenizer() if tokenizer == "slow" else fast_llama_tokenizer()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"jeffwan_llama_7b_hf_{variant}_{keep}.pt"      # v2 runners write ..._v2_<keep>.pt
    _save({"model": model, "tokenizer": tok}, path, protocol, location, zipfile_format)
    return path, rounded(cm, keep_factors_fp32=True)


# --------------------------------------------------------------------------- Dobi-SVD (transformers 4.37.2)
def dobi_pickle(cm, folder: Path, version: str = "4.37.2", protocol: int = 2, location: str = "cuda:0",
                zipfile_format: bool = True) -> tuple[Path, nn.Module]:
    """Dobi-SVD's ``DobiSVD_Noremapping-<model>-<ratio>/DobiSVD_Model.pt``, saved from the GPU.

    The 4.37 model loaded in fp16 keeps its modules; every projection is replaced in place by
    ``modules.module.SVDTransformLayer`` {name, ALinear [r, in], BLinear [out, r]} (fp16).
    ``self_attn`` = 4.37 ``LlamaSdpaAttention`` {config, layer_idx, attention_dropout, hidden_size,
    num_heads, head_dim, num_key_value_heads, num_key_value_groups, max_position_embeddings,
    rope_theta, is_causal, rotary_emb (4.37 LlamaRotaryEmbedding: dim, max_position_embeddings, base,
    inv_freq fp32, cos_cached / sin_cached [L, d] fp16)}; ``mlp`` = ``LlamaMLP`` {config, hidden_size,
    intermediate_size, act_fn = torch.nn.SiLU}; the tokenizer is 4.37 ``LlamaTokenizerFast``.
    """
    cfg = cm.config
    d = cfg.hidden_size // cfg.num_attention_heads

    def svdt(name, f):
        return new("modules.module.SVDTransformLayer", name=name, ALinear=linear(f.V.half()),
                   BLinear=linear(f.U.half()))

    layers = []
    for i, layer in enumerate(cm.model.layers):
        pre = f"model.layers.{i}"
        at = new(f"{LLAMA}.LlamaSdpaAttention", config=None, layer_idx=i, attention_dropout=0.0,
                 hidden_size=cfg.hidden_size, num_heads=cfg.num_attention_heads, head_dim=d,
                 num_key_value_heads=cfg.num_key_value_heads,
                 num_key_value_groups=cfg.num_attention_heads // cfg.num_key_value_heads,
                 max_position_embeddings=cfg.max_position_embeddings, rope_theta=cfg.rope_parameters["rope_theta"],
                 is_causal=True)
        for p in ("q", "k", "v", "o"):
            setattr(at, f"{p}_proj", svdt(f"{pre}.self_attn.{p}_proj", getattr(layer.self_attn, f"{p}_proj")))
        at.rotary_emb = hf_rotary_4x(cfg, version, torch.float16)
        mlp = new(f"{LLAMA}.LlamaMLP", config=None, hidden_size=cfg.hidden_size,
                  intermediate_size=cfg.intermediate_size)
        for p in ("gate", "up", "down"):
            setattr(mlp, f"{p}_proj", svdt(f"{pre}.mlp.{p}_proj", getattr(layer.mlp, f"{p}_proj")))
        mlp.act_fn = nn.SiLU()
        layers.append(decoder_layer(cm, i, at, mlp))
    model = llama_skeleton(cm, version, layers)
    for layer in model.model.layers:
        layer.self_attn.config = layer.mlp.config = model.config
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "DobiSVD_Model.pt"
    _save({"model": model, "tokenizer": fast_llama_tokenizer()}, path, protocol, location, zipfile_format)
    return path, rounded(cm, keep_factors_fp32=False)


# --------------------------------------------------------------------------- HF folders, 4.x config.json
def rewrite_config_4x(folder: Path, version: str, **extra) -> None:
    """Replace a folder's 5.x ``config.json`` by what ``version`` wrote, keeping the family's own fields."""
    from transformers import LlamaConfig

    p = folder / "config.json"
    cur = json.loads(p.read_text())
    base = {k: v for k, v in cur.items() if k in LlamaConfig().to_dict() or k in ("architectures",)}
    family_fields = {k: v for k, v in cur.items() if k not in base and k not in ("rope_parameters", "dtype")}
    cfg = LlamaConfig(**{k: v for k, v in cur.items() if k in LlamaConfig().to_dict()})
    d = config_4x(cfg, version, **extra)
    d.update(family_fields)
    if "architectures" in cur:
        d["architectures"] = cur["architectures"]
    if "model_type" in cur:
        d["model_type"] = cur["model_type"]
    p.write_text(json.dumps(d, indent=2))


def resave_legacy_container(path: Path, location: str = "cpu") -> None:
    """Re-save a tensors-only ``torch.save`` file in the pre-1.6 container (``_use_new_zipfile_serialization=False``)."""
    obj = torch.load(path, weights_only=True, map_location="cpu")
    tag = mock.patch.object(torch.serialization, "location_tag", lambda storage: location)
    with tag:
        torch.save(obj, path, _use_new_zipfile_serialization=False)


__all__ = ["dobi_pickle", "impersonating", "resave_legacy_container", "rewrite_config_4x", "rounded", "standin",
           "stored_as", "svdllm_pickle"]
