"""The scheduler with LoRA adapters (max_loras), without a model: no step holds more adapters than the workers
have slots, a request for another adapter waits without starving, base-model requests go on meanwhile, and
adapters never share KV blocks while requests of one adapter do."""
from __future__ import annotations

from pagedllm.core.request import RequestStatus
from pagedllm.lora.request import LoRARequest
from tests.core.helpers import fake_model_output, make_request, make_scheduler

ADAPTERS = {i: LoRARequest(f"adapter-{i}", i, f"/adapters/{i}") for i in (1, 2, 3)}


def adapters_of(scheduler, output) -> set[int]:
    return {scheduler.requests[r].lora_request.lora_int_id for r in output.num_scheduled_tokens
            if scheduler.requests[r].lora_request is not None}


def run_to_completion(scheduler, max_loras: int) -> list[set[int]]:
    steps = []
    while scheduler.has_requests():
        output = scheduler.schedule()
        steps.append(adapters_of(scheduler, output))
        assert len(steps[-1]) <= max_loras
        running = {r.lora_request.lora_int_id for r in scheduler.running if r.lora_request is not None}
        assert len(running) <= max_loras
        scheduler.update_from_output(output, fake_model_output(scheduler, output))
    return steps


def test_no_step_holds_more_adapters_than_max_loras_and_the_third_waits_its_turn():
    scheduler = make_scheduler(max_loras=2)
    ids = [None, 1, 2, 3, 1, None, 2, 3]
    for i, lora_id in enumerate(ids):
        scheduler.add_request(make_request(f"r{i}", [7] * (5 + i), max_tokens=4 + i,
                                           lora_request=ADAPTERS.get(lora_id)))
    first = scheduler.schedule()
    # The base requests and adapters 1 and 2 start; adapter 3's first request blocks every adapter request behind
    # it (r4, r6 wait although their adapters run), base request r5 goes on.
    assert sorted(first.num_scheduled_tokens) == ["r0", "r1", "r2", "r5"]
    assert scheduler.requests["r3"].status == RequestStatus.WAITING
    stats = scheduler.make_stats()  # what /metrics' lora_requests_info shows
    assert stats.running_lora_adapters == {"adapter-1": 1, "adapter-2": 1}
    assert stats.waiting_lora_adapters == {"adapter-3": 2, "adapter-1": 1, "adapter-2": 1}
    # vLLM's waiting by reason: the adapter requests wait for a LoRA slot (deferred), none for the step's capacity
    assert (stats.num_waiting_reqs, stats.num_skipped_waiting_reqs) == (0, 4)
    scheduler.update_from_output(first, fake_model_output(scheduler, first))
    steps = run_to_completion(scheduler, max_loras=2)
    assert any(3 in step for step in steps)  # adapter 3 got its turn
    assert all(scheduler.requests.get(f"r{i}") is None for i in range(len(ids)))  # all finished
    assert scheduler.make_stats().num_skipped_waiting_reqs == 0


def test_adapters_share_no_blocks_and_one_adapter_shares_them_all():
    scheduler = make_scheduler(max_loras=3)
    prompt = list(range(100, 165))  # 4 full blocks and a token
    scheduler.add_request(make_request("a", prompt, lora_request=ADAPTERS[1]))
    run_to_completion(scheduler, max_loras=3)  # its blocks stay in the prefix cache
    for req_id, lora in (("b", ADAPTERS[2]), ("base", None), ("a2", ADAPTERS[1])):
        scheduler.add_request(make_request(req_id, prompt, lora_request=lora))
    output = scheduler.schedule()
    hits = {req_id: scheduler.requests[req_id].num_cached_tokens for req_id in ("b", "base", "a2")}
    assert hits == {"b": 0, "base": 0, "a2": 64}
    scheduler.update_from_output(output, fake_model_output(scheduler, output))
    run_to_completion(scheduler, max_loras=3)
