"""Every test runs with the native kernels' argument checks on (native/checks.py): a kernel call whose tensors do
not fit what its C side assumes fails there, naming the argument, instead of reading the wrong memory; and, where
torch sees no GPU, with Triton's interpreter on. Both set before pagedllm (or triton) is imported, and inherited by
the engine processes tests start."""
import os

import pytest
import torch

os.environ.setdefault("PAGEDLLM_NATIVE_CHECKS", "1")
# Without a GPU, Triton's kernels (the CUDA attention backend's) run under its interpreter, on CPU tensors. Triton
# reads this when it defines a jit function, its own tl.cdiv and the like included, so it is set before anything
# imports triton (xgrammar does, at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of many small model steps in the test process: with OpenMP threads competing on a busy 2-core
    machine each op can wait a scheduler tick (25x slower seen here). Use with pytest.mark.usefixtures."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# The float32 SmolLM2 engine of the quantization and KV-cache tests' usual settings.
DENSE_SMOLLM_ARGS = dict(dtype="float32", max_model_len=512, kv_cache_memory="64MiB")


@pytest.fixture(scope="session")
def dense_smollm():
    """The dense float32 SmolLM2 engine (DENSE_SMOLLM_ARGS) that test_kv_cache_dtype.py, test_int8_quantization.py,
    test_int4_quantization.py and test_gguf_quantization.py compare their engines against: built once for the
    session, in the test process, on the loaded model the in-process engines share (tests/e2e/conftest.py). Its
    tests leave it idle; it keeps no state between requests but its prefix cache."""
    from tests.e2e.conftest import in_process_llm

    llm = in_process_llm(**DENSE_SMOLLM_ARGS)
    yield llm
    llm.shutdown()
