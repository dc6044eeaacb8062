"""Data parallelism in the frontend: data_parallel_size EngineCore processes, each with its own scheduler and KV
cache (and its own ranks), behind the interface of one engine client (vLLM's DP load-balancing client).

Each request goes to the least-loaded live engine by vLLM's score, waiting x 4 + running, from the engines' last
reported stats plus the requests sent since; a request whose first prompt block was seen before goes back to the
engine that has it cached while that engine's score is within AFFINITY_SLACK of the best. Aborts go to the engine
holding the request. In the server an engine that dies fails only its own requests; the others keep serving.
Offline, as with vLLM's client, it ends them all.
"""
from __future__ import annotations

import asyncio
import copy
import itertools
import queue
from collections import Counter, OrderedDict
from concurrent.futures import Future
from typing import Any, Optional

import msgspec

from pagedllm.config import EngineConfig
from pagedllm.engine.core_client import SHUT_DOWN_MESSAGE, LoopQueue, MPClient, stop_clients
from pagedllm.engine.exceptions import EngineDeadError
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedllm.executor.abstract import WorkerMethod

AFFINITY_SLACK = 8  # score points: two waiting requests
AFFINITY_ENTRIES = 4096  # first prompt blocks remembered (least recently sent first out)


class DPLoadBalancer:
    """Which engine each request runs on; pure bookkeeping, no I/O."""

    def __init__(self, num_engines: int, block_size: int) -> None:
        self.block_size = block_size
        self.stats = [SchedulerStats() for _ in range(num_engines)]
        self.sent_since_stats = [0] * num_engines
        self.engine_of: dict[str, int] = {}
        # First prompt block -> the engine that last took it, most recent last, at most AFFINITY_ENTRIES.
        self.affinity: OrderedDict[tuple[int, ...], int] = OrderedDict()
        self.dead: set[int] = set()

    def score(self, engine: int) -> int:
        stats = self.stats[engine]
        waiting = stats.num_waiting_reqs + stats.num_skipped_waiting_reqs + self.sent_since_stats[engine]
        return waiting * 4 + stats.num_running_reqs

    def choose(self, request: EngineCoreRequest) -> int:
        """The request's data_parallel_rank where it names one (vLLM's), else the least-loaded live engine."""
        engine = request.data_parallel_rank
        if engine is None:
            engine = self._least_loaded(request)
        elif engine in self.dead:
            raise EngineDeadError(f"data-parallel engine {engine} (the request's data_parallel_rank) has died.")
        self.engine_of[request.request_id] = engine
        self.sent_since_stats[engine] += 1
        return engine

    def _least_loaded(self, request: EngineCoreRequest) -> int:
        alive = [i for i in range(len(self.stats)) if i not in self.dead]
        if not alive:
            raise EngineDeadError("Every data-parallel engine has died.")
        best = min(alive, key=self.score)
        key = tuple(request.prompt_token_ids[:self.block_size])
        engine = best
        if len(key) == self.block_size:
            cached = self.affinity.get(key)
            if cached in alive and self.score(cached) <= self.score(best) + AFFINITY_SLACK:
                engine = cached
            self.affinity[key] = engine
            self.affinity.move_to_end(key)
            if len(self.affinity) > AFFINITY_ENTRIES:  # distinct prompts would grow it without end
                self.affinity.popitem(last=False)
        return engine

    def on_outputs(self, engine: int, outputs: EngineCoreOutputs) -> None:
        if outputs.scheduler_stats is not None:
            self.stats[engine] = outputs.scheduler_stats
            self.sent_since_stats[engine] = 0
        for output in outputs.outputs:
            if output.finish_reason is not None:
                self.engine_of.pop(output.request_id, None)

    def by_engine(self, request_ids: list[str]) -> dict[int, list[str]]:
        grouped: dict[int, list[str]] = {}
        for request_id in request_ids:
            engine = self.engine_of.pop(request_id, None)
            if engine is not None:
                grouped.setdefault(engine, []).append(request_id)
        return grouped

    def mark_dead(self, engine: int) -> list[str]:
        """The requests the dead engine held."""
        self.dead.add(engine)
        failed = [r for r, e in self.engine_of.items() if e == engine]
        for request_id in failed:
            del self.engine_of[request_id]
        self.affinity = OrderedDict((k, e) for k, e in self.affinity.items() if e != engine)
        return failed


def engine_configs(config: EngineConfig) -> list[EngineConfig]:
    """One config per engine, each knowing its data_parallel_rank (its share of the cores)."""
    configs = []
    for rank in range(config.parallel_config.data_parallel_size):
        engine_config = copy.copy(config)
        engine_config.parallel_config = copy.copy(config.parallel_config)
        engine_config.parallel_config.data_parallel_rank = rank
        configs.append(engine_config)
    return configs


