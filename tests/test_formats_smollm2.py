"""Real-model round trips (SmolLM2 weights, GQA 9:3, tied embeddings): pickled and shared-basis families."""
from __future__ import annotations

import pytest
import torch

from lowrank_lib import account, detect_format, load_checkpoint
from lowrank_lib.compress import collect_stats, compress_basis_sharing, compress_svdllm
from lowrank_lib.data import calibration_batches, tokens
from lowrank_lib.formats import write_native
from lowrank_lib.formats.safe_pickle import safe_torch_load


@pytest.mark.smollm2
def test_smollm2_native_round_trips(smollm2, tmp_path):
    import copy

    model, tok = smollm2
    model = copy.deepcopy(model)          # the real weights and geometry, first 4 of 30 layers (test budget)
    model.model.layers = model.model.layers[:4]
    model.config.num_hidden_layers = 4
    calib = calibration_batches(tok, 2, 128, seed=0)     # 256 tokens < 576 dims: exercises the Cholesky fallback
    stats = collect_stats(model, calib, progress=False)
    ids = tokens(tok, "test")[None, :96]
    # SVD-LLM: pickled whole model with the real tokenizer inside; factors fp32, the rest fp16
    cm = compress_svdllm(model, stats, 0.6, progress=False)
    p = write_native(cm, "svdllm", tmp_path, tokenizer=tok, model_name="HuggingFaceTB/SmolLM2-135M-Instruct")
    assert p.name == "HuggingFaceTB_SmolLM2_135M_Instruct_whitening_only_0.6.pt"
    assert detect_format(p) == "svdllm"
    assert safe_torch_load(p)["tokenizer"] is not None           # stubbed, not executed
    r = load_checkpoint(p, dtype=torch.float32)
    with torch.no_grad():
        ref, out = cm(ids).logits, r(ids).logits
    assert float((out - ref).norm() / ref.norm()) < 2e-3          # fp16 rounding of embeddings / norms
    assert r.lowrank_meta["keep"] == 0.6 and r.config.tie_word_embeddings
    del cm, r
    # Basis Sharing: fp32 .bin with aliased bases -> one shared Parameter per group, exact
    cm = compress_basis_sharing(model, stats, 0.6, progress=False)
    r = load_checkpoint(write_native(cm, "basis_sharing", tmp_path / "share_smollm2_40"))
    with torch.no_grad():
        ref, out = cm(ids).logits, r(ids).logits
    assert float((out - ref).norm() / ref.norm()) < 1e-5
    assert r.model.layers[2].mlp.up_proj.V is r.model.layers[3].mlp.up_proj.V
    assert account(r).shared_params_saved == account(cm).shared_params_saved > 0
