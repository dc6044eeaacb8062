"""Property tests: random add/abort/step sequences keep every block accounted for, and every request ends; and,
over every KV cache layout (full attention, one sliding window, windowed groups beside a full one) with drafts and
lookahead slots, every computed position holds its request's own token (what a prefix hit or a freed block would
corrupt)."""
import random

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedllm.core.kv_cache_groups import KVCacheGroup
from pagedllm.core.request import RequestStatus
from tests.core.helpers import (SpeculatingWorker, abort, assert_block_invariants, assert_no_leaks,
                                deterministic_token, make_request, make_scheduler, step)

BLOCK_SIZE = 4
SHARED_PREFIXES = [list(range(1000, 1012)), list(range(2000, 2020)), []]

add_op = st.tuples(st.just("add"), st.integers(0, len(SHARED_PREFIXES) - 1), st.integers(1, 14),
                   st.integers(1, 30), st.integers(0, 3))
abort_op = st.tuples(st.just("abort"), st.integers(0, 1000))
step_op = st.tuples(st.just("step"))
operations = st.lists(st.one_of(add_op, abort_op, step_op, step_op), min_size=10, max_size=60)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, num_blocks=st.integers(10, 24), budget=st.sampled_from([8, 16, 64]),
       policy=st.sampled_from(["fcfs", "priority"]), caching=st.booleans(), prefill_cap=st.sampled_from([0, 1, 5]))
def test_random_workloads_keep_blocks_accounted_for(ops, num_blocks, budget, policy, caching, prefill_cap):
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=budget,
                               max_num_seqs=6, max_model_len=64, enable_prefix_caching=caching, policy=policy,
                               max_prefill_tokens_with_decodes=prefill_cap)
    added, ended = [], set()

    def collect(outputs):
        for out in outputs.outputs:
            if out.finish_reason is not None:
                ended.add(out.request_id)

    for op in ops:
        if op[0] == "add":
            _, prefix_idx, unique_len, max_tokens, priority = op
            req_id = f"r{len(added)}"
            prompt = SHARED_PREFIXES[prefix_idx] + list(range(5000 + 100 * len(added), 5000 + 100 * len(added)
                                                             + unique_len))
            scheduler.add_request(make_request(req_id, prompt, block_size=BLOCK_SIZE, max_tokens=max_tokens,
                                               priority=priority, ignore_eos=True))
            added.append(req_id)
        elif op[0] == "abort" and added:
            req_id = added[op[1] % len(added)]
            if req_id in scheduler.requests:
                abort(scheduler, req_id)
                ended.add(req_id)
        else:
            decoding = {r.request_id for r in scheduler.running
                        if r.num_computed_tokens >= max(r.num_prompt_tokens, r.num_tokens - 1)}
            out, outputs = step(scheduler)
            collect(outputs)
            if prefill_cap and decoding & set(out.num_scheduled_tokens):
                assert sum(n for req_id, n in out.num_scheduled_tokens.items() if req_id not in decoding) <= prefill_cap
        assert_block_invariants(scheduler)
        for request in scheduler.running:
            assert request.status == RequestStatus.RUNNING

    for _ in range(2000):
        if not scheduler.has_requests():
            break
        collect(step(scheduler)[1])
        assert_block_invariants(scheduler)
    event(f"preempted: {scheduler.num_preemptions > 0}")
    assert set(added) == ended, "every request terminates"
    assert_no_leaks(scheduler)



def _random_workload(seed: int) -> None:
    """One random workload (its layout, sizes, policy and drafts drawn from ``seed``) through a content-checking
    worker: after every add, finish or step each computed position holds its request's own token in every group;
    at the end nothing leaks."""
    rng = random.Random(seed)
    block_size, window = rng.choice([2, 4]), rng.choice([3, 5, 8, 9])
    layout = rng.choice([{}, {"sliding_window": window},
                         {"kv_cache_groups": (KVCacheGroup((1,), None), KVCacheGroup((0,), window))},
                         {"kv_cache_groups": (KVCacheGroup((2,), None), KVCacheGroup((0,), window),
                                              KVCacheGroup((1,), window))}])
    num_spec = rng.choice([0, 0, 3])
    lookahead = rng.choice([0, 2]) if num_spec else 0
    scheduler = make_scheduler(num_blocks=rng.randint(14, 40), block_size=block_size,
                               max_num_batched_tokens=rng.choice([6, 8, 16, 64]), max_num_seqs=5, max_model_len=60,
                               enable_prefix_caching=rng.random() < 0.7, policy=rng.choice(["fcfs", "priority"]),
                               long_prefill_token_threshold=rng.choice([0, 0, 3, 5]), num_speculative_tokens=num_spec,
                               num_lookahead_tokens=lookahead, **layout)
    acceptance = rng.random()

    def draft_fn(req_id: str, num_tokens: int) -> list[int]:  # each draft right with the workload's chance
        return [deterministic_token(req_id, num_tokens + i) + (rng.random() >= acceptance) for i in range(num_spec)]

    worker = SpeculatingWorker(draft_fn, num_lookahead_tokens=lookahead)
    prefixes = [list(range(1000, 1000 + rng.randint(3, 14))), list(range(2000, 2000 + rng.randint(3, 22))), []]

    def check() -> None:
        assert_block_invariants(scheduler)
        worker.assert_computed_tokens_are_in_the_cache(scheduler)

    added = []
    for _ in range(rng.randint(10, 60)):
        op = rng.random()
        if op < 0.3:
            req_id, start = f"r{len(added)}", 5000 + 100 * len(added)
            prompt = rng.choice(prefixes) + list(range(start, start + rng.randint(1, 14)))
            scheduler.add_request(make_request(req_id, prompt, block_size=block_size, max_tokens=rng.randint(1, 25),
                                               priority=rng.randint(0, 3), ignore_eos=True))
            added.append(req_id)
        elif op < 0.4 and added:
            req_id = rng.choice(added)
            if req_id in scheduler.requests:
                scheduler.finish_requests(req_id, rng.choice([RequestStatus.FINISHED_ABORTED,
                                                              RequestStatus.FINISHED_STOPPED]))
        else:
            worker.step(scheduler)
        check()
    for _ in range(3000):
        if not scheduler.has_requests():
            break
        worker.step(scheduler)
        check()
    assert_no_leaks(scheduler)


def test_random_workloads_keep_each_requests_own_tokens_in_the_cache():
    """Over every KV cache layout (full attention, one sliding window, windowed groups beside a full one), prefix
    caching on and off, both policies, drafts and lookahead slots: 300 seeded workloads (a failing seed replays
    alone with _random_workload)."""
    for seed in range(300):
        try:
            _random_workload(seed)
        except AssertionError as error:
            raise AssertionError(f"workload seed {seed}: {error}") from error
