"""Every test runs with the native kernels' argument checks on (native/checks.py): a kernel call whose tensors do
not fit what its C side assumes fails there, naming the argument, instead of reading the wrong memory. Set before
pagedllm is imported, and inherited by the engine processes tests start."""
import os

os.environ.setdefault("PAGEDLLM_NATIVE_CHECKS", "1")
