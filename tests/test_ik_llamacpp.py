"""ik_llama.cpp, the second CPU peer (lowrank_lib.eval.ik_llamacpp): hostile arguments are refused before anything
loads; where ``ik-llama-cpp-python`` is installed (the optional ``ik`` extra), its logits on a tiny model's BF16 GGUF
are our HF forward's, its decode runner gives our greedy tokens at every thread count, its perplexity is our
protocol on its own logits, and the frontier labels, measures and times its points."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from lowrank_lib import models
from lowrank_lib.eval import frontier as fr
from lowrank_lib.eval import ik_llamacpp as ik

SEQ, WIN = 64, 2
needs_ik = pytest.mark.skipif(not ik.available()[0], reason=ik.available()[1] or "installed")


def test_hostile_arguments_are_refused_before_anything_loads(tmp_path):
    with pytest.raises(ValueError, match="no f32"):
        ik.IkLlama(tmp_path / "x.gguf", n_ctx=8, kv_type="f32")        # its contexts refuse an f32 cache
    with pytest.raises(ValueError, match="kv_type='q4'"):
        ik.IkLlama(tmp_path / "x.gguf", n_ctx=8, kv_type="q4")
    with pytest.raises(FileNotFoundError, match="no GGUF at"):
        ik.IkLlama(tmp_path / "missing.gguf", n_ctx=8)
    with pytest.raises(ValueError, match="runtime='vllm'"):
        fr.llamacpp_points(None, torch.zeros(1), tmp_path, ("q8_0",), runtime="vllm")
    assert fr.make_label({"id": "ik_llama.cpp:q4_k_m", "system": "ik_llama.cpp", "method": "Q4_K_M", "keep": None,
                          "weights": "q4_k_m"}) == "ik_llama.cpp Q4_K_M"


def test_the_cache_type_follows_the_build_flags():
    """bf16 only where the build has AVX512_BF16 (its fused CPU attention takes a bf16 cache only then, and aborts the
    process otherwise), else f16, the same bytes; the flags as llama_print_system_info writes them."""
    zen3 = ("AVX = 1 | AVX_VNNI = 0 | AVX2 = 1 | AVX512 = 0 | AVX512_VBMI = 0 | AVX512_VNNI = 0 | AVX512_BF16 = 0 | "
            "FMA = 1 | F16C = 1 | SSE3 = 1 |")
    zen4 = zen3.replace("AVX512 = 0", "AVX512 = 1").replace("AVX512_BF16 = 0", "AVX512_BF16 = 1")
    assert not ik.bf16_cache_ok(zen3) and ik.cache_type(zen3) == "f16"
    assert ik.bf16_cache_ok(zen4) and ik.cache_type(zen4) == "bf16"
    assert ik.cache_type("") == "f16"                                   # unknown flags: the type every build takes


@needs_ik
def test_a_bf16_cache_the_build_cannot_run_is_refused_by_name(bf16_file):
    """Where the installed build has no AVX512_BF16, a bf16 cache under its fused attention is a ValueError that
    names the flag, before a context exists (ik_llama.cpp itself would abort the whole process at the first decode);
    the default takes the build's own type, and without the fused attention bf16 is not refused."""
    info = ik.system_info()
    assert "AVX2" in info
    with ik.IkLlama(bf16_file, n_ctx=16) as m:
        assert m.kv_type == ik.cache_type(info) and m.report()["kv_type"] == m.kv_type
    if ik.bf16_cache_ok(info):
        ik.IkLlama(bf16_file, n_ctx=16, kv_type="bf16").close()
    else:
        with pytest.raises(ValueError, match="no AVX512_BF16"):
            ik.IkLlama(bf16_file, n_ctx=16, kv_type="bf16")
        ik.IkLlama(bf16_file, n_ctx=16, kv_type="bf16", flash_attn=False).close()