class _DPClientBase:
    """The engines and the balancer; subclasses deliver (engine, outputs) to their caller's thread or loop."""

    def __init__(self, config: EngineConfig) -> None:
        self.balancer = DPLoadBalancer(config.parallel_config.data_parallel_size, config.cache_config.block_size)
        self.engines: list[MPClient] = []
        try:  # every engine process starts at once (each loads its model on its share of the cores)
            for index, engine_config in enumerate(engine_configs(config)):
                self.engines.append(MPClient(engine_config, lambda o, i=index: self._deliver(i, o), wait=False))
            for engine in self.engines:
                engine.wait_until_ready()
        except BaseException:
            self.shutdown()
            raise
        # The frontend's num_gpu_blocks (cache_config_info's) is every engine's blocks, as vLLM's client sums them.
        config.cache_config.num_blocks = sum(engine.num_gpu_blocks for engine in self.engines)

    def _deliver(self, engine: int, outputs: Any) -> None:
        raise NotImplementedError

    def _process(self, engine: int, outputs: Any) -> EngineCoreOutputs:
        """The balancer's view of one delivery; an engine's death becomes the outputs that fail its requests."""
        if isinstance(outputs, EngineDeadError):
            failed = self.balancer.mark_dead(engine)
            if len(self.balancer.dead) == len(self.engines):
                raise outputs
            return EngineCoreOutputs(engine_index=engine, engine_dead=f"data-parallel engine {engine}: {outputs}",
                                     failed_request_ids=failed)
        self.balancer.on_outputs(engine, outputs)
        outputs.engine_index = engine
        return outputs

    def _gone(self) -> set[int]:
        """The engines known dead: those whose death was delivered (the balancer's), and those whose process is
        gone while their death still waits to be taken (an AsyncLLM made before its event loop takes outputs from
        its first request on), so that health checks and utility calls do not wait for the delivery."""
        return self.balancer.dead | {i for i, engine in enumerate(self.engines) if engine.dead}

    @property
    def dead(self) -> bool:
        return len(self._gone()) == len(self.engines)

    @property
    def dead_error(self) -> Optional[EngineDeadError]:
        """Once every engine is dead: the error with each one's last words (an engine shut down, not dead: that)."""
        if not self.dead:
            return None
        return EngineDeadError("Every data-parallel engine has died: " + "; ".join(
            f"engine {i}: {engine.error}" for i, engine in enumerate(self.engines)))

    @property
    def dead_engines(self) -> list[int]:
        return sorted(self._gone())

    def add_request(self, request: EngineCoreRequest) -> None:
        """To the engine the balancer chooses; one whose process is gone but whose death is not delivered yet
        (its monitor is still collecting the engine's last words) is passed over, not sent the request."""
        while True:
            engine = self.balancer.choose(request)
            try:
                return self.engines[engine].add_request(request)
            except EngineDeadError:
                self.balancer.dead.add(engine)  # its delivered death (mark_dead) then fails the requests it held

    def abort_requests(self, request_ids: list[str]) -> None:
        for engine, ids in self.balancer.by_engine(request_ids).items():
            if engine not in self.balancer.dead:
                self.engines[engine].abort_requests(ids)

    def _live(self) -> list[MPClient]:
        gone = self._gone()
        return [e for i, e in enumerate(self.engines) if i not in gone]

    def _call_utility_all(self, method: str, *args: Any) -> list[Future]:
        """``method`` on every live engine, as vLLM's data-parallel client calls a utility on all its engines."""
        return [engine.call_utility(method, *args) for engine in self._live()]

    def _collective_rpc(self, method: WorkerMethod, timeout: Optional[float], args: tuple,
                        kwargs: Optional[dict]) -> list[Future]:
        """collective_rpc on every live engine's workers; as vLLM's data-parallel client, the caller gets the first
        one's results."""
        return [engine.collective_rpc(method, timeout, args, kwargs) for engine in self._live()]

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Stops every engine within one ``timeout``: all told at once, then waited for together (vLLM's engine
        manager's), so that a slow first engine does not spend the others' grace."""
        stop_clients(self.engines, timeout)


def combine_utility_results(method: str, results: list) -> Any:
    """One utility call's result from every live engine's: stats aggregated; whether every engine did it (reset,
    wake, add or pin an adapter) or any did (is asleep, is paused, had the adapter removed); the adapters any engine
    keeps (each loads those its requests name); else the list of them."""
    if method == "get_stats":
        return aggregate_stats([msgspec.convert(r, SchedulerStats) for r in results])
    if method in ("reset_prefix_cache", "wake_up", "add_lora", "pin_lora"):
        return all(results)
    if method in ("is_sleeping", "is_scheduler_paused", "remove_lora"):
        return any(results)
    return sorted(set().union(*results)) if method == "list_loras" else results


def aggregate_stats(stats: list[SchedulerStats]) -> SchedulerStats:
    """The engines' stats as one: sums, and the mean KV cache usage."""
    return SchedulerStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        num_skipped_waiting_reqs=sum(s.num_skipped_waiting_reqs for s in stats),
        kv_cache_usage=sum(s.kv_cache_usage for s in stats) / max(len(stats), 1),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        prefix_cache_requests=sum(s.prefix_cache_requests for s in stats),
        prefix_cache_resets=sum(s.prefix_cache_resets for s in stats),
        spec_decode_num_drafts=sum(s.spec_decode_num_drafts for s in stats),
        spec_decode_num_draft_tokens=sum(s.spec_decode_num_draft_tokens for s in stats),
        spec_decode_num_accepted_tokens=sum(s.spec_decode_num_accepted_tokens for s in stats),
        spec_decode_num_accepted_tokens_per_pos=[sum(column) for column in itertools.zip_longest(
            *(s.spec_decode_num_accepted_tokens_per_pos for s in stats), fillvalue=0)],
        running_lora_adapters=dict(sum((Counter(s.running_lora_adapters) for s in stats), Counter())),
        waiting_lora_adapters=dict(sum((Counter(s.waiting_lora_adapters) for s in stats), Counter())))


