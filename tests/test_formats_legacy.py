"""Checkpoints as the families' own code saved them (transformers 4.35-4.45), each loading to the reference logits.

How the fixtures are made is documented in ``tests/legacy_checkpoints.py``: stand-in classes at the
4.x class paths with the attributes and buffers those versions created, pickled by ``torch.save``
with protocols 2 to 5, fp16 storages, ``cuda:0`` tags where the family saved from a GPU, the
pre-1.6 container for some, and ``config.json`` files as 4.x serialised them.
"""
from __future__ import annotations

import json
import pickle

import pytest
import torch
from legacy_checkpoints import dobi_pickle, resave_legacy_container, rewrite_config_4x, stored_as, svdllm_pickle

from lowrank_lib import detect_format, families, load_checkpoint, models
from lowrank_lib.compress import collect_stats
from lowrank_lib.data import random_token_batches
from lowrank_lib.formats import write_native
from lowrank_lib.formats.safe_pickle import pickle_globals
from lowrank_lib.formats.torchfile import container_kind

X = random_token_batches(256, 2, 24, seed=3)
#: torch.load(weights_only=True) warns about protocols > 2 before refusing the 4.x classes
pytestmark = pytest.mark.filterwarnings("ignore:Detected pickle protocol")


@pytest.fixture(scope="module")
def compressed():
    """A calibrated SVD-LLM model (MHA, as SVD-LLM's Llama class assumes) and a Dobi model (GQA)."""
    mha, gqa = models.tiny_model("tiny-mha", seed=0), models.tiny_model("tiny-gqa", seed=0)
    s_mha = collect_stats(mha, random_token_batches(256, 4, 32, seed=1), progress=False)
    s_gqa = collect_stats(gqa, random_token_batches(256, 4, 32, seed=1), progress=False)
    return {"svdllm": families.get("svdllm").compress(mha, s_mha, 0.6, progress=False),
            "dobi": families.get("dobi").compress(gqa, s_gqa, 0.6, progress=False),
            "gqa": gqa, "stats": s_gqa}


@torch.no_grad()
def rel(model, ref) -> float:
    a, b = model(X).logits, ref(X).logits
    return float((a - b).norm() / b.norm())


@pytest.mark.parametrize("version,protocol,location,tokenizer", [
    ("4.35.2", 2, "cpu", "slow"), ("4.35.2", 3, "cuda:0", "slow"), ("4.35.2", 4, "cpu", "fast"),
    ("4.35.2", 5, "cuda:0", "slow"), ("4.38.2", 2, "cuda:0", "fast"), ("4.38.2", 4, "cpu", "slow"),
    ("4.45.1", 2, "cpu", "fast"), ("4.45.1", 5, "cuda:0", "slow"),
])
def test_svdllm_whole_model_pickles(compressed, tmp_path, version, protocol, location, tokenizer):
    p, ref = svdllm_pickle(compressed["svdllm"], tmp_path, version=version, protocol=protocol, location=location,
                           tokenizer=tokenizer)
    g = pickle_globals(p)
    assert {"component.svd_llama.SVD_LlamaAttention", "component.svd_llama.LlamaRotaryEmbedding",
            "transformers.activations.SiLUActivation", "transformers.models.llama.modeling_llama.LlamaDecoderLayer",
            "torch.HalfStorage", "torch.FloatStorage"} <= g
    assert ("transformers.models.llama.tokenization_llama.LlamaTokenizer" in g) == (tokenizer == "slow")
    with pytest.raises(pickle.UnpicklingError):              # the file really needs the 4.x classes
        torch.load(p, weights_only=True, map_location="cpu")
    assert detect_format(p) == "svdllm"
    r = load_checkpoint(p, dtype=torch.float32)
    assert rel(r, ref) < 1e-6
    dropped = r.lowrank_meta["derived_buffers_dropped"]
    assert "model.layers.1.self_attn.rotary_emb.cos_cached" in dropped
    assert ("model.causal_mask" in dropped) == version.startswith("4.38")
    assert ("model.rotary_emb.inv_freq" in dropped) == (version >= "4.45")
    assert r.lowrank_meta["keep"] == 0.6 and r.lowrank_meta["ranks"] == compressed["svdllm"].lowrank_meta["ranks"]


