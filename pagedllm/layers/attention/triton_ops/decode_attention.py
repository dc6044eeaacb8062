"""Decode attention over the paged KV cache: one new query token per request, split along the context (flash
decoding).

Layout: ``query`` and ``out`` are ``[B, num_heads, head_size]``, one row per request. Request ``i``'s context is its
``seq_lens[i]`` positions, its own new token (already written by reshape_and_cache) the last of them, stored in
order in blocks ``block_table[i, 0]``, ``block_table[i, 1]``, ... of the caches (reshape_and_cache.py has their
layout). Only the blocks that hold positions the query sees are looked up, and inside them only those positions are
loaded (masked loads), so table entries past a request's blocks, blocks wholly before a sliding window (which a cache
manager may have freed) and never-written slots, whatever they hold (NaN included), never reach the result.

Grouped-query attention is folded into each program: the ``num_heads // num_kv_heads`` query heads of a group read
the same keys and values, so one program takes the whole group and reads each K/V block once for it instead of once
per query head; the group's rows make one ``[group, KEYS_PER_TILE]`` matrix product of scores per tile of keys,
padded to 16 rows (tl.dot's smallest) and masked.

Why split: a decode step does little arithmetic per request (one row of scores per head) but reads the whole
context. One program per (request, KV head) would leave most of the GPU idle for a small batch of long contexts, so
each context is divided into ``num_splits`` contiguous ranges of whole blocks, attended in parallel. Stage 1 (grid
``(B, num_kv_heads, num_splits)``) writes for each split its output normalized over its own keys and the log-sum-exp
of its scores, into float32 scratch; stage 2 (grid ``(B, num_heads)``) merges the splits, weighting each partial
output by ``exp(lse_split - lse_total)``, which is exactly the softmax over the whole context. A split whose range is
empty (fewer blocks than splits) has lse -inf and weight 0. With a single split (contexts shorter than two splits'
worth of keys) stage 1's output is the answer: it writes into ``out`` itself and stage 2 is not launched (the merge
of one split would multiply it by exp(0) and divide by 1: the same values). Each split walks its keys in tiles of
KEYS_PER_TILE with an online softmax (a running maximum and sum per row, the accumulator rescaled as the maximum
grows).

Numerics: scores, the online softmax and the accumulators are float32. Every tile is loaded and widened to float32
before it is used (the form the Triton interpreter, which the tests run, also computes correctly). The matrix
products take those float32 operands: with a 16-bit cache they run as TF32 on tensor cores, which is exact for the
keys and values (a bf16 or fp16 value fits TF32's 10-bit mantissa) and rounds only the softmax weights (and float32
queries) to 10 bits, finer than the bf16 weights of the usual flash attention; with a float32 cache they run in
IEEE float32, as a float32 model expects.
"""

import torch
import triton
import triton.language as tl

from pagedllm.layers.attention.triton_ops.reshape_and_cache import check_cache

# Keys per step of a split's walk: tl.dot's smallest tile and the smallest block size, so that a tile lies in one
# block. Tiles of a whole larger block would hold [block_size, head_size] float32 keys and values in registers, more
# than they have room for (a block of 64 spills, compiled for an H100).
KEYS_PER_TILE = 16
# Each split covers at least this many keys of the longest context: fewer would spend more on launching programs,
# writing partials and merging them than splitting gains.
MIN_KEYS_PER_SPLIT = 256
# Beyond this many splits a context's programs are already more than enough to fill the GPU for any batch.
MAX_SPLITS = 16


@triton.jit
def soft_cap(scores, cap):
    """``cap * tanh(scores / cap)``, with tanh(x) written as 2 * sigmoid(2x) - 1: not every Triton version has a
    tanh, and this form tends to +-1 for large |x| instead of dividing infinities."""
    return cap * (2.0 * tl.sigmoid(2.0 * scores / cap) - 1.0)


@triton.jit
def online_softmax_tile(scores, max_score, weight_sum):
    """One tile of scores (``[rows, keys]``, -inf where a key is not seen) into each row's running maximum and sum of
    exponentials: returns the new maximum, the factor that rescales what was accumulated under the old one, the
    tile's weights and the new sum. A row that has seen no key yet (maximum still -inf) gets weights and rescale 0,
    not exp(-inf - -inf)."""
    new_max = tl.maximum(max_score, tl.max(scores, 1))
    shift = tl.where(new_max == float("-inf"), 0.0, new_max)
    rescale = tl.exp(max_score - shift)
    weights = tl.exp(scores - shift[:, None])
    return new_max, rescale, weights, weight_sum * rescale + tl.sum(weights, 1)


