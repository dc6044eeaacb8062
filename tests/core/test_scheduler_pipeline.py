"""The scheduler under pipeline parallelism (pp batches in flight), without a model: a request in a batch that has
not returned is neither scheduled again nor preempted, each batch takes about 1/pp of the requests, and running
requests carry the tokens they compute (new_token_ids) for the stages that never sample."""
from tests.core.helpers import assert_no_leaks, fake_model_output, make_request, make_scheduler, run_to_completion


def prompts(n, length, start=100):
    return [list(range(start + i * 1000, start + i * 1000 + length)) for i in range(n)]


def test_two_batches_in_flight_split_the_requests_and_never_overlap():
    scheduler = make_scheduler(pipeline_parallel_size=2)
    for i, p in enumerate(prompts(4, 20)):
        scheduler.add_request(make_request(f"r{i}", p, max_tokens=4))
    first = scheduler.schedule()
    second = scheduler.schedule()  # the first is still in flight
    assert set(first.num_scheduled_tokens) == {"r0", "r1"} and set(second.num_scheduled_tokens) == {"r2", "r3"}
    assert scheduler.schedule().total_num_scheduled_tokens == 0  # every request is in flight
    scheduler.update_from_output(first, fake_model_output(scheduler, first))
    third = scheduler.schedule()
    assert set(third.num_scheduled_tokens) == {"r0", "r1"}
    # Decodes carry the token they compute: the one the last stage sampled in the first batch.
    assert third.scheduled_cached_reqs.new_token_ids == [[scheduler.requests[r].output_token_ids[-1]]
                                                         for r in third.scheduled_cached_reqs.req_ids]
    scheduler.update_from_output(second, fake_model_output(scheduler, second))
    scheduler.update_from_output(third, fake_model_output(scheduler, third))
    outputs = run_to_completion(scheduler)
    assert all(len(outputs[f"r{i}"]) == 4 - (2 if i < 2 else 1) for i in range(4))


def test_a_request_in_flight_is_not_preempted():
    # 3 blocks of 16: each request's prompt fills one, its first decode needs a second; only one can have it.
    scheduler = make_scheduler(num_blocks=3, pipeline_parallel_size=2)
    scheduler.add_request(make_request("r0", list(range(100, 116)), max_tokens=4))
    scheduler.add_request(make_request("r1", list(range(200, 216)), max_tokens=4))
    s1, s2 = scheduler.schedule(), scheduler.schedule()
    assert list(s1.num_scheduled_tokens) == ["r0"] and list(s2.num_scheduled_tokens) == ["r1"]
    scheduler.update_from_output(s2, fake_model_output(scheduler, s2))
    s3 = scheduler.schedule()  # r1 decodes and takes the last free block
    assert list(s3.num_scheduled_tokens) == ["r1"]
    scheduler.update_from_output(s1, fake_model_output(scheduler, s1))
    # r0 needs a block. FCFS would preempt the newest, r1, but r1 is in flight: r0 gives way instead.
    s4 = scheduler.schedule()
    assert s4.preempted_req_ids == {"r0"} and s4.total_num_scheduled_tokens == 0
    scheduler.update_from_output(s3, fake_model_output(scheduler, s3))
    scheduler.update_from_output(s4, fake_model_output(scheduler, s4))
    run_to_completion(scheduler)


def test_reset_prefix_cache_with_reset_running_requests_leaves_requests_in_flight():
    """A batch still executing keeps its requests' blocks (its stages write them): those are not preempted, so the
    reset is refused; the requests that were back are preempted and the next batch resumes them."""
    scheduler = make_scheduler(pipeline_parallel_size=2)
    for i, p in enumerate(prompts(4, 30)):
        scheduler.add_request(make_request(f"r{i}", p, max_tokens=5))
    first = scheduler.schedule()
    second = scheduler.schedule()
    scheduler.update_from_output(first, fake_model_output(scheduler, first))
    assert scheduler.reset_prefix_cache(reset_running_requests=True) is False
    assert [r.request_id for r in scheduler.running] == ["r2", "r3"]
    third = scheduler.schedule()
    assert third.preempted_req_ids == {"r0", "r1"} and third.scheduled_cached_reqs.req_ids == ["r0", "r1"]
    assert all(third.scheduled_cached_reqs.resumed_from_preemption)
    scheduler.update_from_output(second, fake_model_output(scheduler, second))
    scheduler.update_from_output(third, fake_model_output(scheduler, third))
    run_to_completion(scheduler)
    assert_no_leaks(scheduler)
