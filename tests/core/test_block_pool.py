"""BlockPool and the free queue: LRU order, O(1) removal, eviction, and refusal while blocks are in use."""
import pytest

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_utils import FreeKVCacheBlockQueue, KVCacheBlock, hash_block_tokens


def ids(blocks):
    return [b.block_id for b in blocks]


def test_free_queue_remove_from_middle_and_append_keeps_order():
    blocks = [KVCacheBlock(i) for i in range(5)]
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3, 4]
    queue.append(blocks[2])
    assert ids(queue.get_all_free_blocks()) == [0, 1, 3, 4, 2]
    assert ids(queue.popleft_n(2)) == [0, 1]
    assert queue.popleft().block_id == 3
    assert queue.num_free_blocks == 2
    with pytest.raises(ValueError):
        queue.popleft_n(3)
    with pytest.raises(RuntimeError):
        queue.remove(blocks[0])  # not in the queue


def test_get_new_blocks_takes_least_recently_freed_first():
    pool = BlockPool(6)
    a = pool.get_new_blocks(3)
    b = pool.get_new_blocks(3)
    assert all(blk.ref_cnt == 1 for blk in a + b)
    pool.free_blocks(b)
    pool.free_blocks(reversed(a))
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 4, 5, 2, 1, 0]
    reused = pool.get_new_blocks(4)
    assert ids(reused) == [3, 4, 5, 2]
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    pool.free_blocks(reused)


def test_reused_evicted_block_loses_its_hash():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(2)
    h0 = hash_block_tokens(None, list(range(16)))
    h1 = hash_block_tokens(h0, list(range(16, 32)))
    pool.cache_full_blocks(blocks, [h0, h1], 0, 2)
    pool.free_blocks(reversed(blocks))  # tail first: block 1 is evicted before block 0
    assert pool.get_cached_block(h0) is blocks[0]
    [reused] = pool.get_new_blocks(1)
    assert reused is blocks[1]
    assert reused.block_hash is None and pool.get_cached_block(h1) is None
    assert pool.get_cached_block(h0) is blocks[0]
    pool.free_blocks([reused])


def test_blocks_holding_the_same_tokens_are_all_cached():
    """Two requests that computed one prefix at once hold a block each with its hash, both cached (vLLM's
    BlockHashToBlockMap): once one is evicted, a hit still finds the other."""
    pool = BlockPool(2)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    h = hash_block_tokens(None, list(range(16)))
    pool.cache_full_blocks(first, [h], 0, 1)
    pool.cache_full_blocks(second, [h], 0, 1)
    assert second[0].block_hash == h
    pool.free_blocks(first)
    assert pool.get_new_blocks(1) == first and first[0].block_hash is None  # evicted
    assert pool.get_cached_block(h) is second[0]
    pool.free_blocks(first + second)
    assert pool.reset_prefix_cache() and pool.get_cached_block(h) is None


def test_touch_takes_a_cached_block_out_of_the_eviction_queue():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(3)
    h = hash_block_tokens(None, [1] * 16)
    pool.cache_full_blocks(blocks, [h], 0, 1)
    pool.free_blocks(blocks)
    pool.touch([blocks[0]])
    assert blocks[0].ref_cnt == 1
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2]
    taken = pool.get_new_blocks(2)
    assert ids(taken) == [1, 2]
    pool.free_blocks(taken + [blocks[0]])
    assert pool.get_num_free_blocks() == 3


def test_reset_prefix_cache_refused_while_blocks_in_use():
    pool = BlockPool(2)
    blocks = pool.get_new_blocks(1)
    h = hash_block_tokens(None, [7] * 16)
    pool.cache_full_blocks(blocks, [h], 0, 1)
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(h) is blocks[0]
    pool.free_blocks(blocks)
    assert pool.reset_prefix_cache() is True
    assert pool.get_cached_block(h) is None and blocks[0].block_hash is None


def test_reset_hands_out_blocks_in_id_order_again():
    """After a reset the pool reuses the blocks used before (memory already mapped) before untouched ones."""
    pool = BlockPool(8)
    used = pool.get_new_blocks(3)
    pool.free_blocks(reversed(used))
    assert ids(pool.get_new_blocks(1)) == [3]  # without a reset: least recently freed, the never-used first
    pool.free_blocks([pool.blocks[3]])
    assert pool.reset_prefix_cache() is True
    assert ids(pool.free_block_queue.get_all_free_blocks()) == list(range(8))
    assert ids(pool.get_new_blocks(4)) == [0, 1, 2, 3]
    assert pool.get_num_free_blocks() == 4


def test_block_hashes_are_chained_stable_and_salted():
    a = hash_block_tokens(None, [1, 2, 3])
    assert a == hash_block_tokens(None, [1, 2, 3])  # not Python's per-process hash()
    assert len(a) == 32
    assert hash_block_tokens(a, [4]) != hash_block_tokens(None, [4])
    assert hash_block_tokens(None, [1, 2, 3], ("salt",)) != a
    assert hash_block_tokens(None, [1, 2, 3], ("salt",)) != hash_block_tokens(None, [1, 2, 3], ("other",))
