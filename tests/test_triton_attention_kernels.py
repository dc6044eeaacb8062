"""The Triton kernels of the CUDA attention backend (pagedllm/layers/attention/triton_ops) against plain float32
attention over each request's contiguous keys and values: compiled for the GPU where torch sees one (the GPU check,
benchmarks/gpu_check.py, runs this module there), else run on CPU tensors by Triton's interpreter (CI).

Every cache is NaN wherever nothing was written, its requests' blocks are shuffled among spare ones, and the block
table's entries past each request's blocks name a NaN block: a kernel that reads a slot or a table entry it should
not puts NaN in its output.
"""

import pytest
import torch

# Without a GPU, tests/conftest.py has set TRITON_INTERPRET=1 before triton was imported: the kernels run on the CPU
# tensors here.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

pytest.importorskip("triton")

from pagedllm.layers.attention.triton_ops import paged_decode_attention, paged_prefill_attention, reshape_and_cache
from pagedllm.layers.attention.triton_ops.decode_attention import MAX_SPLITS, MIN_KEYS_PER_SPLIT, default_num_splits
from tests.attention_reference import reference_attention

FLOAT32_TOLERANCE = 1e-5
# A bf16 output is rounded to 8 significant bits (2^-9 of values up to ~4 here); the reference takes the cache's
# (and queries') bf16 values exactly, so only that rounding, and float32 queries' rounding to TF32 on a GPU, remain.
BFLOAT16_TOLERANCE = 2e-2


def _paged_context(seq_lens, num_kv_heads, head_size, block_size, cache_dtype, generator):
    """Caches holding random keys and values for requests of ``seq_lens`` positions, each request's blocks drawn in
    shuffled order from twice as many as needed (holes of unused blocks between them); every slot not written is
    NaN, and the table entries past a request's blocks name an unused (NaN) block. Returns the caches, the block
    table and each request's keys and values as the cache holds them, in float32."""
    blocks_needed = [-(-seq_len // block_size) for seq_len in seq_lens]
    num_blocks = 2 * sum(blocks_needed) + 1
    shuffled = torch.randperm(num_blocks, generator=generator).tolist()
    nan_block = shuffled.pop()
    block_table = torch.full((len(seq_lens), max(blocks_needed) + 2), nan_block, dtype=torch.int32)
    key_cache, value_cache = (torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"),
                                         dtype=cache_dtype) for _ in range(2))
    keys, values = [], []
    for i, (seq_len, num) in enumerate(zip(seq_lens, blocks_needed)):
        block_ids = torch.tensor([shuffled.pop() for _ in range(num)], dtype=torch.int32)
        block_table[i, :num] = block_ids
        positions = torch.arange(seq_len)
        slots = block_ids[positions // block_size].long() * block_size + positions % block_size
        for cache, stored in ((key_cache, keys), (value_cache, values)):
            rows = cache.view(-1, num_kv_heads, head_size)
            rows[slots] = torch.randn(seq_len, num_kv_heads, head_size, generator=generator).to(cache_dtype)
            stored.append(rows[slots].float())
    return key_cache, value_cache, block_table, keys, values


def _on_device(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """The kernels' arguments where they run (views stay views of a copy of their base: the strides are kept)."""
    return [tensor if DEVICE == "cpu" else _copy_view_to_device(tensor) for tensor in tensors]


def _copy_view_to_device(tensor: torch.Tensor) -> torch.Tensor:
    base = tensor if tensor._base is None else tensor._base
    return base.to(DEVICE).as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())


def _free_blocks_outside_window(block_table, seq_lens, query_lens, block_size, sliding_window):
    """Point each request's table entries for the blocks wholly before its first query row's window at the NaN
    block (its last entry), as a cache manager may free and reuse them: a kernel must not read them at all."""
    for i, (seq_len, query_len) in enumerate(zip(seq_lens, query_lens)):
        first_key = max(0, seq_len - query_len - sliding_window + 1)
        block_table[i, :first_key // block_size] = block_table[i, -1]


DECODE_CASES = {
    # seq_lens ending exactly at a block boundary, one past it, inside the first block, across several
    "one_split": dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, seq_lens=[16, 17, 5, 48],
                      num_splits=1),
    "three_splits": dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, seq_lens=[16, 17, 5, 48],
                         num_splits=3),
    "more_splits_than_blocks": dict(num_heads=4, num_kv_heads=4, head_size=128, block_size=32, seq_lens=[64, 65, 3],
                                    num_splits=8),
    "group_of_three_head_80_default_splits": dict(num_heads=6, num_kv_heads=2, head_size=80, block_size=16,
                                                  seq_lens=[33, 7], num_splits=None),
    "head_256": dict(num_heads=2, num_kv_heads=1, head_size=256, block_size=16, seq_lens=[40], num_splits=2),
    "sliding_window": dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, seq_lens=[50, 20, 7, 33],
                           num_splits=3, sliding_window=24),
    "soft_cap": dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=32, seq_lens=[45, 9], num_splits=2,
                     logits_soft_cap=1.5),
    # windows starting inside a block, past its first tile of keys
    "block_64_sliding_window": dict(num_heads=4, num_kv_heads=2, head_size=64, block_size=64, seq_lens=[64, 65, 130],
                                    num_splits=2, sliding_window=40),
    "empty_context": dict(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seq_lens=[0, 18], num_splits=2),
    # one split: stage 1 writes the output itself (zeros for the empty context), no merge
    "empty_context_one_split": dict(num_heads=4, num_kv_heads=2, head_size=64, block_size=16, seq_lens=[0, 18],
                                    num_splits=1),
}


