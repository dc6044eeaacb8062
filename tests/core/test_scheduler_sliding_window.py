"""The scheduler over a KV cache manager with a sliding window (for every layer, or a hybrid model's windowed
group beside a full-attention one), without a model: outputs are those of plain decoding through speculative
decoding, preemption and prefix hits; every step the positions each request's next query sees hold its own tokens
(in every group) and every block is accounted for; a request longer than the whole cache runs, as it only ever
holds about a window."""
import random

import pytest

from pagedllm.core.kv_cache_groups import KVCacheGroup
from tests.core.helpers import (SpeculatingWorker, assert_no_leaks, make_request,
                                make_scheduler, run_to_completion)
from tests.core.test_scheduler_spec_decode import K, right_then_wrong

WINDOW = 5


def _requests():
    shared = list(range(1000, 1010))
    return [make_request(f"r{i}", shared + list(range(100 * i, 100 * i + 3 + i)), block_size=4, max_tokens=25,
                         ignore_eos=True) for i in range(4)]


# One group of every layer, windowed; or a full-attention group and a windowed one (core/kv_cache_groups.py).
HYBRID = (KVCacheGroup((1, 3), None), KVCacheGroup((0, 2), WINDOW))


# A pool of 8: two requests' prompts (4 blocks each under the window, the most a request holds) are admitted together
# and then outgrow it; with 7 the second waits for the first to finish, and nothing is preempted.
@pytest.mark.parametrize("cache", [dict(num_blocks=8, sliding_window=WINDOW),
                                   dict(num_blocks=16, kv_cache_groups=HYBRID)], ids=["window", "hybrid"])
def test_outputs_equal_plain_decoding_with_speculation_preemption_and_prefix_hits(cache):
    """4 requests of up to 38 tokens: 40 blocks a group without the window, more than the pool, which makes them
    preempt even with it. Each windowed group holds at most the window before a step and the step's slots, and
    gives blocks back (nulls in their place); a full-attention group keeps every block."""
    plain = make_scheduler(num_blocks=200, block_size=4)
    for r in _requests():
        plain.add_request(r)
    expected = run_to_completion(plain)

    tight = make_scheduler(block_size=4, max_num_batched_tokens=8, num_speculative_tokens=K, **cache)
    for r in _requests():
        tight.add_request(r)
    rng = random.Random(0)
    worker = SpeculatingWorker(lambda req_id, n: right_then_wrong(rng.randint(0, K), rng.randint(0, 1))(req_id, n)[:K])
    null = tight.kv_cache_manager.block_pool.null_block
    held = []  # per step and request, per group: (its blocks other than the null block, all its blocks)

    def count_held():
        held.extend([(sum(b is not null for b in blocks), len(blocks)) for blocks in group_blocks]
                    for group_blocks in tight.kv_cache_manager.req_to_blocks.values())
    assert worker.run(tight, count_held) == expected
    for g, group in enumerate(tight.kv_cache_manager.groups):
        counts = [request[g] for request in held]
        if group.sliding_window is None:
            assert all(num_held == num_blocks for num_held, num_blocks in counts)
        else:
            assert any(num_held < num_blocks for num_held, num_blocks in counts)
            assert max(num_held for num_held, _ in counts) <= -(-(WINDOW - 1 + 8 + K) // 4) + 1
    stats = tight.make_stats()
    assert tight.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_no_leaks(tight)


def test_a_request_longer_than_the_cache_runs_under_a_window():
    def run(sliding_window):
        scheduler = make_scheduler(num_blocks=6, block_size=4, max_num_batched_tokens=8,
                                   sliding_window=sliding_window)
        scheduler.add_request(make_request("long", list(range(30)), block_size=4, max_tokens=40, ignore_eos=True))
        tokens = run_to_completion(scheduler)
        assert_no_leaks(scheduler)
        return tokens["long"]

    assert len(run(WINDOW)) == 40  # 70 tokens, 18 blocks, in a cache of 6
    assert run(None) == []  # refused at admission: it would never fit
