"""Triton kernels of the CUDA attention backend: writing new keys and values into the paged KV cache, decode
attention (one query row per request, split along the context) and varlen prefill attention (every request's chunk
of query rows in one launch), all reading the cache through the block table.

This package is the only place that imports triton, so that importing pagedllm does not need it. ``@triton.jit``
chooses between compiling a kernel and interpreting it on CPU tensors when the kernel is defined, from the
``TRITON_INTERPRET`` environment variable: it must be set before this package is first imported for the interpreter
to take effect (the tests do so).
"""

from pagedllm.layers.attention.triton_ops.decode_attention import paged_decode_attention
from pagedllm.layers.attention.triton_ops.prefill_attention import paged_prefill_attention
from pagedllm.layers.attention.triton_ops.reshape_and_cache import reshape_and_cache

__all__ = ["paged_decode_attention", "paged_prefill_attention", "reshape_and_cache"]
