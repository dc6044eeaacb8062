"""The scheduler over a KV cache manager with a sliding window, without a model: outputs are those of plain
decoding through speculative decoding, preemption and prefix hits; every step the positions each request's next
query sees hold its own tokens and every block is accounted for; a request longer than the whole cache runs, as
it only ever holds about a window."""
import random

from tests.core.helpers import (SpeculatingWorker, assert_no_leaks, make_request,
                                make_scheduler, run_to_completion)
from tests.core.test_scheduler_spec_decode import K, right_then_wrong

WINDOW = 5


def _requests():
    shared = list(range(1000, 1010))
    return [make_request(f"r{i}", shared + list(range(100 * i, 100 * i + 3 + i)), block_size=4, max_tokens=25,
                         ignore_eos=True) for i in range(4)]


def test_outputs_equal_plain_decoding_with_speculation_preemption_and_prefix_hits():
    plain = make_scheduler(num_blocks=200, block_size=4)
    for r in _requests():
        plain.add_request(r)
    expected = run_to_completion(plain)

    # 4 requests of up to 38 tokens: 40 blocks without the window; 7 make them preempt even with it.
    tight = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=8, num_speculative_tokens=K,
                           sliding_window=WINDOW)
    for r in _requests():
        tight.add_request(r)
    rng = random.Random(0)
    worker = SpeculatingWorker(lambda req_id, n: right_then_wrong(rng.randint(0, K), rng.randint(0, 1))(req_id, n)[:K])
    null = tight.kv_cache_manager.block_pool.null_block
    null_seen = []  # per step: whether a request's blocks held the null block (blocks out of the window freed)
    assert worker.run(tight, lambda: null_seen.append(
        any(null in blocks for blocks, in tight.kv_cache_manager.req_to_blocks.values()))) == expected
    saw_null = any(null_seen)
    stats = tight.make_stats()
    assert saw_null and tight.num_preemptions > 0 and stats.prefix_cache_hits > 0
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