@pytest.mark.parametrize("case", DECODE_CASES.values(), ids=DECODE_CASES.keys())
def test_decode_matchesreference_attention(case):
    _check_decode(**case, cache_dtype=torch.float32, query_dtype=torch.float32, tolerance=FLOAT32_TOLERANCE)


@pytest.mark.parametrize("num_splits", [1, 2])  # 1: stage 1 writes the bf16 output itself
@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
def test_decode_bfloat16_cache(query_dtype, num_splits):
    _check_decode(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, seq_lens=[30, 16], num_splits=num_splits,
                  cache_dtype=torch.bfloat16, query_dtype=query_dtype, tolerance=BFLOAT16_TOLERANCE)


def _check_decode(num_heads, num_kv_heads, head_size, block_size, seq_lens, num_splits, cache_dtype, query_dtype,
                  tolerance, sliding_window=None, logits_soft_cap=None):
    generator = torch.Generator().manual_seed(len(seq_lens) * head_size + num_heads)
    key_cache, value_cache, block_table, keys, values = _paged_context(
        seq_lens, num_kv_heads, head_size, block_size, cache_dtype, generator)
    if sliding_window is not None:
        _free_blocks_outside_window(block_table, seq_lens, [1] * len(seq_lens), block_size, sliding_window)
    query = torch.randn(len(seq_lens), num_heads, head_size, generator=generator).to(query_dtype)
    out = torch.full_like(query, float("nan"))
    scale = head_size**-0.5
    on_device = _on_device(query, key_cache, value_cache, block_table, torch.tensor(seq_lens, dtype=torch.int32), out)
    paged_decode_attention(*on_device, scale, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap,
                           num_splits=num_splits)
    out = on_device[-1].cpu()
    for i in range(len(seq_lens)):
        expected = reference_attention(query[i:i + 1], keys[i], values[i], scale, sliding_window, logits_soft_cap)
        torch.testing.assert_close(out[i:i + 1].float(), expected, atol=tolerance, rtol=tolerance)


def test_default_num_splits():
    """One split until the longest context has two splits' worth of keys; then each split keeps at least
    MIN_KEYS_PER_SPLIT keys of it, up to MAX_SPLITS; a sliding window counts as the context it bounds."""
    assert default_num_splits(2 * MIN_KEYS_PER_SPLIT - 1, 16, None) == 1
    assert default_num_splits(3 * MIN_KEYS_PER_SPLIT, 16, None) == 3
    assert default_num_splits(1_000_000, 16, None) == MAX_SPLITS
    assert default_num_splits(1_000_000, 16, MIN_KEYS_PER_SPLIT) == 1


PREFILL_REQUESTS = [(20, 13), (0, 9), (31, 1), (5, 40)]  # (cached prefix, chunk): one without prefix, one decode row

PREFILL_CASES = {
    "gqa_head_64": dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=16),
    "int32_query_start_loc": dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=32,
                                  query_start_loc_dtype=torch.int32),
    "group_1_head_128": dict(num_heads=4, num_kv_heads=4, head_size=128, block_size=32),
    "group_of_three_head_80": dict(num_heads=6, num_kv_heads=2, head_size=80, block_size=16),
    "head_256": dict(num_heads=2, num_kv_heads=1, head_size=256, block_size=32),
    "sliding_window": dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, sliding_window=12),
    "block_64": dict(num_heads=4, num_kv_heads=2, head_size=64, block_size=64, requests=[(70, 30), (0, 64), (64, 1)]),
    # A tile of 64 rows whose later rows see no key of the first key tile: their weights there must be 0, not NaN.
    "window_narrower_than_tile": dict(num_heads=2, num_kv_heads=2, head_size=64, block_size=16, sliding_window=5,
                                      requests=[(10, 70)]),
    "soft_cap": dict(num_heads=8, num_kv_heads=2, head_size=64, block_size=32, logits_soft_cap=1.5),
}


