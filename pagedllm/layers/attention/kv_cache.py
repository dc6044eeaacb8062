"""Allocate the per-layer paged KV cache."""

import ctypes
import sys

import numpy as np
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

    Zero-filled so that stale slots hold finite values for any backend. On CPU the zeros come from numpy's
    calloc: the OS hands out zero pages as they are first touched, so a multi-GiB cache costs nothing at
    start-up (torch.zeros writes every page: ~3 s for 2.3 GiB here).
    """
    backend = backend or get_attn_backend(device)
    shape = backend.get_kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size)
    return [(_zeros(shape, dtype, device), _zeros(shape, dtype, device)) for _ in range(num_layers)]


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    # numpy has no bfloat16: allocate raw zero bytes of the right size and view them as dtype.
    raw = np.zeros((*shape[:-1], shape[-1] * dtype.itemsize), dtype=np.uint8)
    _ask_for_huge_pages(raw.ctypes.data, raw.nbytes)
    return torch.from_numpy(raw).view(dtype)


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14


def _ask_for_huge_pages(address: int, nbytes: int) -> None:
    """On Linux, back the cache with transparent huge pages where the system allows them for regions that ask
    (``madvise`` mode): each first touch of a fresh block then faults in 2 MiB instead of 4 KiB. A W1 run writes
    ~1.1 GB of new K/V, ~280k page faults with 4 KiB pages (write_kv was ~5% of a prefill step)."""
    if not sys.platform.startswith("linux"):
        return
    start = -(-address // _HUGE_PAGE) * _HUGE_PAGE
    end = (address + nbytes) // _HUGE_PAGE * _HUGE_PAGE
    if end > start:
        ctypes.CDLL(None).madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE)
