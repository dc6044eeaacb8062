"""The garbage collector around a process's start-up (vLLM's gc_utils).

Starting an engine imports torch and transformers and builds a model: about a million objects that live as long as
the process, and allocations that keep triggering the collector's passes over all of them while they are made (a
third of a second of CPU or more per process at start-up, on a 2-core machine taken from the other processes
starting beside it). None of that start-up work leaves cyclic garbage worth collecting before it ends, so the
processes pagedllm starts (the engine, the workers, the API server) collect nothing until they are up
(``pause_gc_for_startup``), then collect once and freeze what is left (``freeze_gc_heap``): the full collections a
busy loop's allocations trigger later no longer walk the start-up heap either."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


def pause_gc_for_startup() -> None:
    """No automatic collection until ``freeze_gc_heap``: for a process of pagedllm's own, from its first import."""
    gc.disable()


def freeze_gc_heap() -> None:
    """Collect the start-up's garbage, move what survives out of the collector's reach (gc.freeze), and collect
    automatically again from here on."""
    gc.collect()
    gc.freeze()
    gc.enable()


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic collection inside (in a caller's process: LLM() and the imports behind ``pagedllm.LLM``); the
    collector is left as it was found, and nothing is frozen (what the caller's process holds is its own)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
