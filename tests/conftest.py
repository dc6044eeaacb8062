"""Every test runs with the native kernels' argument checks on (native/checks.py): a kernel call whose tensors do
not fit what its C side assumes fails there, naming the argument, instead of reading the wrong memory. Set before
pagedllm is imported, and inherited by the engine processes tests start."""
import os

import pytest
import torch

os.environ.setdefault("PAGEDLLM_NATIVE_CHECKS", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of many small model steps in the test process: with OpenMP threads competing on a busy 2-core
    machine each op can wait a scheduler tick (25x slower seen here). Use with pytest.mark.usefixtures."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
