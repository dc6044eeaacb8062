"""Property test: random add/abort/step sequences keep every block accounted for, and every request ends."""
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedllm.core.request import RequestStatus
from tests.core.helpers import (abort, assert_block_invariants, assert_no_leaks, make_request, make_scheduler,
                                step)

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
            decoding = {r.request_id for r in scheduler.running if r.num_computed_tokens >= r.num_prompt_tokens}
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