@triton.jit
def _decode_split_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, seq_lens_ptr, partial_out_ptr, partial_lse_ptr,
    scale, sliding_window, logits_soft_cap,
    query_stride_request, query_stride_head, block_table_stride,
    cache_stride_block, cache_stride_slot, cache_stride_head,
    partial_out_stride_request, partial_out_stride_head, partial_out_stride_split,
    partial_lse_stride_request, partial_lse_stride_head,
    GROUP: tl.constexpr, PADDED_GROUP: tl.constexpr, HEAD_SIZE: tl.constexpr, PADDED_HEAD_SIZE: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, KEYS_PER_TILE: tl.constexpr, HAS_SLIDING_WINDOW: tl.constexpr,
    HAS_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Stage 1: one KV head's query group of one request over one split's range of context blocks."""
    request = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    seq_len = tl.load(seq_lens_ptr + request).to(tl.int32)
    if HAS_SLIDING_WINDOW:  # the query, at position seq_len - 1, sees the keys after seq_len - 1 - sliding_window
        first_key = tl.maximum(seq_len - sliding_window, 0)
    else:
        first_key = 0
    # The blocks holding the keys the query sees, shared out as evenly as whole blocks allow.
    first_block = first_key // BLOCK_SIZE
    end_block = tl.cdiv(seq_len, BLOCK_SIZE)
    blocks_per_split = tl.cdiv(end_block - first_block, num_splits)
    split_first_block = first_block + split * blocks_per_split
    split_end_block = tl.minimum(split_first_block + blocks_per_split, end_block)
    # This split's keys, from the tile holding the first the query sees to its last: every tile of the walk holds at
    # least one visible key, so each row's running maximum is finite from the first tile on.
    walk_start = tl.maximum(split_first_block * BLOCK_SIZE, first_key // KEYS_PER_TILE * KEYS_PER_TILE)
    walk_end = tl.minimum(split_end_block * BLOCK_SIZE, seq_len)

    rows = tl.arange(0, PADDED_GROUP)
    dims = tl.arange(0, PADDED_HEAD_SIZE)
    row_mask = rows < GROUP
    dim_mask = dims < HEAD_SIZE
    heads = kv_head * GROUP + rows
    query = tl.load(query_ptr + request.to(tl.int64) * query_stride_request + heads[:, None] * query_stride_head
                    + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)

    tile_keys = tl.arange(0, KEYS_PER_TILE)
    head_offsets = kv_head * cache_stride_head + dims[None, :]
    max_score = tl.full([PADDED_GROUP], float("-inf"), tl.float32)
    weight_sum = tl.zeros([PADDED_GROUP], tl.float32)
    acc = tl.zeros([PADDED_GROUP, PADDED_HEAD_SIZE], tl.float32)
    for tile_start in range(walk_start, walk_end, KEYS_PER_TILE):
        block = tl.load(block_table_ptr + request * block_table_stride + tile_start // BLOCK_SIZE).to(tl.int64)
        positions = tile_start + tile_keys
        key_mask = (positions >= first_key) & (positions < seq_len)
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        offsets = (block * cache_stride_block + (tile_start % BLOCK_SIZE + tile_keys)[:, None] * cache_stride_slot
                   + head_offsets)
        keys = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION) * scale
        if HAS_SOFT_CAP:
            scores = soft_cap(scores, logits_soft_cap)
        scores = tl.where(key_mask[None, :], scores, float("-inf"))

        max_score, rescale, weights, weight_sum = online_softmax_tile(scores, max_score, weight_sum)
        values = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, values, input_precision=DOT_PRECISION)

    # An empty split (no block in its range) has weight sum 0: its lse is -inf and its output 0, not 0 / 0.
    has_keys = weight_sum > 0
    safe_weight_sum = tl.where(has_keys, weight_sum, 1.0)
    lse = tl.where(has_keys, max_score + tl.log(safe_weight_sum), float("-inf"))
    partial_out = acc / safe_weight_sum[:, None]
    tl.store(partial_out_ptr + request * partial_out_stride_request + heads[:, None] * partial_out_stride_head
             + split * partial_out_stride_split + dims[None, :], partial_out.to(partial_out_ptr.dtype.element_ty),
             mask=row_mask[:, None] & dim_mask[None, :])
    tl.store(partial_lse_ptr + request * partial_lse_stride_request + heads * partial_lse_stride_head + split, lse,
             mask=row_mask)


@triton.jit
def _decode_merge_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr, num_splits,
    partial_out_stride_request, partial_out_stride_head, partial_out_stride_split,
    partial_lse_stride_request, partial_lse_stride_head, out_stride_request, out_stride_head,
    HEAD_SIZE: tl.constexpr, PADDED_HEAD_SIZE: tl.constexpr, PADDED_SPLITS: tl.constexpr,
):
    """Stage 2: one query head of one request, its splits' partial outputs weighted by their share of the softmax."""
    request = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, PADDED_SPLITS)
    dims = tl.arange(0, PADDED_HEAD_SIZE)
    split_mask = splits < num_splits
    dim_mask = dims < HEAD_SIZE

    lse = tl.load(partial_lse_ptr + request * partial_lse_stride_request + head * partial_lse_stride_head + splits,
                  mask=split_mask, other=float("-inf"))
    max_lse = tl.max(lse, 0)
    # Only a context of no tokens (a padding request) has every split empty: subtracting 0 keeps every weight 0.
    max_lse = tl.where(max_lse == float("-inf"), 0.0, max_lse)
    weights = tl.exp(lse - max_lse)
    partial_out = tl.load(partial_out_ptr + request * partial_out_stride_request + head * partial_out_stride_head
                          + splits[:, None] * partial_out_stride_split + dims[None, :],
                          mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    total = tl.sum(weights, 0)
    out = tl.sum(weights[:, None] * partial_out, 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + request.to(tl.int64) * out_stride_request + head * out_stride_head + dims,
             out.to(out_ptr.dtype.element_ty), mask=dim_mask)


def paged_decode_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           block_table: torch.Tensor, seq_lens: torch.Tensor, out: torch.Tensor, scale: float, *,
                           sliding_window: int | None = None, logits_soft_cap: float | None = None,
                           num_splits: int | None = None) -> None:
    """Write into ``out`` (``[B, num_heads, head_size]``) the attention of each request's one query row over its
    ``seq_lens[i]`` cached positions (int32 or int64 ``[B]``), read through ``block_table`` (``[B, max_blocks]``).

    ``sliding_window``: the query at position p sees only the keys after p - sliding_window. ``logits_soft_cap``:
    the scaled scores become cap * tanh(score / cap) (None or 0: not capped). ``num_splits``: how many ranges each
    context is divided into; None takes default_num_splits of the longest context this call can hold,
    ``block_table.shape[1]`` blocks (so no seq_lens value is read back from the device)."""
    num_kv_heads, head_size, block_size = check_attention_args(query, out, key_cache, value_cache, block_table)
    batch, num_heads, _ = query.shape
    if seq_lens.shape[0] != batch or block_table.shape[0] < batch:
        raise ValueError(f"query has {batch} rows, one per request: seq_lens has {seq_lens.shape[0]}, block_table "
                         f"{block_table.shape[0]} rows")
    if batch == 0:
        return
    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = default_num_splits(block_table.shape[1] * block_size, block_size, sliding_window)
    single = num_splits == 1  # stage 1 writes the output (module docstring)
    partial_out = out.unsqueeze(2) if single else torch.empty((batch, num_heads, num_splits, head_size),
                                                              dtype=torch.float32, device=query.device)
    partial_lse = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=query.device)
    padded_head_size = max(16, triton.next_power_of_2(head_size))

    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_table, seq_lens, partial_out, partial_lse,
        scale, sliding_window or 0, logits_soft_cap or 0.0,
        query.stride(0), query.stride(1), block_table.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        GROUP=group, PADDED_GROUP=max(16, triton.next_power_of_2(group)), HEAD_SIZE=head_size,
        PADDED_HEAD_SIZE=padded_head_size, BLOCK_SIZE=block_size, KEYS_PER_TILE=KEYS_PER_TILE,
        HAS_SLIDING_WINDOW=sliding_window is not None,
        HAS_SOFT_CAP=bool(logits_soft_cap), DOT_PRECISION=dot_precision(key_cache.dtype),
        num_warps=4 if padded_head_size <= 128 else 8,
    )
    if single:
        return
    _decode_merge_kernel[(batch, num_heads)](
        partial_out, partial_lse, out, num_splits,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1), out.stride(0), out.stride(1),
        HEAD_SIZE=head_size, PADDED_HEAD_SIZE=padded_head_size, PADDED_SPLITS=triton.next_power_of_2(num_splits),
    )


