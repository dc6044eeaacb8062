"""Prefill attention over the paged KV cache: every request's chunk of new query rows in one launch (varlen,
chunked prefill).

Layout: ``query`` and ``out`` are ``[T, num_heads, head_size]``; request ``i`` owns rows
``query_start_loc[i]:query_start_loc[i+1]``, its newest ``q_len`` tokens, whose keys and values reshape_and_cache has
already written. So the cache holds the request's whole context, ``seq_lens[i]`` positions: a cached prefix of
``seq_lens[i] - q_len`` positions (earlier chunks, or blocks shared through the prefix cache), then this chunk. Row
``j`` sits at position ``p = seq_lens[i] - q_len + j`` and attends to every position up to ``p``: the whole prefix
and, causally, the chunk up to itself. All keys and values are read from the cache through ``block_table``, the
chunk's own included, so a chunk sees the same (possibly rounded) values an earlier step's tokens do. A request of one
row (a decode token batched into a prefill step) is the case ``q_len = 1``.

Grid: ``(cdiv(max_query_len, queries_per_tile), B, num_kv_heads)``. One program takes ``queries_per_tile``
consecutive query rows of one request together with all the query heads of one KV head's group: its tile of rows
(TILE_ROWS below) holds, row ``r``, query ``r // group`` of the tile in head ``r % group``. Folding the group in
makes every key and value tile, read once, serve ``group`` times as many rows (grouped-query attention's whole point)
and fills tl.dot's rows even for a one-row request. Programs whose rows lie past their request's ``q_len`` return at
once (a batch of one long chunk and many short ones launches mostly such programs, which cost a few loads each).

Each program walks the keys its rows may see in tiles of ``KEYS_PER_TILE`` consecutive positions, each key's block
looked up in the block table (a tile may span blocks, or part of one). The walk starts at the block holding the
first key the tile's earliest row sees (0, or where that row's sliding window begins: blocks wholly before it are
never loaded, as a cache manager may have freed them) and ends at its last row's own position. The causal and window
masks set scores to -inf; under a window narrower than the tile's span of rows, a later row may see no key of the
first tiles: its running maximum stays -inf, and the exponentials are then taken relative to 0, giving weights 0
instead of NaN. Loads are masked to the positions up to the tile's last row's, all in the request's blocks: table
entries past them and never-written slots are never read.

Numerics (float32 accumulation; float32 tl.dot operands, TF32 over a 16-bit cache, IEEE over a float32 one) as in
decode_attention.py, whose docstring has why.
"""

import torch
import triton
import triton.language as tl

from pagedllm.layers.attention.triton_ops.decode_attention import (check_attention_args, dot_precision,
                                                                   online_softmax_tile, soft_cap)

# Rows of a tile (query rows times the group's heads) and keys per step of its walk. The rows are halved for a head
# of 256 and again for a float32 cache (whose IEEE products hold more in registers), keeping the float32 tiles of
# query, scores, keys and accumulator within the registers of the launch's warps: checked by compiling for an H100
# (little or no spilling), not tuned by timing on one.
TILE_ROWS = 64
KEYS_PER_TILE = 32


