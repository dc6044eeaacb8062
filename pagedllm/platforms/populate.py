"""Fault a KV cache's memory in ahead of its first use, from a background thread at the lowest CPU priority.

The cache comes from fresh anonymous memory (cpu.huge_page_zeros) that costs nothing until a page is first
written. That first write costs the kernel a zeroed page, and in a VM also the host a fault per page: on the
Firecracker VMs seen here 2.5-5 s a GiB, so while a new engine's steps still take fresh blocks, every step that
writes K/V into never-touched memory stalls (a 2048-token prefill step doubling), until the whole cache has been
handed out once. vLLM pays the same once at start-up by zeroing its cache. Here it is paid while the engine is
idle: the thread waits while this process's engine runs a step and for IDLE_AFTER_SECONDS after one
(engine_step, around the worker's steps; at nice 19 alone it still slowed the first seconds' decode steps: in a
VM a first touch occupies its vCPU in the host, where no guest priority reaches), and
it populates in block order (every tensor's first 2 MiB, then the next), the order in which the block pool hands
out fresh blocks. MADV_POPULATE_WRITE (Linux 5.14) faults pages in writable without writing them, so it is safe
beside the kernels writing K/V into the same pages. It stops when memory runs short (engines started side by side
each size their cache from the memory available then, counting on untouched pages costing nothing), when the
cache is freed, where the call is not supported, or at interpreter exit (the thread is stopped and joined then: a
daemon thread that comes back from madvise into a finalizing interpreter is torn down mid-call, and in-process
engines aborted at exit, "terminate called without an active exception", in about one run in ten).
"""
from __future__ import annotations

import atexit
import contextlib
import ctypes
import logging
import os
import threading
import time
import weakref

import psutil
import torch

from pagedllm.platforms.cpu import HUGE_PAGE, linux_libc

logger = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23
# Populating stops while less than this is available to the machine (the larger of the two).
MIN_AVAILABLE_BYTES = 2 << 30
MIN_AVAILABLE_FRACTION = 0.1
_CHECK_MEMORY_EVERY = 32  # chunks; psutil's reading costs more than one chunk's madvise calls
_EXIT_JOIN_SECONDS = 5.0  # a chunk is a few 2 MiB madvise calls: the thread stops within one
# The engine counts as busy while a step runs and for this long after it: a request's steps come one after the
# other (and the next request's soon after), so populating waits for a real pause, and a request arriving during
# one waits for one 2 MiB call at most.
IDLE_AFTER_SECONDS = 0.05
_IDLE_POLL_SECONDS = 0.01
_exiting = threading.Event()
_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
_steps_running = 0
_last_step_end = float("-inf")


@contextlib.contextmanager
def engine_step():
    """Around each step of this process's engine (Worker.execute_model): populating waits while one runs and for
    IDLE_AFTER_SECONDS after."""
    global _steps_running, _last_step_end
    _steps_running += 1
    try:
        yield
    finally:
        _steps_running -= 1
        _last_step_end = time.monotonic()


def _wait_until_idle() -> bool:
    """Sleep while the engine is busy (engine_step); False once the interpreter is exiting."""
    while _steps_running or time.monotonic() - _last_step_end < IDLE_AFTER_SECONDS:
        if _exiting.wait(_IDLE_POLL_SECONDS):
            return False
    return not _exiting.is_set()


@atexit.register
def _stop_at_exit() -> None:
    """Stop every populating thread before the interpreter finalizes (atexit runs before daemon threads are
    frozen), and wait for it to leave its madvise call."""
    _exiting.set()
    for thread in list(_threads):
        thread.join(_EXIT_JOIN_SECONDS)


def populate_in_background(buffers: list[torch.Tensor]) -> threading.Thread | None:
    """Start the populating thread over ``buffers`` (contiguous, 2 MiB-aligned CPU tensors, e.g. a cache's
    per-layer key and value tensors); None where there is nothing to do or no Linux C library."""
    libc = linux_libc()
    if libc is None or not buffers:
        return None
    refs = [weakref.ref(b) for b in buffers]
    thread = threading.Thread(target=_populate, args=(libc, refs), name="kv-cache-populate", daemon=True)
    _threads.add(thread)
    thread.start()
    return thread


def _populate(libc: ctypes.CDLL, refs: list[weakref.ref]) -> None:
    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # this thread only
    reserve = max(MIN_AVAILABLE_BYTES, int(psutil.virtual_memory().total * MIN_AVAILABLE_FRACTION))
    start, done, chunk, populated = time.monotonic(), 0, 0, None
    while not _exiting.is_set():
        if chunk % _CHECK_MEMORY_EVERY == 0 and psutil.virtual_memory().available < reserve:
            logger.debug("KV cache populating stopped at %d MiB: under %d MiB available", done >> 20, reserve >> 20)
            return
        populated = _populate_chunk(libc, refs, chunk * HUGE_PAGE)
        if not populated:
            break
        done += populated
        chunk += 1
    if populated == 0:
        logger.debug("KV cache populated: %d MiB in %.1f s", done >> 20, time.monotonic() - start)


def _populate_chunk(libc: ctypes.CDLL, refs: list[weakref.ref], offset: int) -> int | None:
    """Bytes populated at ``offset`` of every buffer that reaches it, each call once the engine is idle: 0 once none
    does; None to stop (the cache was freed, the interpreter is exiting, or the call failed: not supported before
    Linux 5.14, or out of memory, where first touches pay as before). A buffer is held only for its call, so that
    the thread never keeps a freed cache alive (nor while it waits)."""
    done = 0
    for ref in refs:
        if not _wait_until_idle():
            return None
        b = ref()
        if b is None:
            return None
        if b.nbytes > offset:
            size = min(HUGE_PAGE, b.nbytes - offset)
            if libc.madvise(ctypes.c_void_p(b.data_ptr() + offset), ctypes.c_size_t(size), _MADV_POPULATE_WRITE):
                return None
            done += size
        del b  # not held while the next call waits
    return done
