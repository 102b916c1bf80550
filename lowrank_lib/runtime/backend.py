"""What an attention backend can do (:class:`BackendCaps`) and which one a store runs, and why
(:class:`BackendChoice`): a leaf of ``runtime/``, read by the dense attention registry (``runtime.attention``), the
stores (``runtime.kv``) and the tiered attention (``kv.tiers``)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BackendCaps", "BackendChoice"]


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
    captured / compiled decode step. decode_only : one query row only. layout : the dense KV layout it reads.
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
    layout: str = "bhsd"

    def unavailable(self, device: torch.device, dtype: torch.dtype, kernels: str = "auto",
                    explicit: bool = False) -> str | None:
        """Why a backend with these capabilities cannot run here (None: it can), from the declared fields only:
        ``kernels`` (``EngineConfig.kernels``) against :attr:`native`, the device (or :attr:`interpreter_env` for an
        ``explicit`` request on CPU), the dtype, the packages, and for a native kernel its library and ISA."""
        import importlib.util
        import os

        if self.native and kernels == "portable":
            return "kernels='portable'"
        dev = torch.device(device).type
        if dev not in self.devices:
            interp = (self.interpreter_env is not None and dev == "cpu" and explicit
                      and os.environ.get(self.interpreter_env) == "1")
            if not interp:
                return f"device {dev}: runs on {'/'.join(self.devices)}" + (
                    f" (or {self.interpreter_env}=1 on CPU)" if self.interpreter_env else "")
        if self.dtypes is not None and dtype not in self.dtypes:
            return f"dtype {dtype}: serves {', '.join(str(d).replace('torch.', '') for d in self.dtypes)}"
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
