"""Scheduler behaviour, pinned without a model (the way vLLM's tests/v1/core does it)."""
import pytest

from pagedllm.config import SchedulerConfig
from pagedllm.core.request import RequestStatus
from pagedllm.engine.protocol import FinishReason
from pagedllm.worker.outputs import ModelRunnerOutput
from tests.core.helpers import (EOS, SpeculatingWorker, abort, assert_block_invariants, assert_no_leaks,
                                fake_model_output, make_request, make_scheduler, run_to_completion, step)


def prompts(n, length, start=100):
    return [list(range(start + i * 1000, start + i * 1000 + length)) for i in range(n)]


def test_several_prompts_prefilled_in_one_step_within_budget():
    scheduler = make_scheduler(max_num_batched_tokens=100)
    for i, p in enumerate(prompts(3, 30)):
        scheduler.add_request(make_request(f"r{i}", p))
    out = scheduler.schedule()
    assert [r.req_id for r in out.scheduled_new_reqs] == ["r0", "r1", "r2"]
    assert out.num_scheduled_tokens == {"r0": 30, "r1": 30, "r2": 30}
    assert out.total_num_scheduled_tokens == 90
    assert all(len(r.block_ids[0]) == 2 for r in out.scheduled_new_reqs)
    abort(scheduler, "r0", "r1", "r2")


def test_long_prompts_chunked_by_budget_and_threshold_then_mixed_with_decodes():
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=40)
    for i, p in enumerate(prompts(3, 50)):
        scheduler.add_request(make_request(f"r{i}", p, max_tokens=3))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"r0": 40, "r1": 24}  # threshold caps r0, budget cuts r1
    out, _ = step(scheduler)
    # Running first: r0 finishes its prompt (10), r1 continues (capped at 40); r2 gets what is left.
    assert out.num_scheduled_tokens == {"r0": 10, "r1": 26, "r2": 28}
    assert [r.req_id for r in out.scheduled_new_reqs] == ["r2"]
    assert out.scheduled_cached_reqs.req_ids == ["r0", "r1"]
    out, _ = step(scheduler)
    # r0 decodes (1 token) in the same step as r2's prefill remainder.
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1, "r2": 22}
    assert scheduler.requests["r0"].num_output_tokens == 2
    run_to_completion(scheduler)


def test_long_prefill_threshold_spares_a_lone_request():
    """The threshold keeps a long prompt from starving the other requests; a lone request has none to starve and
    takes the whole budget (vLLM's schedule()). A second request brings the cap back."""
    scheduler = make_scheduler(max_num_batched_tokens=2048, long_prefill_token_threshold=256)
    scheduler.add_request(make_request("lone", list(range(100, 1100)), max_tokens=3))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"lone": 1000}
    scheduler.add_request(make_request("other", list(range(2000, 3000)), max_tokens=3))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"lone": 1, "other": 256}
    run_to_completion(scheduler)


def test_without_chunking_a_long_prompt_is_not_skipped_by_shorter_ones():
    scheduler = make_scheduler(max_num_batched_tokens=64, max_model_len=64, enable_chunked_prefill=False)
    scheduler.add_request(make_request("short0", list(range(100, 140)), max_tokens=2))
    scheduler.add_request(make_request("long", list(range(200, 250)), max_tokens=2))
    scheduler.add_request(make_request("short1", list(range(300, 310)), max_tokens=2))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"short0": 40}  # long (50) does not fit in 24; short1 must wait
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"short0": 1, "long": 50, "short1": 10}
    run_to_completion(scheduler)


def test_prefix_hit_through_the_scheduler():
    scheduler = make_scheduler()
    system = list(range(100, 140))
    scheduler.add_request(make_request("a", system + [1, 2], max_tokens=5))
    step(scheduler)
    scheduler.add_request(make_request("b", system + [3, 4], max_tokens=2))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens["b"] == 42 - 32
    assert scheduler.requests["b"].num_cached_tokens == 32
    assert scheduler.make_stats().prefix_cache_hits == 32
    a_blocks = scheduler.kv_cache_manager.req_to_blocks["a"][0]
    assert a_blocks[0].ref_cnt == a_blocks[1].ref_cnt == 2 and a_blocks[2].ref_cnt == 1
    run_to_completion(scheduler)


