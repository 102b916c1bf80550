"""Activation statistics of each projection's input, collected with forward hooks, one decoder layer at a time.

For every target Linear with input X (tokens x in) we accumulate, over calibration batches,

* ``xtx``     = sum_t x_t x_t^T          [in, in]   per-batch fp32 Gram (as SVD-LLM), summed in float64
* ``abs_mean`` = sum_samples mean_t |x_t|  [in]       float64 (ASVD's activation scale)
* ``tokens``   number of tokens seen.

Projections that read the same tensor (q/k/v, gate/up) share one statistic (``INPUT_OF``), so a
Llama layer costs four Gram updates, not seven. Everything runs on the dense model.

Memory: :func:`collect_stats` holds one layer's accumulators at a time and spills finished layers to memory-mapped
files when the whole model's would not fit; the compressors keep what they derive from the statistics (Cholesky
factors, square roots, eigenvectors) in a byte budget (``common.BoundedCache``). Before both, SVD-LLM at
Llama-3.2-1B held 10 GB of X^T X and 10 GB of Cholesky factors at once, and at LLaMA-2-7B 44 GB of each.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass, field

import torch
from torch import nn
from tqdm.auto import tqdm

from ..factorized import LLAMA_PROJ, iter_linears
from ..host import available_memory
from ..models import default_cache_dir

__all__ = ["calibration_data", "CalibStats", "cholesky_lower", "collect_stats", "INPUT_OF", "LayerStats"]

#: Projections whose input equals another projection's input in a Llama layer.
INPUT_OF = {"k_proj": "q_proj", "v_proj": "q_proj", "up_proj": "gate_proj"}


@dataclass
class LayerStats:
    xtx: torch.Tensor          # [in, in] float64, sum over tokens
    abs_mean: torch.Tensor     # [in] float64, sum over samples of per-sample mean |x|
    tokens: int = 0
    samples: int = 0


@dataclass
class CalibStats:
    """Per-module statistics; ``stats[name]`` works for every target (shared entries aliased)."""

    stats: dict[str, LayerStats] = field(default_factory=dict)
    n_samples: int = 0
    seq_len: int = 0

    def __getitem__(self, name: str) -> LayerStats:
        return self.stats[name]

    def __contains__(self, name: str) -> bool:
        return name in self.stats


def _source_name(name: str) -> str:
    parent, _, leaf = name.rpartition(".")
    src = INPUT_OF.get(leaf)
    return f"{parent}.{src}" if src else name


@torch.no_grad()
def collect_stats(model: nn.Module, batches: torch.Tensor, targets=LLAMA_PROJ, batch_size: int = 1,
                  progress: bool = True, spill: bool | None = None) -> CalibStats:
    """Run ``batches`` [n, seq] through ``model`` and gather input statistics of every target.

    Returns a :class:`CalibStats`; k/v share q's entry, up shares gate's (same object).

    The model runs ONE decoder layer at a time over every batch (as GPTQ and SVD-LLM's low-resource path do): each
    batch's input to the first layer is caught, then layer i maps every batch's hidden state to layer i + 1's,
    with hooks on layer i's projections only. The statistics are those of the whole-model forward, bit for bit (the
    same layer calls on the same inputs); what is held at once is one layer's accumulators plus every batch's hidden
    state (tokens x hidden, the model's dtype), not every layer's (a Llama-3.2-1B holds 0.64 GB of float64 X^T X per
    layer, 10 GB in all; a LLaMA-2-7B 1.4 GB per layer, 44 GB). The head and final norm are not run.

    ``spill``: each finished layer's X^T X is written to a file and memory-mapped back (pages the OS can drop and
    re-read, not anonymous memory; the file is unlinked at once and lives as long as the mapping). ``None``
    (default) spills when the statistics of the whole model would exceed a quarter of the memory available now.
    The files go to ``<model cache>/calib_spill/`` (``models.default_cache_dir``), not the temporary folder: where
    /tmp is a tmpfs, a spill there would be held in memory again. They need the statistics' bytes on that disk
    while the call runs (44 GB at LLaMA-2-7B), and none after it.
    """
    names = [n for n, _ in iter_linears(model, targets)]
    owners = {n: _source_name(n) for n in names}
    owners = {n: (o if o in owners else n) for n, o in owners.items()}
    layers, prefix = _decoder_layers(model)
    per_layer: dict[int, list[str]] = {}
    for o in sorted(set(owners.values())):
        i = _layer_index(o, prefix)
        per_layer.setdefault(i, []).append(o)
    mods = dict(model.named_modules())
    if spill is None:
        need = sum(8 * mods[o].in_features ** 2 for o in set(owners.values()))
        spill = need > available_memory() // 4
    dev = next(model.parameters()).device
    hidden, calls = _first_layer_inputs(model, layers[0], batches, batch_size, dev)
    acc: dict[str, LayerStats] = {}
    spill_dir = None
    if spill:
        root = default_cache_dir() / "calib_spill"
        root.mkdir(parents=True, exist_ok=True)
        spill_dir = tempfile.mkdtemp(prefix="stats-", dir=root)
    try:
        for i in tqdm(range(len(layers)), desc="calibration", disable=not progress, leave=False):
            hooks = [mods[o].register_forward_hook(_accumulate(o, acc)) for o in per_layer.get(i, [])]
            try:
                for b, h in enumerate(hidden):
                    args, kwargs = calls[tuple(h.shape[:2])]
                    out = layers[i](h, *args, **kwargs)
                    hidden[b] = out[0] if isinstance(out, tuple) else out
            finally:
                for hk in hooks:
                    hk.remove()
            if spill_dir is not None and per_layer.get(i):
                _spill(acc, per_layer[i], os.path.join(spill_dir, f"layer{i}.pt"))
    finally:
        if spill_dir is not None:
            shutil.rmtree(spill_dir, ignore_errors=True)
    return CalibStats({n: acc[o] for n, o in owners.items()}, int(batches.shape[0]), int(batches.shape[1]))


class _Caught(Exception):
    """Raised by the first layer's pre-hook: its input is caught, the rest of the forward is not run."""


