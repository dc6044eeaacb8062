"""Write a step's new keys and values into the paged KV cache (vLLM's reshape_and_cache_flash).

The cache of a layer is two tensors, ``key_cache`` and ``value_cache``, each ``[num_blocks, block_size,
num_kv_heads, head_size]`` and contiguous. The model runner gives every new token a cache slot ``s``; its head rows
go to block ``s // block_size`` at offset ``s % block_size``. A slot below zero marks a padding token (a CUDA graph
replayed over fewer tokens than it was captured for): it writes nothing, so no real slot is overwritten.

Grid: one program per token, writing all of the token's KV heads at once, a ``[num_kv_heads, head_size]`` tile
(padded to powers of two and masked). A token's head rows are consecutive in the cache, so each program writes one
run of memory; tokens are independent, so no ordering between programs is needed.
"""

import torch
import triton
import triton.language as tl

CACHE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _reshape_and_cache_kernel(
    key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
    key_stride_token, key_stride_head, value_stride_token, value_stride_head,
    cache_stride_block, cache_stride_slot, cache_stride_head,
    NUM_KV_HEADS: tl.constexpr, HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    PADDED_HEADS: tl.constexpr, PADDED_HEAD_SIZE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    heads = tl.arange(0, PADDED_HEADS)
    dims = tl.arange(0, PADDED_HEAD_SIZE)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_SIZE)[None, :]
    cache_offsets = (block * cache_stride_block + offset * cache_stride_slot
                     + heads[:, None] * cache_stride_head + dims[None, :])

    key = tl.load(key_ptr + token * key_stride_token + heads[:, None] * key_stride_head + dims[None, :], mask=mask)
    tl.store(key_cache_ptr + cache_offsets, key.to(tl.float32).to(key_cache_ptr.dtype.element_ty), mask=mask)
    value = tl.load(value_ptr + token * value_stride_token + heads[:, None] * value_stride_head + dims[None, :],
                    mask=mask)
    tl.store(value_cache_ptr + cache_offsets, value.to(tl.float32).to(value_cache_ptr.dtype.element_ty), mask=mask)


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      slot_mapping: torch.Tensor) -> None:
    """Store ``key[t]`` and ``value[t]`` (``[T, num_kv_heads, head_size]``, any float dtype, views allowed as long as
    each head row is contiguous) at cache slot ``slot_mapping[t]`` (int64 or int32), converted to the cache's dtype,
    for the first ``len(slot_mapping)`` tokens (rows of key and value past them, padding, are not read); tokens whose
    slot is negative are skipped."""
    num_tokens = slot_mapping.shape[0]
    _, num_kv_heads, head_size = key.shape
    if value.shape != key.shape or key.shape[0] < num_tokens or key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have one shape, with a row for "
                         f"each of the {num_tokens} slots, and each head row must be contiguous")
    check_cache(key_cache, value_cache, num_kv_heads, head_size)
    if num_tokens == 0:
        return
    _reshape_and_cache_kernel[(num_tokens,)](
        key, value, key_cache, value_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_SIZE=head_size, BLOCK_SIZE=key_cache.shape[1],
        PADDED_HEADS=triton.next_power_of_2(num_kv_heads), PADDED_HEAD_SIZE=triton.next_power_of_2(head_size),
    )


def check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int, head_size: int) -> None:
    """The kernels index both caches with the key cache's strides, which are those of a contiguous
    ``[num_blocks, block_size, num_kv_heads, head_size]`` tensor, and read its elements as plain floats (a one-byte
    cache's rows, which carry their scales, kv_cache_dtype.py, are not taken)."""
    if key_cache.dtype not in CACHE_DTYPES or value_cache.dtype != key_cache.dtype:
        raise ValueError(f"key_cache {key_cache.dtype} and value_cache {value_cache.dtype} must have one dtype of "
                         f"{CACHE_DTYPES}")
    expected = (key_cache.shape[0], key_cache.shape[1], num_kv_heads, head_size)
    if key_cache.shape != expected or value_cache.shape != expected:
        raise ValueError(f"key_cache {tuple(key_cache.shape)} and value_cache {tuple(value_cache.shape)} must both be "
                         f"[num_blocks, block_size, {num_kv_heads}, {head_size}]")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
