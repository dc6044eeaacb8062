"""KV cache groups (a hybrid model's full-attention and sliding-window layers, core/kv_cache_groups.py) without a
model: how layers are grouped and share cache tensors; a prefix hit cut to what every group still has cached. (The
scheduler over such groups: test_scheduler_sliding_window.py.)"""

from pagedllm.core.kv_cache_groups import KVCacheGroup, kv_cache_groups, stage_cache_tensors
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import make_block_hasher
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams

WINDOW, BS = 5, 4
GEMMA2 = (KVCacheGroup((1, 3), None), KVCacheGroup((0, 2), WINDOW))


def test_layers_go_in_groups_of_one_kind_and_equal_size_sharing_cache_tensors():
    assert kv_cache_groups([None] * 3) == (KVCacheGroup((0, 1, 2), None),)
    assert kv_cache_groups([8, 8, 16]) == (KVCacheGroup((0, 1, 2), 16),)  # all windowed: one group, the largest
    assert kv_cache_groups([WINDOW, None, WINDOW, None]) == GEMMA2  # Gemma 2: local and global alternating
    # Gemma 3: five local layers to one global; the local ones in groups as large as the global one's
    groups = kv_cache_groups([None if i % 6 == 5 else 512 for i in range(12)])
    assert groups == (KVCacheGroup((5, 11), None), KVCacheGroup((0, 1), 512), KVCacheGroup((2, 3), 512),
                      KVCacheGroup((4, 6), 512), KVCacheGroup((7, 8), 512), KVCacheGroup((9, 10), 512))
    # layer j of every group keeps its K/V in tensor j; a pipeline stage holds the tensors its layers use
    assert stage_cache_tensors(groups, 0, 12) == [0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 1]
    assert stage_cache_tensors(groups, 4, 6) == [0, 0]
    assert stage_cache_tensors((), 4, 6) == [0, 1]  # no groups: a tensor per layer


def _req(req_id, tokens):
    return Request(req_id, tokens, SamplingParams(), eos_token_id=0, block_hasher=make_block_hasher(BS))


def test_a_prefix_hit_is_cut_to_what_every_group_has_cached():
    manager = KVCacheManager(num_blocks=40, block_size=BS, max_model_len=100, group_windows=(None, WINDOW))
    a = _req("a", list(range(26)))  # full blocks 0..5 cached in each group
    assert manager.allocate_slots(a, a.num_tokens) is not None
    a.num_computed_tokens = a.num_tokens
    a_full, a_local = (list(blocks) for blocks in manager.req_to_blocks["a"])
    assert not set(map(id, a_full)) & set(map(id, a_local))  # each group its own blocks
    manager.free(a)
    b = _req("b", list(range(26)) + [99] * 5)
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 24 and hits[0] == a_full[:6]
    assert hits[1] == [manager.block_pool.null_block] * 5 + a_local[5:6]  # the window needs its last block only
    manager.block_pool._maybe_evict_cached_block(a_local[5])  # the windowed group's copy of block 5 goes
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 20 and hits[0] == a_full[:5] and hits[1] == [manager.block_pool.null_block] * 4 + a_local[4:5]
    new = manager.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit)
    assert [len(blocks) for blocks in new] == [3, 3] and all(block.ref_cnt == 1 for block in a_full[:5])
    manager.free(b)
    assert manager.block_pool.get_num_free_blocks() == 40


def test_a_hit_block_at_the_free_queues_front_is_no_other_groups_new_block():
    """Every group's hit blocks leave the free queue before any group takes new blocks from it: a windowed group's
    hit at the queue's front must not also become the full-attention group's fresh block (held by both, one
    overwriting the other's cached K/V)."""
    manager = KVCacheManager(num_blocks=12, block_size=BS, max_model_len=100, group_windows=(None, WINDOW))
    a = _req("a", list(range(100, 108)))  # two full blocks cached in each group, then freed
    manager.allocate_slots(a, a.num_tokens)
    a.num_computed_tokens = a.num_tokens
    manager.free(a)
    c = _req("c", list(range(500, 516)))  # an unrelated request cycles the other blocks: a's are first to go
    manager.allocate_slots(c, c.num_tokens)
    c.num_computed_tokens = c.num_tokens
    manager.free(c)
    b = _req("b", list(range(100, 108)) + list(range(900, 909)))  # a's prefix and more
    hits, num_hit = manager.get_computed_blocks(b)
    assert num_hit == 8
    assert manager.allocate_slots(b, b.num_tokens - num_hit, hits, num_hit) is not None
    full, local = manager.req_to_blocks["b"]
    null = manager.block_pool.null_block
    assert not {id(block) for block in full} & {id(block) for block in local if block is not null}
    assert all(block.ref_cnt == 1 for block in full + local if block is not null)
    assert all(block.block_hash is not None for block in full[:2] + [local[1]])  # the hits still cached
    manager.free(b)
    assert manager.block_pool.get_num_free_blocks() == 12
