"""The scheduler with speculative decoding, without a model: drafts take budget and slots, rejected ones give both
back, outputs are those of plain decoding, no block leaks and no rejected draft is ever cached (a property
test with random drafts and random acceptance)."""
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.helpers import (SpeculatingWorker, abort, assert_block_invariants, assert_no_leaks,
                                deterministic_token, make_request, make_scheduler, run_to_completion)

K = 3


def right_then_wrong(num_right: int, num_wrong: int = 1):
    """Drafts of which the first ``num_right`` are what the model samples and the next ``num_wrong`` are not."""
    def draft_fn(req_id: str, num_tokens: int) -> list[int]:
        right = [deterministic_token(req_id, num_tokens + i) for i in range(num_right)]
        return right + [1] * num_wrong
    return draft_fn


def test_drafts_are_scheduled_after_the_known_token_and_counted_in_the_budget():
    scheduler = make_scheduler(block_size=4, num_speculative_tokens=K)
    scheduler.add_request(make_request("a", list(range(100, 106)), block_size=4, max_tokens=20, ignore_eos=True))
    worker = SpeculatingWorker(right_then_wrong(1, 2))
    out, _ = worker.step(scheduler)  # prefill: no drafts yet
    assert out.num_scheduled_tokens == {"a": 6} and not out.scheduled_spec_decode_tokens
    request = scheduler.requests["a"]
    assert len(request.spec_token_ids) == 3 and request.num_tokens_with_spec == request.num_tokens + 3
    out, engine_out = worker.step(scheduler)
    assert out.num_scheduled_tokens == {"a": 4} and len(out.scheduled_spec_decode_tokens["a"]) == 3
    # One draft accepted, then the model's own token: two new tokens; the rejected two were given back.
    assert len(engine_out.outputs[0].new_token_ids) == 2
    assert request.num_computed_tokens == request.num_tokens - 1 == 8
    # 8 computed tokens: slots 9-10 went back
    assert len(scheduler.kv_cache_manager.req_to_blocks["a"][0]) == 2
    stats = scheduler.make_stats()
    assert (stats.spec_decode_num_drafts, stats.spec_decode_num_draft_tokens,
            stats.spec_decode_num_accepted_tokens, stats.spec_decode_num_accepted_tokens_per_pos) == (1, 3, 1, [1, 0, 0])
    abort(scheduler, "a")
    assert_no_leaks(scheduler)


def test_budget_cuts_drafts_and_max_tokens_bounds_them():
    scheduler = make_scheduler(block_size=4, max_num_batched_tokens=3, num_speculative_tokens=K)
    scheduler.add_request(make_request("a", [5, 6], block_size=4, max_tokens=4, ignore_eos=True))
    worker = SpeculatingWorker(right_then_wrong(K, 0))
    worker.step(scheduler)
    # max_tokens 4, one token out: at most 2 drafts, so accepting all and the bonus makes exactly 4.
    assert len(scheduler.requests["a"].spec_token_ids) == 2
    out, engine_out = worker.step(scheduler)
    assert out.num_scheduled_tokens == {"a": 3}
    assert engine_out.outputs[0].finish_reason is not None
    assert len(scheduler.requests) == 0
    assert_no_leaks(scheduler)


def test_outputs_equal_plain_decoding_with_preemption_and_prefix_hits():
    def requests():
        shared = list(range(1000, 1010))
        return [make_request(f"r{i}", shared + list(range(100 * i, 100 * i + 3 + i)), block_size=4, max_tokens=15,
                             ignore_eos=True) for i in range(4)]

    plain = make_scheduler(num_blocks=200, block_size=4)
    for r in requests():
        plain.add_request(r)
    expected = run_to_completion(plain)

    tight = make_scheduler(num_blocks=18, block_size=4, num_speculative_tokens=K)
    for r in requests():
        tight.add_request(r)
    rng = random.Random(0)
    worker = SpeculatingWorker(lambda req_id, n: right_then_wrong(rng.randint(0, K), rng.randint(0, 1))(req_id, n)[:K])
    assert worker.run(tight) == expected
    stats = tight.make_stats()
    assert tight.num_preemptions > 0 and stats.prefix_cache_hits > 0
    assert 0 < stats.spec_decode_num_accepted_tokens < stats.spec_decode_num_draft_tokens
    assert_no_leaks(tight)


