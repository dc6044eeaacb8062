"""Fault a KV cache's memory in ahead of its first use, from a background thread at the lowest CPU priority.

The cache comes from fresh anonymous memory (cpu.huge_page_zeros) that costs nothing until a page is first
written. That first write costs the kernel a zeroed page, and in a VM also the host a fault per page: on the
Firecracker VMs seen here 2.5-5 s a GiB, so while a new engine's steps still take fresh blocks, every step that
writes K/V into never-touched memory stalls (a 2048-token prefill step doubling), until the whole cache has been
handed out once. vLLM pays the same once at start-up by zeroing its cache. Here it is paid while the engine is
idle: the thread runs at nice 19, so a step's threads take the cores whenever they want them, and it populates
in block order (every tensor's first 2 MiB, then the next), the order in which the block pool hands out fresh
blocks. MADV_POPULATE_WRITE (Linux 5.14) faults pages in writable without writing them, so it is safe beside the
kernels writing K/V into the same pages. It stops when memory runs short (engines started side by side each size
their cache from the memory available then, counting on untouched pages costing nothing), when the cache is
freed, where the call is not supported, or at interpreter exit (the thread is stopped and joined then: a daemon
thread that comes back from madvise into a finalizing interpreter is torn down mid-call, and in-process engines
aborted at exit, "terminate called without an active exception", in about one run in ten).
"""
from __future__ import annotations

import atexit
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
_exiting = threading.Event()
_threads: weakref.WeakSet[threading.Thread] = weakref.WeakSet()


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
    """Bytes populated at ``offset`` of every buffer that reaches it: 0 once none does; None to stop (the cache was
    freed, or the call failed: not supported before Linux 5.14, or out of memory, where first touches pay as
    before). The buffers are held only for the call, so that the thread never keeps a freed cache alive."""
    buffers = [r() for r in refs]
    if any(b is None for b in buffers):
        return None
    done = 0
    for b in buffers:
        if b.nbytes > offset:
            size = min(HUGE_PAGE, b.nbytes - offset)
            if libc.madvise(ctypes.c_void_p(b.data_ptr() + offset), ctypes.c_size_t(size), _MADV_POPULATE_WRITE):
                return None
            done += size
    return done
