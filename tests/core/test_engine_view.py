"""The engine view (what the web page draws) against the scheduler's own state, without a model."""
from pagedllm.core.sched.engine_view import make_engine_view
from tests.core.helpers import abort, make_request, make_scheduler, run_to_completion, step


def test_view_follows_requests_blocks_and_steps_through_a_prefix_hit_and_a_preemption():
    scheduler = make_scheduler(num_blocks=11, block_size=4, max_num_batched_tokens=64)
    view = make_engine_view(scheduler)
    assert view.block_map == "." * 11 and view.num_steps == view.num_step_tokens == 0
    assert view.running == view.waiting == []

    system = list(range(100, 108))  # two full blocks, shared by both requests
    scheduler.add_request(make_request("a", system + [1], block_size=4, max_tokens=20, ignore_eos=True))
    view = make_engine_view(scheduler)
    assert [(r.request_id, r.status, r.num_computed_tokens) for r in view.waiting] == [("a", "waiting", 0)]

    step(scheduler)
    scheduler.add_request(make_request("b", system + [2], block_size=4, max_tokens=20, ignore_eos=True))
    step(scheduler)
    view = make_engine_view(scheduler)
    assert view.num_steps == 2 and view.num_step_tokens == 9 + 1 + 1  # a's prompt, a's decode, b's uncached token
    assert view.block_map.count("s") == 2  # the shared system prompt
    assert view.block_map.count("u") == sum(b.ref_cnt == 1 for b in scheduler.kv_cache_manager.block_pool.blocks)
    a, b = view.running
    assert (a.request_id, a.status, a.num_prompt_tokens, a.num_output_tokens, a.max_tokens) == ("a", "running", 9, 2, 20)
    assert (b.request_id, b.num_cached_tokens, b.num_output_tokens) == ("b", 8, 1)
    assert a.num_blocks == len(scheduler.kv_cache_manager.req_to_blocks["a"][0])
    assert view.num_running_reqs == 2 and view.prefix_cache_hits == 8
    assert view.kv_cache_usage == scheduler.kv_cache_manager.usage

    # Together they outgrow the 11 blocks: one is preempted and shows so while it waits to resume.
    preempted = []
    for _ in range(30):
        step(scheduler)
        preempted = [r for r in make_engine_view(scheduler).waiting if r.status == "preempted"]
        if preempted:
            break
    assert preempted[0].num_preemptions == 1 and make_engine_view(scheduler).num_preemptions == 1

    run_to_completion(scheduler)
    view = make_engine_view(scheduler)
    assert view.running == view.waiting == [] and set(view.block_map) <= {".", "c"} and "c" in view.block_map


def test_view_lists_a_bounded_number_of_requests_but_counts_them_all():
    from pagedllm.core.sched.engine_view import MAX_LISTED_REQUESTS
    scheduler = make_scheduler(num_blocks=1000)
    ids = [f"r{i}" for i in range(MAX_LISTED_REQUESTS + 5)]
    for i, req_id in enumerate(ids):
        scheduler.add_request(make_request(req_id, [100 + i, 5, 6]))
    view = make_engine_view(scheduler)
    assert len(view.waiting) == MAX_LISTED_REQUESTS and view.num_waiting_reqs == len(ids)
    assert [r.request_id for r in view.waiting] == ids[:MAX_LISTED_REQUESTS]
    abort(scheduler, *ids)