@triton.jit
def _prefill_kernel(
    query_ptr, key_cache_ptr, value_cache_ptr, block_table_ptr, query_start_loc_ptr, seq_lens_ptr, out_ptr,
    scale, sliding_window, logits_soft_cap,
    query_stride_token, query_stride_head, out_stride_token, out_stride_head, block_table_stride,
    cache_stride_block, cache_stride_slot, cache_stride_head,
    GROUP: tl.constexpr, QUERIES_PER_TILE: tl.constexpr, TILE_ROWS: tl.constexpr, KEYS_PER_TILE: tl.constexpr,
    HEAD_SIZE: tl.constexpr, PADDED_HEAD_SIZE: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    HAS_SLIDING_WINDOW: tl.constexpr, HAS_SOFT_CAP: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """One tile of a request's query rows, each with its KV head's group of query heads, over the keys they see."""
    query_tile = tl.program_id(0)
    request = tl.program_id(1)
    kv_head = tl.program_id(2)

    query_start = tl.load(query_start_loc_ptr + request).to(tl.int32)
    query_len = tl.load(query_start_loc_ptr + request + 1).to(tl.int32) - query_start
    first_query = query_tile * QUERIES_PER_TILE
    if first_query >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + request).to(tl.int32)
    prefix_len = seq_len - query_len

    rows = tl.arange(0, TILE_ROWS)
    dims = tl.arange(0, PADDED_HEAD_SIZE)
    query_index = first_query + rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    row_mask = (rows < QUERIES_PER_TILE * GROUP) & (query_index < query_len)
    dim_mask = dims < HEAD_SIZE
    positions = prefix_len + query_index
    tokens = (query_start + query_index).to(tl.int64)
    query = tl.load(query_ptr + tokens[:, None] * query_stride_token + heads[:, None] * query_stride_head
                    + dims[None, :], mask=row_mask[:, None] & dim_mask[None, :], other=0.0).to(tl.float32)

    key_end = prefix_len + tl.minimum(first_query + QUERIES_PER_TILE, query_len)
    if HAS_SLIDING_WINDOW:  # the earliest row, at prefix_len + first_query, sees the keys after it - sliding_window
        first_block = tl.maximum(prefix_len + first_query - sliding_window + 1, 0) // BLOCK_SIZE
    else:
        first_block = 0

    key_offsets = tl.arange(0, KEYS_PER_TILE)
    max_score = tl.full([TILE_ROWS], float("-inf"), tl.float32)
    weight_sum = tl.zeros([TILE_ROWS], tl.float32)
    acc = tl.zeros([TILE_ROWS, PADDED_HEAD_SIZE], tl.float32)
    for tile_start in range(first_block * BLOCK_SIZE, key_end, KEYS_PER_TILE):
        key_positions = tile_start + key_offsets
        key_mask = key_positions < key_end
        blocks = tl.load(block_table_ptr + request * block_table_stride + key_positions // BLOCK_SIZE,
                         mask=key_mask, other=0).to(tl.int64)
        offsets = (blocks[:, None] * cache_stride_block + (key_positions % BLOCK_SIZE)[:, None] * cache_stride_slot
                   + kv_head * cache_stride_head + dims[None, :])
        kv_mask = key_mask[:, None] & dim_mask[None, :]
        keys = tl.load(key_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        scores = tl.dot(query, tl.trans(keys), input_precision=DOT_PRECISION) * scale
        if HAS_SOFT_CAP:
            scores = soft_cap(scores, logits_soft_cap)
        visible = key_mask[None, :] & (key_positions[None, :] <= positions[:, None])
        if HAS_SLIDING_WINDOW:
            visible = visible & (key_positions[None, :] > positions[:, None] - sliding_window)
        scores = tl.where(visible, scores, float("-inf"))

        max_score, rescale, weights, weight_sum = online_softmax_tile(scores, max_score, weight_sum)
        values = tl.load(value_cache_ptr + offsets, mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * rescale[:, None] + tl.dot(weights, values, input_precision=DOT_PRECISION)

    out = acc / tl.where(weight_sum > 0, weight_sum, 1.0)[:, None]
    tl.store(out_ptr + tokens[:, None] * out_stride_token + heads[:, None] * out_stride_head + dims[None, :],
             out.to(out_ptr.dtype.element_ty), mask=row_mask[:, None] & dim_mask[None, :])


def paged_prefill_attention(query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            block_table: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                            out: torch.Tensor, scale: float, max_query_len: int, *, sliding_window: int | None = None,
                            logits_soft_cap: float | None = None) -> None:
    """Write into ``out`` (``[T, num_heads, head_size]``) the attention of every request's query rows (request
    ``i``'s are ``query_start_loc[i]:query_start_loc[i+1]``, int32 or int64 ``[B+1]``, at most ``max_query_len`` of
    them) over its ``seq_lens[i]`` cached positions, read through ``block_table`` (``[B, max_blocks]``), each row
    causally up to its own position.

    ``sliding_window``: the row at position p sees only the keys after p - sliding_window. ``logits_soft_cap``: the
    scaled scores become cap * tanh(score / cap) (None or 0: not capped)."""
    num_kv_heads, head_size, block_size = check_attention_args(query, out, key_cache, value_cache, block_table)
    batch = query_start_loc.shape[0] - 1
    if batch == 0 or max_query_len == 0:
        return
    if seq_lens.shape[0] != batch or block_table.shape[0] < batch:
        raise ValueError(f"query_start_loc describes {batch} requests: seq_lens has {seq_lens.shape[0]}, block_table "
                         f"{block_table.shape[0]} rows")
    group = query.shape[1] // num_kv_heads
    padded_head_size = max(16, triton.next_power_of_2(head_size))
    tile_rows = TILE_ROWS // (2 if padded_head_size > 128 else 1) // (2 if key_cache.dtype == torch.float32 else 1)
    tile_rows = max(tile_rows, triton.next_power_of_2(group))
    queries_per_tile = tile_rows // group

    _prefill_kernel[(triton.cdiv(max_query_len, queries_per_tile), batch, num_kv_heads)](
        query, key_cache, value_cache, block_table, query_start_loc, seq_lens, out,
        scale, sliding_window or 0, logits_soft_cap or 0.0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), block_table.stride(0),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        GROUP=group, QUERIES_PER_TILE=queries_per_tile, TILE_ROWS=tile_rows,
        KEYS_PER_TILE=KEYS_PER_TILE, HEAD_SIZE=head_size, PADDED_HEAD_SIZE=padded_head_size,
        BLOCK_SIZE=block_size, HAS_SLIDING_WINDOW=sliding_window is not None, HAS_SOFT_CAP=bool(logits_soft_cap),
        DOT_PRECISION=dot_precision(key_cache.dtype), num_warps=4 if padded_head_size <= 64 else 8,
    )