def test_svdllm_v2_heterogeneous_ranks(tmp_path):
    """SVD-LLM v2 stores the same modules with per-matrix ranks (stale in/out features everywhere)."""
    mha = models.tiny_model("tiny-mha", seed=0)
    stats = collect_stats(mha, random_token_batches(256, 4, 32, seed=1), progress=False)
    cm = families.get("svdllm_v2").compress(mha, stats, 0.6, progress=False)
    assert len(set(cm.lowrank_meta["ranks"].values())) > 2
    p, ref = svdllm_pickle(cm, tmp_path, protocol=2, location="cuda:0", variant="v2")
    r = load_checkpoint(p, dtype=torch.float32)
    assert rel(r, ref) < 1e-6
    assert r.lowrank_meta["variant"] == "v2" and r.lowrank_meta["ranks"] == cm.lowrank_meta["ranks"]


def test_svdllm_in_the_pre_1_6_container(compressed, tmp_path):
    p, ref = svdllm_pickle(compressed["svdllm"], tmp_path, protocol=2, location="cuda:0", zipfile_format=False)
    assert container_kind(p) == "legacy"
    assert detect_format(p) == "svdllm"
    assert rel(load_checkpoint(p, dtype=torch.float32), ref) < 1e-6


@pytest.mark.parametrize("version,protocol", [("4.37.2", 2), ("4.37.2", 4), ("4.38.2", 5)])
def test_dobi_whole_model_pickles_saved_from_a_gpu(compressed, tmp_path, version, protocol):
    folder = tmp_path / "DobiSVD_Noremapping-Llama-2-7b-hf-0.6"
    p, ref = dobi_pickle(compressed["dobi"], folder, version=version, protocol=protocol)
    g = pickle_globals(p)
    assert {"modules.module.SVDTransformLayer", "transformers.models.llama.modeling_llama.LlamaSdpaAttention",
            "transformers.models.llama.tokenization_llama_fast.LlamaTokenizerFast", "tokenizers.Tokenizer",
            "torch.nn.modules.activation.SiLU", "torch.HalfStorage"} <= g
    with pytest.raises(RuntimeError, match="CUDA"):          # as the original: cuda:0 storages, no map_location
        torch.load(p, weights_only=False)
    assert detect_format(folder) == "dobi"
    r = load_checkpoint(folder, dtype=torch.float32)
    assert rel(r, ref) < 1e-6
    assert r.lowrank_meta["keep"] == 0.6
    assert any(k.endswith(("cos_cached", "_cos_cached")) for k in r.lowrank_meta["derived_buffers_dropped"])


@pytest.mark.parametrize("fam,version,legacy_container", [
    ("asvd", "4.41.2", False), ("palu", "4.37.2", False), ("basis_sharing", "4.45.1", False),
    ("basis_sharing", "4.45.1", True), ("dobi-remap", "4.37.2", False), ("dobi-remap", "4.37.2", True),
])
def test_hf_folders_with_4x_configs(compressed, tmp_path, fam, version, legacy_container):
    """ASVD (4.41), Palu (4.37), Basis Sharing (4.45) and Dobi remap (4.37) folders as those versions wrote them."""
    gqa, stats = compressed["gqa"], compressed["stats"]
    kw = {"align": 4} if fam == "palu" else {}
    cm = families.get(fam).compress(gqa, stats, 0.6, progress=False, **kw)
    d = write_native(cm, fam, tmp_path / f"{fam}_ckpt")
    rewrite_config_4x(d, version)
    cfg = json.loads((d / "config.json").read_text())
    assert "rope_parameters" not in cfg and cfg["rope_theta"] == 10000.0 and cfg["transformers_version"] == version
    if legacy_container:
        for name in ("pytorch_model.bin", "remapping_weight.pt"):
            if (d / name).exists():
                resave_legacy_container(d / name, location="cuda:0")
                assert container_kind(d / name) == "legacy"
    assert detect_format(d) == fam
    assert rel(load_checkpoint(d, dtype=torch.float32), stored_as(cm, fam)) < 1e-5