@pytest.mark.parametrize("case", PREFILL_CASES.values(), ids=PREFILL_CASES.keys())
def test_prefill_matchesreference_attention(case):
    _check_prefill(**{"requests": PREFILL_REQUESTS, **case}, cache_dtype=torch.float32, query_dtype=torch.float32,
                   tolerance=FLOAT32_TOLERANCE)


@pytest.mark.parametrize("query_dtype", [torch.bfloat16, torch.float32])
def test_prefill_bfloat16_cache(query_dtype):
    _check_prefill(num_heads=8, num_kv_heads=2, head_size=64, block_size=16, requests=[(16, 20), (3, 1)],
                   cache_dtype=torch.bfloat16, query_dtype=query_dtype, tolerance=BFLOAT16_TOLERANCE)


def _check_prefill(num_heads, num_kv_heads, head_size, block_size, requests, cache_dtype, query_dtype, tolerance,
                   sliding_window=None, logits_soft_cap=None, query_start_loc_dtype=torch.int64):
    generator = torch.Generator().manual_seed(len(requests) * head_size + num_heads)
    seq_lens = [prefix + chunk for prefix, chunk in requests]
    key_cache, value_cache, block_table, keys, values = _paged_context(
        seq_lens, num_kv_heads, head_size, block_size, cache_dtype, generator)
    query_lens = torch.tensor([chunk for _, chunk in requests])
    if sliding_window is not None:
        _free_blocks_outside_window(block_table, seq_lens, query_lens.tolist(), block_size, sliding_window)
    query_start_loc = torch.cat([torch.zeros(1, dtype=torch.int64), query_lens.cumsum(0)]).to(query_start_loc_dtype)
    query = torch.randn(int(query_start_loc[-1]), num_heads, head_size, generator=generator).to(query_dtype)
    out = torch.full_like(query, float("nan"))
    scale = head_size**-0.5
    on_device = _on_device(query, key_cache, value_cache, block_table, query_start_loc,
                           torch.tensor(seq_lens, dtype=torch.int32), out)
    paged_prefill_attention(*on_device, scale, int(query_lens.max()), sliding_window=sliding_window,
                            logits_soft_cap=logits_soft_cap)
    out = on_device[-1].cpu()
    for i in range(len(requests)):
        rows = slice(query_start_loc[i], query_start_loc[i + 1])
        expected = reference_attention(query[rows], keys[i], values[i], scale, sliding_window, logits_soft_cap)
        torch.testing.assert_close(out[rows].float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("source_dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                                      (torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32)])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_reshape_and_cache(source_dtype, cache_dtype, slot_dtype):
    """Keys and values taken as views of a fused QKV projection (rows not contiguous), three KV heads of 80 (neither a
    power of two), block size 16; a slot of -1 (padding) writes nothing, and no other slot changes. The projection
    has two rows more than slots, as a padded batch has: they are not written."""
    generator = torch.Generator().manual_seed(0)
    num_heads, num_kv_heads, head_size, block_size, num_blocks = 6, 3, 80, 16, 4
    slot_mapping = torch.tensor([17, 3, -1, 40, 63, 0], dtype=slot_dtype)
    num_tokens = len(slot_mapping) + 2
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, generator=generator).to(source_dtype)
    _, key, value = qkv.split([num_heads * head_size, num_kv_heads * head_size, num_kv_heads * head_size], dim=-1)
    key, value = key.view(num_tokens, num_kv_heads, head_size), value.view(num_tokens, num_kv_heads, head_size)
    assert not key.is_contiguous()
    key_cache, value_cache = (torch.full((num_blocks, block_size, num_kv_heads, head_size), float("nan"),
                                         dtype=cache_dtype) for _ in range(2))
    expected_key_cache, expected_value_cache = key_cache.clone(), value_cache.clone()
    written = slot_mapping >= 0
    slots = slot_mapping[written].long()
    expected_key_cache.view(-1, num_kv_heads, head_size)[slots] = key[:len(slot_mapping)][written].to(cache_dtype)
    expected_value_cache.view(-1, num_kv_heads, head_size)[slots] = value[:len(slot_mapping)][written].to(cache_dtype)
    key, value, key_cache, value_cache, slot_mapping = _on_device(key, value, key_cache, value_cache, slot_mapping)
    reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    key_cache, value_cache = key_cache.cpu(), value_cache.cpu()
    # Exact, but where float32 is narrowed to bf16: a GPU rounds to nearest as torch does, the interpreter truncates,
    # one bf16 unit in the last place (2^-7 of a value at most) apart.
    tolerance = 2**-7 if (source_dtype, cache_dtype) == (torch.float32, torch.bfloat16) else 0
    torch.testing.assert_close(key_cache, expected_key_cache, rtol=tolerance, atol=0, equal_nan=True)
    torch.testing.assert_close(value_cache, expected_value_cache, rtol=tolerance, atol=0, equal_nan=True)
