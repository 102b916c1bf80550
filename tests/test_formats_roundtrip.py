"""Every family: compress -> write native -> detect -> read -> same logits as the in-memory model."""
from __future__ import annotations

import sys

import pytest
import torch

from lowrank_lib import account, detect_format, families, load_checkpoint, models, save_checkpoint
from lowrank_lib.compress import COMPRESSORS, collect_stats
from lowrank_lib.data import random_token_batches
from lowrank_lib.formats import write_native
from lowrank_lib.formats.safe_pickle import pickle_globals

NATIVE = {f.name: f.format for f in families.methods() if f.needs_stats}   # method -> the format it is written in
X = random_token_batches(256, 2, 24, seed=3)


@pytest.fixture(scope="module", params=["tiny-mha", "tiny-gqa"])
def calibrated(request):
    m = models.tiny_model(request.param, seed=0)
    return m, collect_stats(m, random_token_batches(256, 6, 48, seed=1), progress=False)


def _compress(m, stats, fam, keep=0.6):
    kw = {"align": 4, "head_group_size": 1} if fam == "palu" else {}
    return COMPRESSORS[fam](m, stats, keep, progress=False, **kw)


def _as_stored(cm, fam):
    """The in-memory model with the dtype rounding the family's files apply (fp16 where it stores fp16)."""
    from legacy_checkpoints import stored_as

    return stored_as(cm, fam)


@torch.no_grad()
def _rel(a, b):
    return float((a(X).logits - b(X).logits).norm() / b(X).logits.norm())


@pytest.mark.parametrize("fam", list(NATIVE))
def test_native_round_trip(calibrated, fam, tmp_path):
    m, stats = calibrated
    cm = _compress(m, stats, fam)
    nat = NATIVE[fam]
    p = write_native(cm, nat, tmp_path / "ckpt")
    assert detect_format(p) == nat
    r = load_checkpoint(p, dtype=torch.float32)
    assert _rel(r, _as_stored(cm, nat)) < 1e-5
    assert r.lowrank_meta["family"] == nat and r.lowrank_meta["ranks"] == cm.lowrank_meta["ranks"]
    a, b = account(r), account(cm)
    assert (a.linear_params, a.shared_params_saved) == (b.linear_params, b.shared_params_saved)
    # reading back and writing again is stable (native -> one representation -> native)
    r2 = load_checkpoint(write_native(r, nat, tmp_path / "again"), dtype=torch.float32)
    assert _rel(r2, r) < 1e-6


def test_writers_leave_no_fake_modules(calibrated, tmp_path):
    m, stats = calibrated
    for fam in ("svdllm", "dobi"):
        write_native(_compress(m, stats, fam), fam, tmp_path / fam)
    import transformers.models.llama.modeling_llama as ml

    assert not any(k == "component" or k.startswith(("component.", "modules.")) for k in sys.modules)
    assert not hasattr(ml, "LlamaSdpaAttention")
    assert "transformers.models.llama.tokenization_llama_fast" not in sys.modules


@pytest.mark.compat
def test_native_layouts(calibrated, tmp_path):
    m, stats = calibrated
    p = write_native(_compress(m, stats, "svdllm"), "svdllm", tmp_path / "s", model_name="org/tiny-llama", keep=0.6)
    assert p.name == "org_tiny_llama_whitening_only_0.6.pt"
    g = pickle_globals(p)
    assert {"component.svd_llama.SVD_LlamaAttention", "component.svd_llama.SVD_LlamaMLP",
            "component.svd_llama.LlamaRotaryEmbedding"} <= g
    p = write_native(_compress(m, stats, "dobi"), "dobi", tmp_path / "DobiSVD_Noremapping-tiny-0.6")
    g = pickle_globals(p)
    assert {"modules.module.SVDTransformLayer", "transformers.models.llama.modeling_llama.LlamaSdpaAttention",
            "torch.nn.modules.activation.SiLU", "torch.HalfStorage"} <= g and "torch.FloatStorage" not in g
    with pytest.raises(RuntimeError, match="CUDA"):      # saved "from a GPU", like the original
        torch.load(p, weights_only=False)
    assert load_checkpoint(p.parent).lowrank_meta["keep"] == 0.6
    d = write_native(_compress(m, stats, "basis_sharing"), "basis_sharing", tmp_path / "share_tiny_40")
    assert load_checkpoint(d).lowrank_meta["keep"] == 0.6
    sd = torch.load(d / "pytorch_model.bin", weights_only=True)
    a, b = sd["model.layers.0.self_attn.q_basis.weight"], sd["model.q_basis.1.weight"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()   # aliases share one storage
    import json

    cfg = json.loads((d / "config.json").read_text())
    assert cfg["q_groups"] == [[0, 1]] and cfg["o_groups"] == [[0], [1]] and cfg["use_cache"] is False
    d = write_native(_compress(m, stats, "palu"), "palu", tmp_path / "palu")
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == "palullama" and len(cfg["head_wise_ranks"]["model.layers.0.self_attn.k_proj"]) == \
        m.config.num_key_value_heads


def test_basis_sharing_loads_one_shared_parameter(calibrated, tmp_path):
    m, stats = calibrated
    r = load_checkpoint(write_native(_compress(m, stats, "basis_sharing"), "basis_sharing", tmp_path / "bs"))
    l0, l1 = r.model.layers
    assert l0.self_attn.q_proj.V is l1.self_attn.q_proj.V and l0.mlp.gate_proj.V is l1.mlp.gate_proj.V
    assert l0.self_attn.o_proj.V is not l1.self_attn.o_proj.V
    assert ["model.layers.0.self_attn.q_proj.V", "model.layers.1.self_attn.q_proj.V"] in r.lowrank_meta["shared_groups"]


@pytest.mark.parametrize("use_mmap", [True, False])
def test_own_format_keeps_shared_groups(calibrated, tmp_path, use_mmap):
    from lowrank_lib.formats import lowrank

    m, stats = calibrated
    cm = _compress(m, stats, "basis_sharing")
    p = save_checkpoint(cm, tmp_path / "own")
    assert detect_format(p) == "lowrank"
    r = lowrank.read(p, use_mmap=use_mmap)
    assert _rel(r, cm) < 1e-6
    assert r.model.layers[0].self_attn.k_proj.V is r.model.layers[1].self_attn.k_proj.V
    assert account(r).total_params == account(cm).total_params
    assert r.lowrank_meta["family"] == "basis_sharing" and r.lowrank_meta["keep"] == 0.6


def test_mmap_views_read_the_declared_bytes(tmp_path):
    from lowrank_lib.formats.lowrank import mmap_safetensors

    m = models.tiny_model("tiny-gqa")
    from lowrank_lib.compress import compress_svd

    p = save_checkpoint(compress_svd(m, 0.5), tmp_path / "own")
    t = mmap_safetensors(p / "model.safetensors")
    k = "model.layers.0.self_attn.q_proj.U"
    before = t[k].clone()
    data = bytearray((p / "model.safetensors").read_bytes())
    # the tensor reads the file's pages: its bytes are found at the header-declared offset
    n = int.from_bytes(data[:8], "little")
    import json

    s, e = json.loads(data[8:8 + n])[k]["data_offsets"]
    assert bytes(data[8 + n + s:8 + n + e]) == before.numpy().tobytes()