@needs_ik
def test_its_log_stays_off_stderr_and_a_failed_load_says_why(bf16_file, tmp_path, capfd):
    """The library's loader and context logs (hundreds of lines per load) go to LOG_TAIL, not stderr; a file it cannot
    load is a RuntimeError that ends with them."""
    with ik.IkLlama(bf16_file, n_ctx=16):
        pass
    assert "llama_" not in capfd.readouterr().err and any(x.startswith("llama_") for x in ik.LOG_TAIL)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(bf16_file.read_bytes()[: bf16_file.stat().st_size // 2])
    with pytest.raises(RuntimeError, match="could not load .*cut.gguf; its log ends:\n(.|\n)*llama_model_load"):
        ik.IkLlama(cut, n_ctx=16)


@pytest.fixture(scope="module")
def tiny():
    m = models.tiny_model("tiny-smol", seed=3)
    with torch.no_grad():                        # on the bf16 grid: the BF16 GGUF holds these weights exactly
        for p in m.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    return m


@pytest.fixture(scope="module")
def bf16_file(tiny, tmp_path_factory):
    return fr.gguf_file(tiny, tmp_path_factory.mktemp("ik_gguf"), "bf16")


@needs_ik
def test_its_logits_are_our_forward_on_the_same_tokens(tiny, bf16_file):
    toks = torch.randint(0, tiny.config.vocab_size, (SEQ,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = tiny(toks[None]).logits[0].double().numpy()
    with ik.IkLlama(bf16_file, n_ctx=SEQ, threads=1) as m:
        got = m.row_logits(toks.tolist())
        again = m.row_logits(toks.tolist())                # each row from an empty cache
    assert got.shape == ref.shape and np.array_equal(got, again)
    # bf16 activations / cache inside ik_llama.cpp against our fp32 forward: close, and the same argmax almost always
    assert np.abs(got - ref).max() < 0.03 * np.abs(ref).max()          # measured: 1.6 %
    assert (got.argmax(-1) == ref.argmax(-1)).mean() >= 0.9


@needs_ik
def test_the_runner_decodes_our_greedy_tokens_at_every_thread_count(tiny, bf16_file):
    from lowrank_lib.runtime import run_generation

    ids = torch.randint(0, tiny.config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = tiny.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)[0, 16:].tolist()
    r = ik.IkLlama(bf16_file, n_ctx=32, threads=1)
    try:
        outs = []
        for th in (1, 2, 1):
            r.set_threads(th)
            out = run_generation(r, ids, 8)
            outs.append(out.tokens[0].tolist())
            assert len(r.eval_s) == 7 and r.prefill_eval_s > 0 and r.threads == th
            p = r.perf()
            assert p["n_eval"] == 7 and p["n_p_eval"] == 16
        assert outs[0] == outs[1] == outs[2]
        assert np.mean([a == b for a, b in zip(outs[0], want)]) >= 0.75      # bf16 inside; our forward in fp32
        assert r.report()["runner"] == "ik_llama.cpp" and "AVX" in r.report()["system_info"]
        with pytest.raises(ValueError, match="batch 1"):
            r.prefill(torch.zeros(2, 4, dtype=torch.long))
        with pytest.raises(ValueError, match="do not fit"):
            r.prefill(torch.zeros(1, 40, dtype=torch.long))
    finally:
        r.close()


@needs_ik
def test_its_perplexity_is_our_protocol_on_its_logits(tiny, bf16_file):
    from lowrank_lib.eval.perplexity import perplexity

    ids = torch.randint(0, tiny.config.vocab_size, (WIN * SEQ + 5,), generator=torch.Generator().manual_seed(2))
    got = ik.ik_perplexity(bf16_file, ids, seq_len=SEQ, max_windows=WIN)
    ref = perplexity(tiny, ids, seq_len=SEQ, max_windows=WIN)
    assert got.tokens == ref.tokens and got.ppl == pytest.approx(ref.ppl, rel=0.02)
    pts = fr.llamacpp_points(tiny, ids, bf16_file.parent, ("bf16",), SEQ, WIN, runtime="ik_llama.cpp")
    (p,) = pts
    assert p["id"] == "ik_llama.cpp:bf16" and p["system"] == "ik_llama.cpp" and p["label"] == "ik_llama.cpp BF16"
    assert p["ppl"] == pytest.approx(got.ppl, rel=1e-9) and p["kv_type"] == ik.cache_type()
    assert p["file"] == str(bf16_file)

