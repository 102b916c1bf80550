"""Attention backends as data: what one can do (:class:`BackendCaps`), one registry entry (:class:`Backend`), the
choice among a registry's entries (:func:`select`) and which one a store runs, and why (:class:`BackendChoice`).
A leaf of ``runtime/``, used by the dense decode attentions (``runtime.attention.BACKENDS``), the stores
(``runtime.kv``) and the tiered attentions (``kv.tiers.BACKENDS``, through ``runtime.kv``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

__all__ = ["Backend", "BackendCaps", "BackendChoice", "select"]


@dataclass(frozen=True)
class BackendCaps:
    """What an attention backend can do, declared once as data (as eviction scorers declare what they need): the
    dense decode attentions (``runtime.attention.BACKENDS``) and the tiered ones (``kv.tiers.BACKENDS``). Callers
    read these fields; no behaviour is chosen by comparing backend names.

    devices : device types it runs on. dtypes : what it serves (None: any). isa : the CPU instruction set it needs
    (``"avx2"``: AVX2 + FMA or the dtype's AVX-512 subset; ``"avx512"``: the AVX-512 subset only; None: none).
    native : one of our compiled kernels (``runtime/kernels``, ``torch.ops.lowrank_lrk``):
    ``EngineConfig(kernels="portable")`` turns every native backend off, ``"lrk"`` requires it where it can run.
    packages : Python packages it imports. interpreter_env : an environment variable under which it also runs
    on CPU, interpreted, when requested by name (correctness checks only).
    reads_device_layout : it reads what it attends over (lengths, pad counts; a tiered layer's offsets and
    appended count) from device tensors at run time, so one capture replays for every step (and every layout of
    a bucket); False: the store hands it a mask or it slices with host ints.
    needs_mask : it reads the store's additive slot mask (dense decode). capturable : it may run inside a
    captured / compiled decode step. decode_only : one query row only. head_dims : the head dims it serves (None:
    any). layout : the dense KV layout it reads. in_fused_layer : the engine's fused decode layer op
    (``runtime/kernels/layer.cpp``: ``decode_layer`` for the dense store, ``decode_layer_tiers`` for a tiered one)
    runs this very kernel inside itself, so a store attending with it may hand its buffers to that op.
    """

    devices: tuple[str, ...] = ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...] | None = None
    isa: str | None = None
    native: bool = False
    packages: tuple[str, ...] = ()
    interpreter_env: str | None = None
    reads_device_layout: bool = False
    needs_mask: bool = False
    capturable: bool = True
    decode_only: bool = False
    head_dims: tuple[int, ...] | None = None
    layout: str = "bhsd"
    in_fused_layer: bool = False

    def unavailable(self, device: torch.device, dtype: torch.dtype, kernels: str = "auto", explicit: bool = False,
                    head_dim: int | None = None, q_len: int = 1) -> str | None:
        """Why a backend with these capabilities cannot run here (None: it can), from the declared fields only:
        ``kernels`` (``EngineConfig.kernels``) against :attr:`native`, the device (or :attr:`interpreter_env` for an
        ``explicit`` request on CPU), the dtype, ``q_len`` query rows, the head dim, the packages, and for a native
        kernel its library and ISA."""
        import importlib.util
        import os

        if self.native and kernels == "portable":
            return "kernels='portable'"
        if self.decode_only and q_len != 1:
            return f"q_len {q_len}: serves one query row (decode)"
        dev = torch.device(device).type
        if dev not in self.devices:
            interp = (self.interpreter_env is not None and dev == "cpu" and explicit
                      and os.environ.get(self.interpreter_env) == "1")
            if not interp:
                return f"device {dev}: runs on {'/'.join(self.devices)}" + (
                    f" (or {self.interpreter_env}=1 on CPU)" if self.interpreter_env else "")
        if self.dtypes is not None and dtype not in self.dtypes:
            return f"dtype {dtype}: serves {', '.join(str(d).replace('torch.', '') for d in self.dtypes)}"
        if head_dim is not None and self.head_dims is not None and head_dim not in self.head_dims:
            return f"head_dim {head_dim}: the kernel serves {', '.join(map(str, self.head_dims))}"
        for p in self.packages:
            try:
                found = importlib.util.find_spec(p) is not None
            except (ImportError, ValueError):
                found = False
            if not found:
                return f"the {p} package is not importable"
        if self.native:
            from .kernels.gemv import lrk_unavailable

            return lrk_unavailable(device, dtype, avx512=self.isa == "avx512")
        return None


@dataclass
class BackendChoice:
    """Which attention kernel a store runs, why (the engine reports both), and what it can do."""

    name: str
    reason: str
    caps: BackendCaps = BackendCaps()

    @property
    def layout(self) -> str:
        """The KV layout the kernel reads."""
        return self.caps.layout


@dataclass(frozen=True)
class Backend:
    """One entry of a backend registry: its function (a dense decode attention ``(q, K, V, cursor, mask)``, or a
    tiered one ``(layer, q, scale, n_new)``), what it can do, what it is (reported), and the form a
    ``torch.compile``-d CPU step traces instead where it has one (``EngineConfig.fused_compile``)."""

    name: str
    fn: Callable
    caps: BackendCaps
    about: str
    compiled_fn: Callable | None = None


def select(registry: dict[str, Backend], auto_order: tuple[str, ...], requested: str, device, head_dim: int,
           dtype: torch.dtype, kernels: str = "auto", q_len: int = 1, what: str = "attention") -> BackendChoice:
    """The backend of ``registry`` to run, and why. ``"auto"``: the first of ``auto_order`` whose declared
    capabilities allow it here (:meth:`BackendCaps.unavailable`; the reason names what was passed over on this
    device); a backend requested by name runs or raises, saying why. ``kernels`` (``EngineConfig.kernels``):
    ``"portable"`` rules out every native backend, ``"lrk"`` makes ``auto`` require the native one where it serves
    the device."""
    if requested != "auto" and requested not in registry:
        raise ValueError(f"unknown {what} {requested!r}; choose from {('auto', *registry)}")
    explicit = requested != "auto"
    dev = torch.device(device).type
    skipped = []
    for name in (requested,) if explicit else auto_order:
        b = registry[name]
        why = b.caps.unavailable(device, dtype, kernels, explicit, head_dim, q_len)
        if why is None:
            note = (f"; {b.caps.interpreter_env}=1: interpreter on CPU, correctness checks only"
                    if dev not in b.caps.devices else "")
            return BackendChoice(name, f"{'requested' if explicit else 'auto'}: {b.about}{note}" +
                                 (f" ({'; '.join(skipped)})" if skipped else ""), b.caps)
        if explicit:
            raise RuntimeError(f"{what} {name!r} cannot run: {why}")
        if b.caps.native and kernels == "lrk" and dev in b.caps.devices:
            raise RuntimeError(f"kernels='lrk': {what} {name!r} cannot run: {why}")
        if dev in b.caps.devices:                    # only what could have run on this device is worth saying
            skipped.append(f"{name}: {why}")
    raise RuntimeError(f"no {what} can run here: {'; '.join(skipped)}")
