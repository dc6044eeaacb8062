"""Allocate the per-layer paged KV cache."""

import math

import torch

from pagedllm.kv_cache_dtype import row_width
from pagedllm.layers.attention.backend import AttentionBackend, KVCache
from pagedllm.layers.attention.selector import get_attn_backend
from pagedllm.platforms.cpu import huge_page_zeros
from pagedllm.platforms.populate import populate_in_background


def kv_heads_per_rank(total_num_kv_heads: int, tp_size: int) -> int:
    """KV heads one tensor-parallel rank caches: its share, or one (replicated) when ranks outnumber heads."""
    return max(1, total_num_kv_heads // tp_size)


def allocate_kv_caches(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    backend: type[AttentionBackend] | None = None,
    populate: str = "background",
) -> list[KVCache]:
    """One ``(key_cache, value_cache)`` pair per layer, in the backend's layout, of ``dtype`` elements (the
    resolved kv_cache_dtype: an int8 cache's head rows have room for their scales, kv_cache_dtype.row_width).

    Zero-filled so that stale slots hold finite values for any backend. On CPU the zeros come from fresh
    anonymous memory in huge pages (platforms/cpu.huge_page_zeros): the OS hands out zero pages as they are
    first touched, so a multi-GiB cache costs nothing at start-up (torch.zeros would write every page, seconds
    for a few GiB), and decode attention streams it with fewer TLB misses. A background thread faults those pages
    in while the engine is idle (platforms/populate.py), so that steps do not pay for first touches; with
    ``populate="startup"`` (CacheConfig.kv_cache_populate) this returns once it has.
    """
    backend = backend or get_attn_backend()
    shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, row_width(head_size, dtype))
    caches = [(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(num_layers)]
    if torch.device(device).type == "cpu":
        thread = populate_in_background([tensor for pair in caches for tensor in pair])
        if populate == "startup" and thread is not None:
            thread.join()
    return caches


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    return huge_page_zeros(math.prod(shape) * dtype.itemsize).view(dtype).view(shape)
