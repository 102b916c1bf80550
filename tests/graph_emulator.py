"""A CUDA-graph emulator for the CPU: run the runtime's CUDA-graph bookkeeping without a GPU.

A CUDA graph records the kernels launched while capturing, with their arguments and buffer addresses,
and replays exactly those kernels on the same buffers. Nothing that ran on the host during capture runs
again: a Python branch, a host int used as a slice bound or a length, a ``.item()`` read there are frozen
into the graph (and a host sync is an error while capturing). This emulator keeps those semantics on the
CPU: while "capturing" it records every ATen op that runs (a ``TorchDispatchMode``) with its arguments
and outputs; ``replay()`` runs the recorded ops again on the SAME tensor objects, copying each fresh
non-aliasing result into the tensor recorded at capture (its "static address") — in-place ops mutate
their buffers again, views keep aliasing their bases. So a decode step whose correctness depends on
host state at capture time gives wrong results on replay here, as it would on a GPU; and a host sync
inside a capture raises, as CUDA does.

Use::

    with emulated_cuda_graphs():                     # torch.cuda.{CUDAGraph, graph, Stream, ...} replaced
        eng.graphs = GraphRunner(eng, impl="cuda-graph")
        out = eng.generate(...)

Not emulated: kernels that do not go through ATen (Triton launches run during capture and are not
replayed), streams and memory pools (no-ops), timing.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HOST_SYNC = {torch.ops.aten._local_scalar_dense.default, torch.ops.aten.is_nonzero.default,
             torch.ops.aten.item.default}


class CaptureError(RuntimeError):
    """What CUDA would refuse while capturing (a host sync)."""


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in HOST_SYNC:
            raise CaptureError(f"{func} reads a device value on the host while capturing a graph "
                               f"(operation not permitted when stream is capturing)")
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


def _fresh_outputs(func, out) -> list[tuple[torch.Tensor, int]]:
    """(recorded output, index) of the results that own new memory (no alias annotation in the schema)."""
    outs = out if isinstance(out, (tuple, list)) else (out,)
    rets = func._schema.returns
    fresh = []
    for i, o in enumerate(outs):
        alias = rets[min(i, len(rets) - 1)].alias_info if rets else None
        if isinstance(o, torch.Tensor) and alias is None:
            fresh.append((o, i))
    return fresh


class EmulatedGraph:
    """Stands for ``torch.cuda.CUDAGraph``: holds the ops recorded while capturing; ``replay()`` reruns them."""

    def __init__(self, *a, **k):
        self.ops: list = []
        self.replays = 0

    def replay(self) -> None:
        for func, args, kwargs, out in self.ops:
            new = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) or isinstance(out, (tuple, list)):
                news = new if isinstance(new, (tuple, list)) else (new,)
                for o, i in _fresh_outputs(func, out):
                    o.copy_(news[i])
        self.replays += 1

    @property
    def n_ops(self) -> int:
        return len(self.ops)


class _GraphContext:
    def __init__(self, g: EmulatedGraph, pool=None, stream=None, **kw):
        self.g = g
        self.rec = _Recorder()

    def __enter__(self):
        self.rec.__enter__()
        return self

    def __exit__(self, *exc):
        self.rec.__exit__(*exc)
        self.g.ops = self.rec.ops
        return False


class _Stream:
    def __init__(self, *a, **k):
        pass

    def wait_stream(self, other) -> None:
        pass


@contextmanager
def emulated_cuda_graphs():
    """Replace the ``torch.cuda`` capture API the graph runner uses by the emulator (restored after)."""
    names = {"CUDAGraph": EmulatedGraph, "graph": _GraphContext, "Stream": _Stream,
             "stream": lambda s=None: nullcontext(), "current_stream": lambda *a, **k: _Stream(),
             "graph_pool_handle": lambda: None, "synchronize": lambda *a, **k: None}
    saved = {n: getattr(torch.cuda, n) for n in names}
    try:
        for n, v in names.items():
            setattr(torch.cuda, n, v)
        yield
    finally:
        for n, v in saved.items():
            setattr(torch.cuda, n, v)


def recorded_tensors(g: EmulatedGraph) -> list[torch.Tensor]:
    """Every tensor a recorded op read (what a replay depends on)."""
    seen = []
    for _, args, kwargs, _ in g.ops:
        seen += [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
    return seen
