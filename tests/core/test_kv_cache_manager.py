"""KVCacheManager: prefix hits, full-block-only sharing, caching during decode, atomic allocation."""
from pagedllm.core.kv_cache_manager import KVCacheManager, longest_request, max_blocks
from pagedllm.core.kv_cache_utils import make_block_hasher
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

BS = 4


def req(req_id, tokens, **params):
    return Request(req_id, tokens, SamplingParams(**params), eos_token_id=0, block_hasher=make_block_hasher(BS))


def admit(manager, request):
    """Does what the scheduler does for a waiting request: prefix lookup, allocation of the rest, and the lookup
    counted in the hit rate."""
    hits, num_hit = manager.get_computed_blocks(request)
    blocks = manager.allocate_slots(request, request.num_tokens - num_hit, hits, num_hit)
    assert blocks is not None
    manager.record_prefix_cache_stats(request, num_hit)
    request.num_computed_tokens = request.num_tokens
    return hits, num_hit


def test_shared_prefix_hits_only_full_blocks():
    manager = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=100)
    a = req("a", list(range(10)))  # blocks: [0..3] [4..7] [8,9]
    admit(manager, a)
    b = req("b", list(range(10)) + [99])
    hits, num_hit = admit(manager, b)
    assert num_hit == 8
    a_blocks, b_blocks = manager.req_to_blocks["a"][0], manager.req_to_blocks["b"][0]
    assert [blk.block_id for blk in hits[0]] == [a_blocks[0].block_id, a_blocks[1].block_id]
    assert a_blocks[0].ref_cnt == a_blocks[1].ref_cnt == 2
    # The partial third block is never shared.
    assert a_blocks[2] is not b_blocks[2] and a_blocks[2].ref_cnt == b_blocks[2].ref_cnt == 1
    assert manager.prefix_cache_queries == 21 and manager.prefix_cache_hits == 8
    manager.free(a)
    manager.free(b)
    assert manager.block_pool.get_num_free_blocks() == 10


def test_whole_prompt_hit_still_recomputes_last_token():
    manager = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=100)
    a = req("a", list(range(8)))
    admit(manager, a)
    manager.free(a)
    b = req("b", list(range(8)))
    _, num_hit = admit(manager, b)
    assert num_hit == 4  # not 8: the last block holds the token whose logits are needed
    manager.free(b)


def test_lru_eviction_after_free_and_hit_protection():
    manager = KVCacheManager(num_blocks=6, block_size=BS, max_model_len=100)
    a = req("a", list(range(12)))  # 3 full blocks, last one recomputed later
    admit(manager, a)
    (a_ids,) = manager.get_block_ids("a")
    manager.free(a)
    pool = manager.block_pool
    # Tail first: a's last block will be evicted before its first.
    free_order = [b.block_id for b in pool.free_block_queue.get_all_free_blocks()]
    assert free_order[-3:] == a_ids[::-1]
    # A hit on a's first two blocks takes them out of the eviction queue.
    b = req("b", list(range(8)) + [50, 51])
    _, num_hit = admit(manager, b)
    assert num_hit == 8
    assert a_ids[0] not in [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()]
    manager.free(b)


def test_failed_allocation_changes_nothing():
    manager = KVCacheManager(num_blocks=4, block_size=BS, max_model_len=100)
    a = req("a", list(range(8)))
    admit(manager, a)
    manager.free(a)  # blocks cached, free
    pool = manager.block_pool
    before = [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in pool.blocks]
    free_before = [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()]
    big = req("big", list(range(8)) + list(range(100, 120)))  # 28 tokens = 7 blocks > 4
    hits, num_hit = manager.get_computed_blocks(big)
    assert num_hit == 8
    assert manager.allocate_slots(big, big.num_tokens - num_hit, hits, num_hit) is None
    assert [(blk.block_id, blk.ref_cnt, blk.block_hash) for blk in pool.blocks] == before
    assert [blk.block_id for blk in pool.free_block_queue.get_all_free_blocks()] == free_before
    assert "big" not in manager.req_to_blocks


def test_blocks_filled_during_decode_are_cached():
    manager = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=100)
    a = req("a", [1, 2, 3])
    admit(manager, a)
    for token in (4, 5):  # decode: the first block fills with token 4
        a.append_output_token_id(token)
        assert manager.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    first_block = manager.req_to_blocks["a"][0][0]
    assert first_block.block_hash == a.block_hashes[0]
    assert manager.block_pool.get_cached_block(a.block_hashes[0]) is first_block
    manager.free(a)


def test_prefix_caching_off_and_prompt_logprobs_get_no_hits():
    for enable_caching, params in ((False, {}), (True, {"prompt_logprobs": 1})):
        manager = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=100, enable_caching=enable_caching)
        a = req("a", list(range(9)))
        admit(manager, a)
        manager.free(a)
        b = req("b", list(range(9)), **params)
        assert admit(manager, b)[1] == 0
        manager.free(b)


def test_cache_salt_separates_prefixes():
    manager = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=100)
    salted = Request("s", list(range(9)), SamplingParams(), cache_salt="tenant-a",
                     block_hasher=make_block_hasher(BS))
    admit(manager, salted)
    manager.free(salted)
    plain = req("plain", list(range(9)))
    assert admit(manager, plain)[1] == 0
    manager.free(plain)


def test_a_reset_is_counted_when_it_empties_the_cache():
    """SchedulerStats.prefix_cache_resets (vLLM's PrefixCacheStats.reset), which restarts the logged hit rate: a reset
    refused while a request holds blocks is not one."""
    manager = KVCacheManager(num_blocks=10, block_size=BS, max_model_len=100)
    a = req("a", list(range(10)))
    admit(manager, a)
    assert manager.reset_prefix_cache() is False and manager.prefix_cache_resets == 0
    manager.free(a)
    assert manager.reset_prefix_cache() is True and manager.prefix_cache_resets == 1


def test_longest_request_is_the_last_length_whose_blocks_fit():
    """max_model_len -1's fit: full attention holds num_blocks whole blocks of tokens; a sliding-window group holds
    a window's blocks however long the request, so beside a full group it halves the room, and alone it fits the
    limit; a cache of no blocks fits nothing."""
    assert longest_request([None], 16, 22, 2048, 8192) == 352
    assert longest_request([None], 16, 22, 2048, 300) == 300  # the model's own length fits
    assert longest_request([None, None], 16, 22, 2048, 8192) == 176
    windowed = longest_request([None, 64], 16, 40, 32, 8192)
    assert max_blocks([None, 64], 16, windowed, 32) <= 40 < max_blocks([None, 64], 16, windowed + 1, 32)
    assert longest_request([64], 16, 40, 32, 8192) == 8192
    assert longest_request([None], 16, 0, 2048, 8192) == 0
