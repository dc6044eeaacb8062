"""Process settings for CPU serving: freed activation memory stays with the process for the next step."""
import resource
import sys

import numpy as np
import pytest

from pagedllm.platforms.cpu import keep_freed_memory


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