def test_prefix_cache_stats_count_a_lookup_once_at_admission_and_not_on_resumption():
    """The hit rate counts a request's tokens and hit once, when it is admitted: not at every step it waits for
    blocks (each step looks it up again), and not when it resumes from preemption and finds its own blocks (vLLM's
    record_prefix_cache_stats, called at admission; preempted requests kept apart)."""
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    scheduler.add_request(make_request("a", list(range(100, 120)), block_size=4, max_tokens=4))  # 5 blocks, then 6
    step(scheduler)
    # Hits a's first two blocks but needs one more, which only frees when a finishes three steps on.
    scheduler.add_request(make_request("b", list(range(100, 108)) + [1, 2, 3], block_size=4, max_tokens=2))
    run_to_completion(scheduler)
    stats = scheduler.make_stats()
    assert (stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits) == (2, 20 + 11, 8)

    scheduler = make_scheduler(num_blocks=6, block_size=4)
    scheduler.add_request(make_request("old", list(range(100, 108)), block_size=4, max_tokens=14))
    scheduler.add_request(make_request("new", list(range(200, 208)), block_size=4, max_tokens=14))
    run_to_completion(scheduler)
    stats = scheduler.make_stats()
    assert scheduler.num_preemptions > 0
    assert (stats.prefix_cache_requests, stats.prefix_cache_queries, stats.prefix_cache_hits) == (2, 16, 0)


def test_max_num_seqs_caps_running():
    scheduler = make_scheduler(max_num_seqs=2)
    for i, p in enumerate(prompts(3, 10)):
        scheduler.add_request(make_request(f"r{i}", p, max_tokens=2))
    out, _ = step(scheduler)
    assert set(out.num_scheduled_tokens) == {"r0", "r1"}
    run_to_completion(scheduler)


@pytest.mark.parametrize("fields, message", [
    (dict(max_num_seqs=64, max_num_batched_tokens=32), r"max_num_batched_tokens \(32\) must be greater than or equal "
                                                       r"to max_num_seqs \(64\)"),
    (dict(max_model_len=100, long_prefill_token_threshold=101), r"long_prefill_token_threshold \(101\) cannot be "
                                                                r"greater than the max_model_len \(100\)")])
def test_scheduler_config_refuses_budgets_vllm_refuses(fields, message):
    """vLLM's SchedulerConfig.verify_max_model_len: a ValueError naming the fields, not an engine that runs."""
    with pytest.raises(ValueError, match=message):
        SchedulerConfig(**fields)


def test_preemption_when_blocks_run_out_and_identical_tokens_after_recompute():
    reference = make_scheduler(num_blocks=100, block_size=4)
    tight = make_scheduler(num_blocks=10, block_size=4)
    for s in (reference, tight):
        for i, p in enumerate(prompts(3, 10)):
            s.add_request(make_request(f"r{i}", p, block_size=4, max_tokens=12, ignore_eos=True))
    expected = run_to_completion(reference)
    preempted_seen = []
    got = run_to_completion(tight, on_step=lambda s, out: preempted_seen.extend(out.preempted_req_ids))
    assert tight.num_preemptions > 0 and preempted_seen
    assert got == expected
    assert all(len(tokens) == 12 for tokens in got.values())


def test_preempted_request_is_resumed_with_its_tokens_and_new_blocks():
    scheduler = make_scheduler(num_blocks=6, block_size=4)
    scheduler.add_request(make_request("old", list(range(100, 108)), block_size=4, max_tokens=14))
    scheduler.add_request(make_request("new", list(range(200, 208)), block_size=4, max_tokens=14))
    resumed = None
    for _ in range(60):
        out = scheduler.schedule()
        cached = out.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            if cached.resumed_from_preemption[i]:
                resumed = (req_id, cached.resumed_req_token_ids[i], cached.new_block_ids[i])
        if resumed:
            break
        scheduler.update_from_output(out, fake_model_output(scheduler, out))
    assert resumed is not None
    req_id, token_ids, block_ids = resumed
    assert req_id == "new"
    assert token_ids == scheduler.requests["new"].all_token_ids
    assert block_ids == scheduler.kv_cache_manager.get_block_ids("new")
    abort(scheduler, "old", "new")


@pytest.mark.parametrize("prompt_len, reserve_full_isl, admitted", [(12, True, True), (24, True, False),
                                                                     (24, False, True)])
