"""The ``Runner`` protocol: what the one decode loop (:func:`lowrank_lib.generation.run_generation`), the
profiler (:mod:`lowrank_lib.runtime.profiling`) and the benchmarks may call on a runner, written down once.

    runner.prefill(input_ids [B, T], attention_mask=None) -> logits [B, V]   the prompt (last position's logits)
    runner.step(tokens [B]) -> logits [B, V]                                 one decode step
    runner.prepare(B) -> seconds          capture / compile for batch size B before timing (0.0: eager, or done)
    runner.invalidate()                   drop every capture / compiled step (threads or weights changed)
    runner.capture_s                      capture / compile seconds so far (0.0 if none)
    runner.compiled                       decode replays a captured / compiled step
    runner.lm_head_mode                   "exact" | "certified" (our heads) | "hf" (transformers' own head)
    runner.counters() -> dict             since the last reset: {"lm_head": {...}, "compiles": [...]}
    runner.reset_counters()
    runner.device                         where the logits live (the loop synchronises it)
    runner.layer_sections(mark) -> undo | None   the eager step calls mark(i) / mark(None) around decoder layer i

Every runner implements every member: callers never probe with ``hasattr`` / ``getattr``. A runner with no
capture and no head of its own can subclass :class:`Runner` and inherit the eager defaults below (it still
sets ``lm_head_mode`` and ``device``). Implementations: :class:`~lowrank_lib.runtime.engine.Engine` (eager or
graphs / compiled step), :class:`~lowrank_lib.runtime.baselines.HFRunner` and
:class:`~lowrank_lib.runtime.baselines.HFCompiledRunner`; ``tests/test_runner_protocol.py`` checks each one
:func:`~lowrank_lib.runtime.baselines.make_runner` builds.
"""
from __future__ import annotations

from typing import Callable, Protocol, runtime_checkable

import torch

__all__ = ["LM_HEAD_MODES", "Runner"]

#: the values of ``Runner.lm_head_mode``
LM_HEAD_MODES = ("exact", "certified", "hf")


@runtime_checkable
class Runner(Protocol):
    """A decode runner (see the module docstring). Subclassing it gives the eager defaults."""

    device: torch.device
    lm_head_mode: str
    #: capture / compile seconds so far
    capture_s: float = 0.0
    #: decode replays a captured / compiled step
    compiled: bool = False

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        """The prompt [B, T] (left padded where ``attention_mask`` says so) -> the last position's logits [B, V]."""
        ...

    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row [B] -> logits [B, V]."""
        ...

    def prepare(self, B: int) -> float:
        """Capture / compile the decode step for batch size ``B`` (after a prefill); the seconds it took (0.0: an
        eager runner, or already prepared)."""
        return 0.0

    def invalidate(self) -> None:
        """Drop every capture / compiled step: the next :meth:`prepare` (or step) captures again."""
        return None

    def counters(self) -> dict:
        """What the runner counted since the last :meth:`reset_counters`: ``{"lm_head": {...}, "compiles": [...]}``
        (the certified head's paths, ``certified_calls`` / ``fallback_calls`` among them; empty for another head;
        one record per capture / compile)."""
        return {"lm_head": {}, "compiles": []}

    def reset_counters(self) -> None:
        """Zero :meth:`counters`."""
        return None

    def layer_sections(self, mark: Callable[[int | None], None]) -> Callable[[], None] | None:
        """Until the returned undo is called, the eager decode step calls ``mark(i)`` when decoder layer ``i`` starts
        and ``mark(None)`` when it ends (how the profiler attributes work to layers). None: this runner cannot say
        (no decoder layers of its own in Python, e.g. llama.cpp)."""
        return None