def default_num_splits(max_context: int, block_size: int, sliding_window: int | None) -> int:
    """Splits for contexts of up to ``max_context`` keys: as many as keep each at MIN_KEYS_PER_SPLIT keys or more of
    the longest one, between 1 and MAX_SPLITS. A sliding window bounds the keys read to the window plus the part of a
    block before it."""
    if sliding_window is not None:
        max_context = min(max_context, sliding_window + block_size)
    return max(1, min(MAX_SPLITS, max_context // MIN_KEYS_PER_SPLIT))


def dot_precision(cache_dtype: torch.dtype) -> str:
    """tl.dot's input precision for float32 operands widened from a cache of ``cache_dtype``: TF32 is exact for a
    16-bit cache's values, a float32 cache needs IEEE float32 (the module docstring has why)."""
    return "ieee" if cache_dtype == torch.float32 else "tf32"


def check_attention_args(query: torch.Tensor, out: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                         block_table: torch.Tensor) -> tuple[int, int, int]:
    """The attention kernels' assumptions about their arguments, checked on the host without reading device memory;
    returns ``(num_kv_heads, head_size, block_size)``."""
    num_heads, head_size = query.shape[1:]
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    check_cache(key_cache, value_cache, num_kv_heads, head_size)
    if out.shape != query.shape or query.stride(-1) != 1 or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} must have query's shape {tuple(query.shape)}, and each head row of "
                         "both must be contiguous")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size {block_size} must be a power of two of at least 16 (a tile of tl.dot)")
    if block_table.stride(-1) != 1:
        raise ValueError("each row of block_table must be contiguous")
    return num_kv_heads, head_size, block_size