def test_a_waiting_request_is_admitted_once_its_whole_prompt_fits(prompt_len, reserve_full_isl, admitted):
    """vLLM's scheduler_reserve_full_isl: the free blocks must hold the waiting request's whole prompt, not just its
    first chunk. Admitted on its first chunk (the flag off), "b" runs out of blocks mid-prompt and the two preempt
    each other; waiting, it runs once "a" is done, nothing preempted."""
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=32, long_prefill_token_threshold=8,
                               scheduler_reserve_full_isl=reserve_full_isl)
    scheduler.add_request(make_request("a", list(range(100, 124)), block_size=4, max_tokens=8, ignore_eos=True))
    step(scheduler)  # "a" alone takes its whole prompt: 6 blocks
    scheduler.add_request(make_request("b", list(range(200, 200 + prompt_len)), block_size=4, max_tokens=4,
                                       ignore_eos=True))
    out, _ = step(scheduler)  # "a" decodes into a 7th block: 3 are free, "b"'s first chunk (8 tokens) needs 2
    assert list(out.num_scheduled_tokens) == (["a", "b"] if admitted else ["a"])
    got = run_to_completion(scheduler)
    assert (len(got["a"]), len(got["b"])) == (6, 4)  # "a"'s first two tokens came in the steps above
    if prompt_len == 24:
        assert (scheduler.num_preemptions > 0) == (not reserve_full_isl)


def test_a_waiting_requests_prefix_hit_counts_toward_its_whole_prompt():
    """The blocks of its prefix hit that a running request holds are there already: of its 7 blocks "b" needs the
    2 past its 5 hit ones, which the 3 free blocks hold (vLLM's count, beyond the hit)."""
    scheduler = make_scheduler(num_blocks=10, block_size=4, max_num_batched_tokens=32, long_prefill_token_threshold=8)
    scheduler.add_request(make_request("a", list(range(100, 124)), block_size=4, max_tokens=8, ignore_eos=True))
    step(scheduler)
    scheduler.add_request(make_request("b", list(range(100, 120)) + list(range(300, 308)), block_size=4,
                                       max_tokens=4, ignore_eos=True))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"a": 1, "b": 8}
    assert scheduler.requests["b"].num_cached_tokens == 20
    run_to_completion(scheduler)


def test_priority_preemption_picks_the_lowest_priority():
    scheduler = make_scheduler(num_blocks=8, block_size=4, policy="priority")
    scheduler.add_request(make_request("low", list(range(100, 112)), block_size=4, priority=5, max_tokens=20))
    scheduler.add_request(make_request("high", list(range(200, 212)), block_size=4, priority=0, max_tokens=20))
    scheduler.add_request(make_request("mid", list(range(300, 304)), block_size=4, priority=1, max_tokens=20))
    out, _ = step(scheduler)
    assert list(out.num_scheduled_tokens) == ["high", "mid", "low"]  # waiting queue in priority order
    victims = []
    for _ in range(20):
        out, _ = step(scheduler)
        victims.extend(out.preempted_req_ids)
        if victims:
            break
    assert victims == ["low"]
    assert scheduler.requests["low"].status == RequestStatus.PREEMPTED
    abort(scheduler, "low", "high", "mid")


def test_priority_preemption_of_equals_picks_the_first_running():
    """vLLM's victim is the largest (priority, arrival_time), of equals the first running (no request id breaks the
    tie): "b", needing a block, preempts "a", which this step already scheduled, rather than itself."""
    scheduler = make_scheduler(num_blocks=3, block_size=4, policy="priority")
    for req_id in ("a", "b"):
        scheduler.add_request(make_request(req_id, [1, 2, 3, ord(req_id)], block_size=4, max_tokens=8,
                                           arrival_time=5.0))
    step(scheduler)
    out, _ = step(scheduler)  # "a" decodes into the last free block
    assert out.preempted_req_ids == {"a"} and list(out.num_scheduled_tokens) == ["b"]
    run_to_completion(scheduler)
    assert_no_leaks(scheduler)


