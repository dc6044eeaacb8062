"""The data-parallel frontend's routing, without engines: least-loaded by vLLM's score (waiting x 4 + running,
counting requests sent since the engine last reported), prefix affinity while loads are close, aborts to the engine
holding the request, and a dead engine's requests handed back to fail."""
from __future__ import annotations

import msgspec
import pytest

from pagedllm.engine.dp_client import AFFINITY_ENTRIES, AFFINITY_SLACK, DPLoadBalancer
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason,
                                      SchedulerStats)
from pagedllm.sampling_params import SamplingParams


def request(request_id: str, tokens: list[int]) -> EngineCoreRequest:
    return EngineCoreRequest(request_id, tokens, SamplingParams(), eos_token_id=None, arrival_time=0.0)


def test_least_loaded_counts_what_was_sent_since_the_last_stats():
    balancer = DPLoadBalancer(2, block_size=4)
    balancer.on_outputs(0, EngineCoreOutputs(scheduler_stats=SchedulerStats(num_running_reqs=3)))
    # scores (engine 0, engine 1): (3, 0) -> 1, (3, 4) -> 0, (7, 4) -> 1
    assert [balancer.choose(request(f"r{i}", [i])) for i in range(3)] == [1, 0, 1]


def test_same_first_block_stays_on_its_engine_while_loads_are_close():
    balancer = DPLoadBalancer(2, block_size=4)
    shared = [7, 7, 7, 7]
    first = balancer.choose(request("a", shared + [1]))
    assert balancer.choose(request("b", shared + [2])) == first  # 4 points busier: within the slack
    balancer.on_outputs(first, EngineCoreOutputs(scheduler_stats=SchedulerStats(num_waiting_reqs=AFFINITY_SLACK)))
    assert balancer.choose(request("c", shared + [3])) != first  # far busier: the prefix moves


def test_a_request_naming_a_data_parallel_rank_goes_to_that_engine():
    """vLLM's data_parallel_rank: the request runs on that engine, however loaded; one that has died fails it."""
    balancer = DPLoadBalancer(2, block_size=4)
    balancer.on_outputs(1, EngineCoreOutputs(scheduler_stats=SchedulerStats(num_waiting_reqs=9)))
    pinned = msgspec.structs.replace(request("a", [1]), data_parallel_rank=1)
    assert balancer.choose(pinned) == 1 and balancer.engine_of == {"a": 1} and balancer.sent_since_stats == [0, 1]
    balancer.mark_dead(1)
    with pytest.raises(EngineDeadError, match="engine 1 .*has died"):
        balancer.choose(msgspec.structs.replace(request("b", [1]), data_parallel_rank=1))


def test_aborts_and_a_dead_engine():
    balancer = DPLoadBalancer(2, block_size=4)
    engines = {r: balancer.choose(request(r, [i])) for i, r in enumerate(["a", "b", "c"])}
    assert balancer.by_engine(["a", "b"]) == {engines["a"]: ["a"], engines["b"]: ["b"]}
    balancer.on_outputs(engines["c"], EngineCoreOutputs(outputs=[EngineCoreOutput("c", [1], finish_reason=FinishReason.LENGTH)]))
    assert balancer.engine_of == {}
    d = balancer.choose(request("d", [9]))
    assert balancer.mark_dead(d) == ["d"]
    assert all(balancer.choose(request(f"e{i}", [i])) != d for i in range(3))
    balancer.mark_dead(1 - d)
    with pytest.raises(EngineDeadError):
        balancer.choose(request("f", [1]))


def test_affinity_remembers_a_bounded_number_of_prefixes():
    """Distinct prompts' first blocks do not grow the table without end: the least recently sent go first."""
    balancer = DPLoadBalancer(2, block_size=2)
    for i in range(AFFINITY_ENTRIES + 10):
        balancer.choose(request(f"r{i}", [i, i, 0]))
    assert len(balancer.affinity) == AFFINITY_ENTRIES
    assert (0, 0) not in balancer.affinity and (AFFINITY_ENTRIES + 9,) * 2 in balancer.affinity


def test_a_request_to_an_engine_dying_unreported_goes_to_another():
    """An engine whose process is gone before its death is delivered raises on send: the request goes to a live
    engine instead of failing."""
    from pagedllm.engine.dp_client import _DPClientBase as DPClientBase

    class Engine:
        def __init__(self, dead: bool):
            self.dead, self.requests = dead, []

        def add_request(self, request):
            if self.dead:
                raise EngineDeadError()
            self.requests.append(request.request_id)

    client = DPClientBase.__new__(DPClientBase)
    client.balancer, client.engines = DPLoadBalancer(2, block_size=4), [Engine(dead=True), Engine(dead=False)]
    client.balancer.on_outputs(1, EngineCoreOutputs(scheduler_stats=SchedulerStats(num_running_reqs=5)))
    client.add_request(request("a", [1, 2]))  # engine 0 is the less loaded, but dead
    assert client.engines[1].requests == ["a"] and client.balancer.dead == {0}


def test_a_utility_runs_on_every_live_engine_and_their_results_combine():
    """As vLLM's data-parallel client, a utility goes to every live engine: a prefix-cache reset one engine refuses
    still resets the others (and is refused), stats are summed, and any engine asleep makes the client asleep."""
    from concurrent.futures import Future

    from pagedllm.engine.dp_client import DPSyncMPClient

    class Engine:
        def __init__(self, results: dict):
            self.results, self.calls, self.dead = results, [], False

        def call_utility(self, method, *args):
            self.calls.append(method)
            future = Future()
            future.set_result(self.results.get(method))
            return future

    client = DPSyncMPClient.__new__(DPSyncMPClient)
    refusing = Engine({"reset_prefix_cache": False, "get_stats": SchedulerStats(num_running_reqs=2),
                       "is_sleeping": True})
    resetting = Engine({"reset_prefix_cache": True, "get_stats": SchedulerStats(num_running_reqs=3),
                        "is_sleeping": False})
    client.balancer, client.engines = DPLoadBalancer(3, block_size=4), [refusing, resetting, Engine({})]
    client.balancer.dead.add(2)
    assert client.reset_prefix_cache() is False
    assert client.get_stats().num_running_reqs == 5 and client.is_sleeping() is True
    assert refusing.calls == resetting.calls == ["reset_prefix_cache", "get_stats", "is_sleeping"]
    assert client.engines[2].calls == []


def test_an_engine_whose_process_is_gone_is_dead_before_its_death_is_delivered():
    """Until the client takes an engine's delivered death (an AsyncLLM made before its event loop takes outputs from
    its first request on), an engine whose process is gone already counts dead: health checks name it, utilities
    skip it, and the client is dead when every engine is."""
    from concurrent.futures import Future

    from pagedllm.engine.dp_client import DPSyncMPClient

    class Engine:
        def __init__(self, dead: bool):
            self.dead, self.calls = dead, []

        def call_utility(self, method, *args):
            self.calls.append(method)
            future = Future()
            future.set_result(True)
            return future

    client = DPSyncMPClient.__new__(DPSyncMPClient)
    client.balancer, client.engines = DPLoadBalancer(2, block_size=4), [Engine(dead=False), Engine(dead=True)]
    assert client.dead_engines == [1] and not client.dead and client.balancer.dead == set()
    assert client.reset_prefix_cache() is True
    assert client.engines[0].calls == ["reset_prefix_cache"] and client.engines[1].calls == []
    client.engines[0].dead = True
    assert client.dead
