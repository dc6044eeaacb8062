"""KVCacheManager under a sliding window: blocks out of the window go back to the pool (null block in their place)
as a request advances, nothing leaks, and a prefix hit needs only the blocks of the window before its end."""
from pagedllm.core.kv_cache_manager import KVCacheManager
from tests.core.test_kv_cache_manager import BS, admit, req

WINDOW = 6  # a query at p sees p - 5 .. p: the blocks of the last two (cdiv(WINDOW - 1, BS)) before it


def _held(manager, request_id):
    """The request's block list as (null or not) and how many real blocks it holds."""
    null = manager.block_pool.null_block
    blocks = manager.req_to_blocks[request_id][0]
    return [b is null for b in blocks], sum(b is not null for b in blocks)


def test_blocks_out_of_the_window_are_freed_as_the_request_decodes():
    manager = KVCacheManager(num_blocks=12, block_size=BS, max_model_len=100, group_windows=(WINDOW,))
    a = req("a", list(range(10)))
    admit(manager, a)
    assert _held(manager, "a") == ([False] * 3, 3)  # the prompt's first query sees from position 0
    for token in range(100, 130):
        before = a.num_computed_tokens
        a.append_output_token_id(token)
        assert manager.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
        nulls, held = _held(manager, "a")
        # Exactly the blocks wholly before the window of the query at `before` are gone.
        assert nulls == [i < (before - WINDOW + 1) // BS for i in range(len(nulls))]
        assert held <= 3 and manager.block_pool.get_num_free_blocks() == 12 - held
    assert len(nulls) == 10  # 40 tokens in 10 blocks, in a pool of 12
    manager.free(a)
    assert manager.block_pool.get_num_free_blocks() == 12
    assert all(b.ref_cnt == 0 for b in manager.block_pool.blocks)


def test_without_a_window_every_block_is_kept():
    manager = KVCacheManager(num_blocks=12, block_size=BS, max_model_len=100)
    a = req("a", list(range(10)))
    admit(manager, a)
    for token in range(100, 120):
        a.append_output_token_id(token)
        manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
    assert _held(manager, "a") == ([False] * 8, 8)
    manager.free(a)


def test_a_hit_needs_only_the_blocks_of_the_window_before_its_end():
    manager = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=100, group_windows=(WINDOW,))
    pool = manager.block_pool
    a = req("a", list(range(26)))  # full blocks 0..5 cached
    admit(manager, a)
    a_blocks = list(manager.req_to_blocks["a"][0])
    manager.free(a)
    for block in a_blocks[:3]:  # evicted: the prefix's first blocks are gone from the cache
        pool._maybe_evict_cached_block(block)
    b = req("b", list(range(26)) + [99] * 5)
    hits, num_hit = admit(manager, b)
    assert num_hit == 24  # ends after block 5: its query at 24 sees from 19, in blocks 4 and 5
    assert hits[0][:4] == [pool.null_block] * 4 and hits[0][4:] == a_blocks[4:6]
    assert [b.ref_cnt for b in a_blocks[4:6]] == [1, 1]
    nulls, held = _held(manager, "b")
    assert nulls == [True] * 4 + [False] * 4 and pool.get_num_free_blocks() == 16 - held
    manager.free(b)
    assert pool.get_num_free_blocks() == 16 and all(blk.ref_cnt == 0 for blk in pool.blocks)

    # The same cache without a window: the first block is gone, so nothing hits.
    full = KVCacheManager(num_blocks=16, block_size=BS, max_model_len=100)
    full.block_pool = pool
    assert full.get_computed_blocks(req("c", list(range(26)) + [99] * 5))[1] == 0


def test_short_hits_and_a_failed_allocation_with_null_hits():
    manager = KVCacheManager(num_blocks=9, block_size=BS, max_model_len=100, group_windows=(WINDOW,))
    pool = manager.block_pool
    a = req("a", list(range(5)))  # one full block: fewer than the two a hit needs, from the first block on
    admit(manager, a)
    manager.free(a)
    hits, num_hit = manager.get_computed_blocks(req("b", list(range(9))))
    assert num_hit == 4 and pool.null_block not in hits[0]

    c = req("c", list(range(26)))
    admit(manager, c)
    manager.free(c)
    # A hit's null blocks take nothing from the pool: 2 hit blocks and 5 new ones fill 7 of the 9.
    fits = req("fits", list(range(26)) + list(range(200, 217)))
    hits, num_hit = manager.get_computed_blocks(fits)
    assert num_hit == 24 and hits[0].count(pool.null_block) == 4
    assert len(manager.allocate_slots(fits, fits.num_tokens - num_hit, hits, num_hit)[0]) == 5
    assert pool.get_num_free_blocks() == 2
    manager.free(fits)
    # One that does not fit changes nothing.
    free_before = pool.get_num_free_blocks()
    big = req("big", list(range(26)) + list(range(300, 340)))  # 11 blocks past its hit
    hits, num_hit = manager.get_computed_blocks(big)
    assert num_hit == 24
    assert manager.allocate_slots(big, big.num_tokens - num_hit, hits, num_hit) is None
    assert pool.get_num_free_blocks() == free_before == 9 and all(blk.ref_cnt == 0 for blk in pool.blocks)