def test_a_request_preempted_in_the_step_that_scheduled_it_leaves_no_uncomputed_block_cached():
    """The priority policy may preempt a request it already scheduled this step; the full blocks its allocation
    registered in the prefix cache hold tokens no step computed, so they must not serve a hit when it resumes."""
    scheduler = make_scheduler(num_blocks=7, block_size=4, max_num_batched_tokens=16, long_prefill_token_threshold=8,
                               policy="priority", enable_prefix_caching=True)
    worker = SpeculatingWorker(draft_fn=lambda req_id, num_tokens: [])
    scheduler.add_request(make_request("low", list(range(100, 122)), block_size=4, priority=5, max_tokens=4))
    # A one-token request beside it for one step, so that "low" is not alone and the threshold chunks its prompt.
    scheduler.add_request(make_request("filler", [7], block_size=4, priority=9, max_tokens=1))
    worker.step(scheduler)
    scheduler.add_request(make_request("high", list(range(200, 204)), block_size=4, priority=0, max_tokens=4))
    worker.step(scheduler)
    # "low"'s last chunk takes the last two blocks (registering its full one); "high"'s decode then needs a block.
    out, _ = worker.step(scheduler)
    assert out.preempted_req_ids == {"low"} and "low" not in out.num_scheduled_tokens
    abort(scheduler, "high")  # "low" resumes alone, through whatever its prefix hits
    got = worker.run(scheduler)  # checks after each step that the computed positions hold the request's tokens
    assert len(got["low"]) == 4
    assert_no_leaks(scheduler)


def test_priority_waiting_order_is_value_then_arrival():
    scheduler = make_scheduler(max_num_seqs=1, policy="priority")
    scheduler.add_request(make_request("b", [1, 2], priority=1, arrival_time=1.0))
    scheduler.add_request(make_request("c", [1, 2], priority=0, arrival_time=2.0))
    scheduler.add_request(make_request("a", [1, 2], priority=1, arrival_time=0.5))
    assert [r.request_id for r in scheduler.waiting] == ["c", "a", "b"]
    abort(scheduler, "a", "b", "c")


def _one_request_outputs(token_fn, **params):
    scheduler = make_scheduler(max_model_len=params.pop("max_model_len", 8192))
    scheduler.add_request(make_request("r", [5, 6, 7], **params))
    outputs = []
    for _ in range(100):
        if not scheduler.has_requests():
            break
        _, outs = step(scheduler, token_fn)
        outputs.extend(outs.outputs)
    return outputs


def test_stop_on_eos():
    outs = _one_request_outputs(lambda r, pos: EOS if pos == 6 else 42, max_tokens=10)
    assert [t for o in outs for t in o.new_token_ids] == [42, 42, 42, EOS]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason is None


def test_ignore_eos_runs_to_max_tokens():
    outs = _one_request_outputs(lambda r, pos: EOS, max_tokens=5, ignore_eos=True)
    assert sum(len(o.new_token_ids) for o in outs) == 5
    assert outs[-1].finish_reason == FinishReason.LENGTH


def test_stop_token_ids_set_stop_reason():
    outs = _one_request_outputs(lambda r, pos: 77 if pos == 4 else 42, max_tokens=10, stop_token_ids=[77])
    assert [t for o in outs for t in o.new_token_ids] == [42, 77]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == 77


def test_max_tokens_and_max_model_len():
    outs = _one_request_outputs(lambda r, pos: 42, max_tokens=4)
    assert sum(len(o.new_token_ids) for o in outs) == 4 and outs[-1].finish_reason == FinishReason.LENGTH
    outs = _one_request_outputs(lambda r, pos: 42, max_tokens=100, max_model_len=8)
    assert sum(len(o.new_token_ids) for o in outs) == 5 and outs[-1].finish_reason == FinishReason.LENGTH


def test_a_stop_token_under_min_tokens_still_ends_the_request():
    """min_tokens is the sampler's (it holds EOS and the stop tokens back); one it lets through, where nothing else
    may come (a grammar's end), ends the request, as vLLM's check_stop has it."""
    outs = _one_request_outputs(lambda r, pos: 77 if pos == 5 else 5, max_tokens=10, min_tokens=4,
                                stop_token_ids=[77])
    assert [t for o in outs for t in o.new_token_ids] == [5, 5, 77]
    assert outs[-1].finish_reason == FinishReason.STOP and outs[-1].stop_reason == 77


def test_finished_ids_reported_to_workers_next_step():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2, 3], max_tokens=1))
    scheduler.add_request(make_request("b", [1, 2, 3], max_tokens=3))
    step(scheduler)
    out = scheduler.schedule()
    assert out.finished_req_ids == {"a"}
    abort(scheduler, "b")
    assert scheduler.schedule().finished_req_ids == {"b"}


