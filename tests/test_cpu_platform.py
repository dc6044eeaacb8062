"""Process settings for CPU serving: freed activation memory stays with the process for the next step, and
weights sit in huge pages."""
import resource
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from pagedllm.platforms.cpu import HugePageArena, huge_page_zeros, keep_freed_memory, release_freed_memory

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_a_freed_step_sized_buffer_is_reused_without_page_faults():
    keep_freed_memory()
    # A 2048-token prefill step's MLP intermediate for a model with an 8192-wide MLP: above glibc's largest
    # adaptive mmap threshold (32 MiB), so by default it is unmapped when freed and faulted in again.
    nbytes = 64 << 20
    first = np.empty(nbytes, dtype=np.uint8)
    first[::4096] = 1  # fault it in
    del first
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    again = np.empty(nbytes, dtype=np.uint8)
    again[::4096] = 1
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert faults < 64, f"{faults} page faults re-touching a freed {nbytes >> 20} MiB buffer"


def _resident_bytes() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * resource.getpagesize()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc malloc settings")
def test_memory_freed_while_loading_goes_back_to_the_os_once_released():
    """What keep_freed_memory keeps (here a loader's 96 MiB temporary) stays resident until the worker, started,
    calls release_freed_memory."""
    keep_freed_memory()
    nbytes = 96 << 20
    temporary = np.empty(nbytes, dtype=np.uint8)
    temporary[::4096] = 1
    held = _resident_bytes()
    del temporary
    assert _resident_bytes() > held - nbytes // 2  # kept by malloc
    release_freed_memory()
    assert _resident_bytes() < held - nbytes // 2


def _huge_kb_at(address: int) -> int:
    """AnonHugePages of the mapping holding ``address`` in this process."""
    mapping = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split()[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(x, 16) for x in first.split("-"))
            mapping = start <= address < end
        elif mapping and first == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError("address not mapped")


def test_arena_copies_are_equal_and_separate():
    arena = HugePageArena()
    tensors = [torch.randn(300, 70), torch.arange(1000, dtype=torch.int64), torch.randn(5)]
    copies = [arena.copy(t) for t in tensors]
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) and c.dtype == t.dtype and c.data_ptr() % 64 == 0
    copies[0].zero_()
    assert torch.equal(copies[1], tensors[1]) and torch.equal(copies[2], tensors[2])


def test_a_larger_tensor_gets_a_chunk_of_its_own():
    arena = HugePageArena()
    big = torch.ones(HugePageArena.CHUNK // 4 + 1000)
    assert torch.equal(arena.copy(big), big)


def test_huge_page_zeros_are_aligned_zeros_of_the_size_asked():
    zeros = huge_page_zeros((3 << 20) + 5)
    assert zeros.numel() == (3 << 20) + 5 and zeros.data_ptr() % (2 << 20) == 0 and not zeros.any()


NO_THP = not THP.exists() or "[never]" in THP.read_text()


@pytest.mark.skipif(NO_THP, reason="no transparent huge pages")
def test_arena_memory_is_backed_by_huge_pages():
    copy = HugePageArena().copy(torch.ones(4 << 20))  # 16 MiB
    assert _huge_kb_at(copy.data_ptr()) >= 8 << 10


@pytest.mark.skipif(NO_THP, reason="no transparent huge pages")
def test_huge_page_zeros_are_backed_by_huge_pages_even_after_malloc_kept_freed_memory():
    # The KV cache's allocator: with keep_freed_memory, a plain large allocation may come back as heap memory
    # already faulted in 4 KiB pages.
    keep_freed_memory()
    freed = np.ones(200 << 20, dtype=np.uint8)
    del freed
    zeros = huge_page_zeros(16 << 20)
    zeros.fill_(1)
    assert _huge_kb_at(zeros.data_ptr()) >= 8 << 10