def _decoder_layers(model: nn.Module) -> tuple[nn.ModuleList, str]:
    """The decoder layers (``model.layers`` of a Llama-family causal LM) and their dotted prefix."""
    for prefix in ("model.layers", "layers"):
        try:
            layers = model.get_submodule(prefix)
        except AttributeError:
            continue
        if isinstance(layers, nn.ModuleList) and len(layers):
            return layers, prefix
    raise ValueError("collect_stats needs a Llama-family model whose decoder layers are `model.layers`")


def _layer_index(name: str, prefix: str) -> int:
    head = prefix + "."
    if not name.startswith(head):
        raise ValueError(f"{name} is not inside a decoder layer ({prefix}.<i>.*): collect_stats runs layer by layer")
    return int(name[len(head):].split(".", 1)[0])


def _first_layer_inputs(model, first: nn.Module, batches: torch.Tensor, batch_size: int, dev):
    """Every batch's hidden state entering the first layer, and the layer's other arguments per (batch, tokens)
    shape. The model is called with token ids alone, so everything else a layer receives (position embeddings,
    the causal mask, position ids) is a function of that shape: caught once per shape."""
    hidden: list[torch.Tensor] = []
    calls: dict[tuple, tuple] = {}

    def catch(mod, args, kwargs):
        kwargs = dict(kwargs)
        h = args[0] if args else kwargs.pop("hidden_states")
        hidden.append(h)
        calls.setdefault(tuple(h.shape[:2]), (tuple(args[1:]), kwargs))
        raise _Caught

    hook = first.register_forward_pre_hook(catch, with_kwargs=True)
    try:
        for i in range(0, batches.shape[0], batch_size):
            try:
                model(batches[i:i + batch_size].to(dev), use_cache=False)
            except _Caught:
                pass
            else:
                raise RuntimeError("the model's forward never reached its first decoder layer")
    finally:
        hook.remove()
    return hidden, calls


def _accumulate(name: str, acc: dict[str, LayerStats]):
    def hook(mod, inp, out):
        x = inp[0].detach()                      # (B, T, in)
        xs = x.reshape(-1, x.shape[-1]).float()
        st = acc.get(name)
        if st is None:
            st = acc[name] = LayerStats(torch.zeros(xs.shape[1], xs.shape[1], dtype=torch.float64),
                                        torch.zeros(xs.shape[1], dtype=torch.float64))
        st.xtx += (xs.T @ xs).double()           # per-batch Gram in fp32 (as SVD-LLM), summed in fp64
        st.abs_mean += x.abs().double().mean(dim=1).sum(0)  # per-sample mean over tokens, summed
        st.tokens += xs.shape[0]
        st.samples += x.shape[0]
    return hook


def _spill(acc: dict[str, LayerStats], owners: list[str], path: str) -> None:
    """One layer's X^T X to ``path``, mapped back read-only (the anonymous copies freed), the file unlinked."""
    torch.save({o: acc[o].xtx for o in owners if o in acc}, path)
    mapped = torch.load(path, mmap=True, weights_only=True)
    os.unlink(path)
    for o, t in mapped.items():
        acc[o].xtx = t


def calibration_data(model_name_or_tok, n_samples: int, seq_len: int, seed: int = 0, vocab_size: int | None = None):
    """``[n, seq]`` calibration ids: WikiText-2 valid windows for a tokenizer, random ids otherwise."""
    from .. import data

    if model_name_or_tok is None:
        if vocab_size is None:
            raise ValueError("random calibration tokens need vocab_size")
        return data.random_token_batches(vocab_size, n_samples, seq_len, seed)
    return data.calibration_batches(model_name_or_tok, n_samples, seq_len, seed)


def cholesky_lower(A: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Lower Cholesky factor L (L L^T = A) in float64 with SVD-LLM's fallback.

    If ``A`` is not positive definite, add (-lambda_min + eps) I and retry (SVD-LLM uses 1e-6,
    Basis Sharing 7e-6). ``A`` [n, n] -> L [n, n] float64.
    """
    A = A.double()
    L, info = torch.linalg.cholesky_ex(A)
    if int(info) == 0:
        return L
    lam_min = torch.linalg.eigvalsh(A)[0]
    A = A + (-lam_min + eps) * torch.eye(A.shape[0], dtype=A.dtype)
    L, info = torch.linalg.cholesky_ex(A)
    if int(info) != 0:
        raise torch.linalg.LinAlgError(f"Cholesky failed even after the (-lambda_min + {eps}) I shift")
    return L