def test_abort_in_each_state_frees_everything():
    scheduler = make_scheduler(num_blocks=12, block_size=4, max_num_batched_tokens=16)
    scheduler.add_request(make_request("decoding", list(range(100, 108)), block_size=4, max_tokens=30))
    step(scheduler)
    scheduler.add_request(make_request("prefilling", list(range(200, 240)), block_size=4, max_tokens=8))
    scheduler.add_request(make_request("waiting", list(range(300, 340)), block_size=4, max_tokens=8))
    step(scheduler)
    assert scheduler.requests["prefilling"].num_computed_tokens < 40
    assert scheduler.requests["waiting"].status == RequestStatus.WAITING
    abort(scheduler, "waiting")
    abort(scheduler, "prefilling")
    assert_block_invariants(scheduler)
    # Drive "decoding" into a preemption by a new request filling the cache.
    scheduler.add_request(make_request("hog", list(range(400, 436)), block_size=4, max_tokens=12))
    for _ in range(20):
        step(scheduler)
        if any(r.status == RequestStatus.PREEMPTED for r in scheduler.requests.values()):
            break
    preempted = [r.request_id for r in scheduler.requests.values() if r.status == RequestStatus.PREEMPTED]
    assert preempted
    abort(scheduler, *preempted)
    abort(scheduler, *list(scheduler.requests))
    assert_block_invariants(scheduler)


def test_abort_while_step_in_flight_drops_its_output():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", [1, 2, 3]))
    out = scheduler.schedule()
    abort(scheduler, "r")
    result = scheduler.update_from_output(out, ModelRunnerOutput(["r"], {"r": 0}, [[42]]))
    assert result.outputs == []


def test_reset_prefix_cache_refused_while_running():
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", list(range(40)), max_tokens=2))
    step(scheduler)
    assert scheduler.reset_prefix_cache() is False
    run_to_completion(scheduler)
    assert scheduler.reset_prefix_cache() is True
    assert not scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block


def test_reset_prefix_cache_with_reset_running_requests_preempts_them_and_they_finish_alike():
    """vLLM's reset_running_requests: the running requests are preempted (their blocks freed), so the reset succeeds;
    the next step tells the workers so, and resumes them in their order; they finish with the tokens of a run
    without the reset."""
    prompts = {"a": list(range(40)), "b": list(range(100, 130))}
    expected = {}
    for reset in (False, True):
        scheduler = make_scheduler()
        for req_id, prompt in prompts.items():
            scheduler.add_request(make_request(req_id, prompt, max_tokens=6))
        tokens = {}
        for _ in range(3):
            for out in step(scheduler)[1].outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if reset:
            assert scheduler.reset_prefix_cache(reset_running_requests=True) is True
            assert not scheduler.running and not scheduler.kv_cache_manager.block_pool.cached_block_hash_to_block
            assert_block_invariants(scheduler)
            output = scheduler.schedule()
            assert output.preempted_req_ids == {"a", "b"}
            assert output.scheduled_cached_reqs.req_ids == ["a", "b"]
            assert all(output.scheduled_cached_reqs.resumed_from_preemption)
            for out in scheduler.update_from_output(output, fake_model_output(scheduler, output)).outputs:
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        for req_id, new_tokens in run_to_completion(scheduler).items():
            tokens.setdefault(req_id, []).extend(new_tokens)
        assert_no_leaks(scheduler)
        expected.setdefault("tokens", tokens)
        assert tokens == expected["tokens"]


def test_a_duplicate_request_id_is_refused_and_the_running_request_finishes_untouched():
    """vLLM's scheduler refuses an id it holds; ours with a ValueError that changes nothing."""
    scheduler = make_scheduler()
    scheduler.add_request(make_request("r", list(range(40)), max_tokens=4))
    step(scheduler)
    with pytest.raises(ValueError, match="'r' is already in the scheduler"):
        scheduler.add_request(make_request("r", list(range(100, 140)), max_tokens=4))
    assert len(scheduler.waiting) == 0 and [r.request_id for r in scheduler.running] == ["r"]
    assert len(run_to_completion(scheduler)["r"]) == 3
    assert_no_leaks(scheduler)


def test_request_that_can_never_fit_is_finished_with_an_error():
    scheduler = make_scheduler(num_blocks=4, block_size=4, max_model_len=100)
    scheduler.add_request(make_request("huge", list(range(20)), block_size=4, max_tokens=10))
    scheduler.add_request(make_request("too_long", list(range(100)), block_size=4))
    assert not scheduler.get_num_unfinished_requests() and scheduler.has_requests()
    out = scheduler.schedule()
    assert out.total_num_scheduled_tokens == 0
    result = scheduler.update_from_output(out, ModelRunnerOutput([], {}, []))
    errors = {o.request_id: o for o in result.outputs}
    assert errors["huge"].finish_reason == FinishReason.LENGTH and "whole cache holds 4 blocks" in errors["huge"].error
    assert "maximum context length is 100 tokens" in errors["too_long"].error
    assert not scheduler.has_requests()


