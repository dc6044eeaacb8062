"""Allocate the per-layer paged KV cache."""

import torch

from pagedllm.layers.attention.backend import AttentionBackend, KVCache
from pagedllm.layers.attention.selector import get_attn_backend


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    backend: type[AttentionBackend] | None = None,
) -> list[KVCache]:
    """One ``(key_cache, value_cache)`` pair per layer, in the backend's layout.

    Zero-filled so that stale slots hold finite values for any backend.
    """
    backend = backend or get_attn_backend(device)
    shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
