"""KV cache groups (a hybrid model's full-attention and sliding-window layers, core/kv_cache_groups.py) without a
model: how layers are grouped and share cache tensors; the scheduler over a full group and a windowed one, through
speculative decoding, preemption and prefix hits, with the outputs of plain decoding, every step each group's
positions that the next query sees holding the request's own tokens and every block accounted for, the windowed
group holding about a window while the full one keeps the history; a prefix hit cut to what every group still
has cached."""
import random

from pagedllm.core.kv_cache_groups import KVCacheGroup, kv_cache_groups, stage_cache_tensors
from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.kv_cache_utils import make_block_hasher
from pagedllm.core.request import Request
from pagedllm.sampling_params import SamplingParams
from tests.core.helpers import SpeculatingWorker, assert_no_leaks, make_request, make_scheduler, run_to_completion
from tests.core.test_scheduler_spec_decode import K, right_then_wrong

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


def _requests():
    shared = list(range(1000, 1010))
    return [make_request(f"r{i}", shared + list(range(100 * i, 100 * i + 3 + i)), block_size=BS, max_tokens=25,
                         ignore_eos=True) for i in range(4)]


def test_outputs_equal_plain_decoding_with_speculation_preemption_and_prefix_hits():
    plain = make_scheduler(num_blocks=200, block_size=BS)
    for r in _requests():
        plain.add_request(r)
    expected = run_to_completion(plain)

    # 4 requests of up to 38 tokens: 80 blocks in two groups without the window; 16 make them preempt with it.
    tight = make_scheduler(num_blocks=16, block_size=BS, max_num_batched_tokens=8, num_speculative_tokens=K,
                           kv_cache_groups=GEMMA2)
    for r in _requests():
        tight.add_request(r)
    rng = random.Random(0)
    worker = SpeculatingWorker(lambda req_id, n: right_then_wrong(rng.randint(0, K), rng.randint(0, 1))(req_id, n)[:K])
    null = tight.kv_cache_manager.block_pool.null_block
    held = []  # per step and request: (its blocks in the full group, its blocks in the windowed group, not null)

    def count_held():
        for blocks, local in tight.kv_cache_manager.req_to_blocks.values():
            held.append((sum(b is not null for b in blocks), sum(b is not null for b in local), len(blocks)))
    assert worker.run(tight, count_held) == expected
    assert all(num_full == num_blocks for num_full, _, num_blocks in held)  # the full group keeps everything
    assert max(num_local for _, num_local, _ in held) <= -(-(WINDOW - 1 + 8 + K) // BS) + 1
    assert any(num_local < num_blocks for _, num_local, num_blocks in held)  # blocks out of the window went back
    stats = tight.make_stats()
    assert tight.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_no_leaks(tight)


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