@pytest.mark.parametrize("num_blocks", range(5, 10))
def test_the_workers_start_up_warning_comes_exactly_when_the_scheduler_refuses_a_max_model_len_request(
        caplog, num_blocks):
    """One bound on a request's blocks (max_blocks, with EngineConfig.max_step_slots): under a sliding window, the
    window and a step's slots, a draft model's lookahead slots among them. The worker's warning left the lookahead
    out, and stayed silent for a cache (7 blocks here) the scheduler then refused max_model_len requests of."""
    import logging
    from types import SimpleNamespace

    from pagedllm.config import CacheConfig, EngineConfig
    from pagedllm.core.sched.scheduler import Scheduler
    from pagedllm.worker.worker import Worker

    config = EngineConfig(SimpleNamespace(max_model_len=64),
                          CacheConfig(block_size=4, num_blocks=num_blocks, sliding_window=8),
                          SchedulerConfig(max_model_len=64, max_num_seqs=16, max_num_batched_tokens=16),
                          speculative_config=SimpleNamespace(num_lookahead_tokens=3))  # a draft model's, 3 drafts
    worker = Worker.__new__(Worker)  # its start-up line alone: no model
    worker.config, worker.rank = config, SimpleNamespace(rank=0)
    worker.model_runner = SimpleNamespace(initialize_kv_cache=lambda num_blocks: None)
    with caplog.at_level(logging.WARNING, logger="pagedllm.worker.worker"):
        worker.initialize_kv_cache(num_blocks)
    warned = any("smaller than one request of max_model_len" in r.getMessage() for r in caplog.records)
    scheduler = Scheduler(config.scheduler_config, config.cache_config, num_speculative_tokens=3,
                          num_lookahead_tokens=3)
    refused = scheduler._admission_error(make_request("r", [1], block_size=4, max_tokens=100)) is not None
    assert warned == refused


def test_prefill_tokens_capped_while_decoding_but_not_when_idle():
    """max_prefill_tokens_with_decodes: a step that decodes takes at most that many prompt tokens (running
    chunks and new prompts together); a step with nothing decoding takes the whole budget."""
    scheduler = make_scheduler(max_num_batched_tokens=200, max_prefill_tokens_with_decodes=48)
    for i, p in enumerate(prompts(2, 60)):
        scheduler.add_request(make_request(f"r{i}", p, max_tokens=30, ignore_eos=True))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"r0": 60, "r1": 60}  # nothing decodes yet: the whole budget
    for i, p in enumerate(prompts(2, 70, start=50_000)):
        scheduler.add_request(make_request(f"n{i}", p, max_tokens=30, ignore_eos=True))
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1, "n0": 48}
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1, "n0": 22, "n1": 26}  # the running chunk first
    out, _ = step(scheduler)
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 1, "n0": 1, "n1": 44}
    run_to_completion(scheduler)


def test_prefill_cap_counts_a_resumed_requests_recomputed_outputs():
    """A request resumed from preemption computes its prompt and its outputs again, a prefill that costs a step what
    a prompt does (vLLM's prefill_end, max(num_prompt_tokens, num_tokens - 1)): while others decode, each of its
    chunks keeps within max_prefill_tokens_with_decodes, not only the first."""
    scheduler = make_scheduler(num_blocks=16, block_size=4, max_num_batched_tokens=64,
                               max_prefill_tokens_with_decodes=8, enable_prefix_caching=False)
    for req_id, start, max_tokens in (("d", 100, 45), ("x", 300, 22), ("r", 200, 40)):
        scheduler.add_request(make_request(req_id, list(range(start, start + 4)), block_size=4, max_tokens=max_tokens,
                                           ignore_eos=True))
    while scheduler.has_requests():
        decoding = {r.request_id for r in scheduler.running if r.num_computed_tokens == r.num_tokens - 1}
        out, _ = step(scheduler)
        if decoding & set(out.num_scheduled_tokens):
            assert sum(n for req_id, n in out.num_scheduled_tokens.items() if req_id not in decoding) <= 8, out
    assert scheduler.num_preemptions > 0