BLOCK_SIZE = 4
add_op = st.tuples(st.just("add"), st.booleans(), st.integers(1, 14), st.integers(1, 30))
abort_op = st.tuples(st.just("abort"), st.integers(0, 1000))
step_op = st.tuples(st.just("step"))
operations = st.lists(st.one_of(add_op, abort_op, step_op, step_op, step_op), min_size=10, max_size=60)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=operations, num_blocks=st.integers(10, 24), budget=st.sampled_from([4, 16, 64]), caching=st.booleans(),
       seed=st.integers(0, 2**16), lookahead=st.sampled_from([0, K]))
def test_random_drafts_and_acceptance_keep_blocks_accounted_for_and_never_cache_a_draft(ops, num_blocks, budget,
                                                                                      caching, seed, lookahead):
    """With lookahead (a draft model's scratch slots) too: the scratch lands only in the request's own blocks,
    which it holds no longer than the step."""
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=BLOCK_SIZE, max_num_batched_tokens=budget,
                               max_num_seqs=min(6, budget), max_model_len=64, enable_prefix_caching=caching,
                               num_speculative_tokens=K, num_lookahead_tokens=lookahead)
    rng = random.Random(seed)
    worker = SpeculatingWorker(lambda req_id, n: right_then_wrong(rng.randint(0, K), rng.randint(0, 2))(req_id, n)[
        :rng.randint(0, K)], num_lookahead_tokens=lookahead)
    added, ended, outputs = [], set(), {}

    def collect(engine_outputs):
        for out in engine_outputs.outputs:
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                ended.add(out.request_id)
            if out.error is not None:  # refused at admission: the cache can never hold it
                prompts.pop(out.request_id)

    prompts = {}
    for op in ops:
        if op[0] == "add":
            _, shared, unique_len, max_tokens = op
            req_id = f"r{len(added)}"
            prompt = (list(range(1000, 1008)) if shared else []) + list(range(5000 + 100 * len(added),
                                                                            5000 + 100 * len(added) + unique_len))
            prompts[req_id] = (prompt, max_tokens)
            scheduler.add_request(make_request(req_id, prompt, block_size=BLOCK_SIZE, max_tokens=max_tokens,
                                               ignore_eos=True))
            added.append(req_id)
        elif op[0] == "abort" and added:
            req_id = added[op[1] % len(added)]
            if req_id in scheduler.requests:
                abort(scheduler, req_id)
                ended.add(req_id)
                prompts.pop(req_id)
        else:
            collect(worker.step(scheduler)[1])
        assert_block_invariants(scheduler)
        worker.assert_computed_tokens_are_in_the_cache(scheduler)
    for _ in range(2000):
        if not scheduler.has_requests():
            break
        collect(worker.step(scheduler)[1])
        assert_block_invariants(scheduler)
        worker.assert_computed_tokens_are_in_the_cache(scheduler)
    assert set(added) == ended, "every request terminates"
    assert_no_leaks(scheduler)
    # Requests that ran to the end emitted exactly what plain decoding would have, no token more.
    for req_id, (prompt, max_tokens) in prompts.items():
        expected_len = min(max_tokens, 64 - len(prompt))
        expected = [deterministic_token(req_id, len(prompt) + i) for i in range(expected_len)]
        assert outputs.get(req_id, []) == expected, req_id


def test_max_model_len_auto_fit_counts_a_draft_models_lookahead_as_the_scheduler_does():
    """max_model_len -1 fits the context to the KV cache with the scheduler's own bound of a request's blocks: under
    a sliding window that bound grows with a draft model's lookahead slots, so a fit without them would serve a
    length whose requests the scheduler then refuses as larger than the cache."""
    from types import SimpleNamespace

    from pagedllm.config import CacheConfig, EngineConfig, SchedulerConfig
    from pagedllm.engine.core import EngineCore

    num_blocks, lookahead = 7, K
    engine = EngineCore.__new__(EngineCore)
    engine.executor = SimpleNamespace(collective_rpc=lambda method, args: None)
    engine.config = EngineConfig(
        cache_config=CacheConfig(block_size=16, sliding_window=64, num_blocks=num_blocks),
        model_config=SimpleNamespace(max_model_len=8192),
        scheduler_config=SchedulerConfig(max_model_len=8192, max_num_seqs=32, max_num_batched_tokens=32),
        speculative_config=SimpleNamespace(num_lookahead_tokens=lookahead))
    engine._fit_max_model_len(num_blocks)
    fitted = engine.config.model_config.max_model_len
    scheduler = make_scheduler(num_blocks=num_blocks, block_size=16, max_num_batched_tokens=32, max_model_len=fitted,
                               sliding_window=64, num_speculative_tokens=lookahead, num_lookahead_tokens=lookahead)
    request = make_request("long", list(range(100, 99 + fitted)), block_size=16, max_tokens=1)
    assert scheduler._admission_error(request) is None
