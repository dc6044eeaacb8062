"""The KV cache's background populating (platforms/populate.py): pages become resident without their contents
changing, in block order, and it stops when memory is short or the cache is freed."""
from __future__ import annotations

import ctypes
import sys
import threading
import time

import pytest
import torch

from pagedllm.config import CacheConfig
from pagedllm.layers.attention.kv_cache import allocate_kv_caches
from pagedllm.platforms import populate
from pagedllm.platforms.cpu import HUGE_PAGE, huge_page_zeros, linux_libc

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux memory calls")
PAGE = 4096


def resident_pages(buffer: torch.Tensor) -> int:
    """How many of the buffer's 4 KiB pages are in memory (mincore(2))."""
    num_pages = -(-buffer.nbytes // PAGE)
    vec = (ctypes.c_ubyte * num_pages)()
    assert linux_libc().mincore(ctypes.c_void_p(buffer.data_ptr()), ctypes.c_size_t(buffer.nbytes), vec) == 0
    return sum(v & 1 for v in vec)


def test_pages_become_resident_and_keep_what_was_written():
    key, value = huge_page_zeros(8 * HUGE_PAGE), huge_page_zeros(3 * HUGE_PAGE)
    key[5] = 7  # written before: the populating must not write over it
    value[-1] = 9
    assert resident_pages(key) < key.nbytes // PAGE and resident_pages(value) < value.nbytes // PAGE
    populate.populate_in_background([key, value]).join(timeout=60)
    assert resident_pages(key) == key.nbytes // PAGE and resident_pages(value) == value.nbytes // PAGE
    assert (key[5].item(), value[-1].item()) == (7, 9)
    assert int(key.sum()) == 7 and int(value.sum()) == 9


def test_it_waits_while_the_engine_steps():
    """Nothing is populated while a step runs (engine_step), nor within IDLE_AFTER_SECONDS of one; then all is."""
    buffer = huge_page_zeros(4 * HUGE_PAGE)
    with populate.engine_step():
        thread = populate.populate_in_background([buffer])
        time.sleep(0.2)
        assert resident_pages(buffer) == 0 and thread.is_alive()
    thread.join(timeout=60)
    assert resident_pages(buffer) == buffer.nbytes // PAGE


def test_it_stops_when_memory_is_short(monkeypatch):
    monkeypatch.setattr(populate, "MIN_AVAILABLE_BYTES", 1 << 60)
    buffer = huge_page_zeros(4 * HUGE_PAGE)
    populate.populate_in_background([buffer]).join(timeout=60)
    assert resident_pages(buffer) == 0


def test_it_stops_when_the_cache_is_freed(monkeypatch):
    calls = []
    libc = linux_libc()

    class CountingLibc:
        def madvise(self, *args):
            calls.append(args)
            return libc.madvise(*args)

    monkeypatch.setattr(populate, "linux_libc", CountingLibc)
    buffer = huge_page_zeros(64 * HUGE_PAGE)
    thread = populate.populate_in_background([buffer])
    del buffer
    thread.join(timeout=60)
    assert not thread.is_alive() and len(calls) < 64


def test_interpreter_exit_stops_and_joins_the_thread(monkeypatch):
    """At exit (the atexit handler) the thread leaves its loop at the next chunk and is joined, so it never comes
    back from madvise into a finalizing interpreter."""
    monkeypatch.setattr(populate, "_exiting", threading.Event())  # the module's own stays unset for later tests
    entered, released, calls = threading.Event(), threading.Event(), []
    libc = linux_libc()

    class BlockingLibc:  # the first call waits until exit has begun: the thread is mid-populate then
        def madvise(self, *args):
            calls.append(args)
            entered.set()
            released.wait(timeout=60)
            return libc.madvise(*args)

    monkeypatch.setattr(populate, "linux_libc", BlockingLibc)
    buffer = huge_page_zeros(64 * HUGE_PAGE)
    thread = populate.populate_in_background([buffer])
    assert entered.wait(timeout=60)
    threading.Timer(0.2, released.set).start()  # the madvise returns while _stop_at_exit is waiting on it
    populate._stop_at_exit()
    assert not thread.is_alive() and len(calls) == 1


def test_startup_mode_returns_with_the_cache_resident():
    caches = allocate_kv_caches(2, 16384, 16, 2, 64, torch.bfloat16, populate="startup")  # 64 MiB a tensor
    for tensor in (t for pair in caches for t in pair):
        assert resident_pages(tensor) == -(-tensor.nbytes // PAGE)


def test_a_bad_mode_is_a_config_error():
    with pytest.raises(ValueError, match="kv_cache_populate must be one of background, startup"):
        CacheConfig(kv_cache_populate="eager")
