"""llama.cpp (dense) side by side with lowrank_lib's dense and low-rank engines on the CPU, one interleaved run."""
from __future__ import annotations

from ..peer import add_arguments as _peer_arguments
from ..peer import run  # noqa: F401  (the command's entry point)

#: ``--threads`` is this benchmark's own list of thread counts to sweep, not the CLI's torch.set_num_threads
OWN_THREADS = True


def add_arguments(p) -> None:
    _peer_arguments(p, out=False)