class DPAsyncMPClient(_DPClientBase):
    """For AsyncLLM: every engine's outputs on one LoopQueue, tagged with the engine."""

    def __init__(self, config: EngineConfig) -> None:
        self._outputs = LoopQueue()
        super().__init__(config)

    def _deliver(self, engine: int, outputs: Any) -> None:
        self._outputs.put((engine, outputs))

    async def get_output_async(self) -> EngineCoreOutputs:
        return self._process(*await self._outputs.get())

    async def call_utility_async(self, method: str, *args: Any) -> Any:
        results = await asyncio.gather(*map(asyncio.wrap_future, self._call_utility_all(method, *args)))
        return combine_utility_results(method, results)

    async def collective_rpc_async(self, method: WorkerMethod, timeout: Optional[float] = None, args: tuple = (),
                                   kwargs: Optional[dict] = None) -> list:
        calls = self._collective_rpc(method, timeout, args, kwargs)
        return (await asyncio.gather(*map(asyncio.wrap_future, calls)))[0]


class DPSyncMPClient(_DPClientBase):
    """For LLMEngine: get_output() blocks until any engine has outputs. One engine's death ends the client, as
    vLLM's: the other engines are stopped, and get_output and add_request raise EngineDeadError then and at every
    later call, as SyncMPClient's do (a step() after the first error waited for ever for the dead engine's
    requests)."""

    def __init__(self, config: EngineConfig) -> None:
        self._outputs: queue.Queue = queue.Queue()
        self._dead_error: EngineDeadError | None = None
        super().__init__(config)

    def _deliver(self, engine: int, outputs: Any) -> None:
        self._outputs.put((engine, outputs))

    def add_request(self, request: EngineCoreRequest) -> None:
        if self._dead_error is not None:
            raise self._dead_error.anew()
        super().add_request(request)

    def get_output(self) -> EngineCoreOutputs:
        if self._dead_error is None:
            engine, outputs = self._outputs.get()
            if not isinstance(outputs, EngineDeadError):
                return self._process(engine, outputs)
            self._dead_error = outputs if engine is None else EngineDeadError(f"data-parallel engine {engine}: "
                                                                              f"{outputs}")
            self.shutdown()
        raise self._dead_error.anew()

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """As SyncMPClient's: engines shut down send nothing more, so a get_output() waiting for them raises the
        shut-down error (delivered from no engine: None) instead of waiting for ever."""
        super().shutdown(timeout)
        self._outputs.put((None, EngineDeadError(SHUT_DOWN_MESSAGE)))

    def call_utility(self, method: str, *args: Any) -> Any:
        """``method`` on every live engine, their results combined (combine_utility_results)."""
        return combine_utility_results(method, [call.result() for call in self._call_utility_all(method, *args)])

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.call_utility("reset_prefix_cache", reset_running_requests)

    def get_stats(self) -> SchedulerStats:
        return self.call_utility("get_stats")

    def collective_rpc(self, method: WorkerMethod, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict] = None) -> list:
        return [call.result() for call in self._collective_rpc(method, timeout, args, kwargs)][0]

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        self.call_utility("sleep", level, mode)

    def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        return self.call_utility("wake_up", tags)

    def is_sleeping(self) -> bool:
        return self.call_utility("is_sleeping")

    def profile(self, is_start: bool = True, profile_prefix: Optional[str] = None) -> None:
        self.call_utility("profile", is_start, profile_prefix)
