"""EngineCore: the busy loop's body — schedule, execute, update — plus request admission and aborts."""
from __future__ import annotations

import functools
import logging
import time
from collections import deque
from concurrent.futures import Future
from typing import Any, Optional

import msgspec

from pagedllm.config import EngineConfig, check_bool
from pagedllm.core.kv_cache_manager import longest_request
from pagedllm.core.kv_cache_utils import make_block_hasher
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.engine_view import EngineView, make_engine_view
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedllm.engine.step_trace import StepTrace
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.executor.abstract import (Executor, ModelRunnerOutputFuture, WorkerMethod, method_name,
                                       run_user_method)
from pagedllm.lora.request import LoRARequest
from pagedllm.worker.outputs import EMPTY_MODEL_RUNNER_OUTPUT
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        self.executor = (executor_class or Executor.get_class(config.parallel_config))(config)
        try:
            num_blocks = config.cache_config.num_blocks or self.executor.determine_num_kv_blocks()
            config.cache_config.num_blocks = num_blocks
            if config.model_config.auto_fit_max_model_len:
                self._fit_max_model_len(num_blocks)
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()  # no worker outlives an engine that failed to start
            raise
        model_config = config.model_config
        self.structured_output_manager = StructuredOutputManager(
            lambda: _load_tokenizer(model_config.tokenizer), model_config.vocab_size,
            config.scheduler_config.max_num_seqs, config.structured_outputs_config.disable_any_whitespace)
        spec = config.speculative_config
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.structured_output_manager,
                                   config.parallel_config.pipeline_parallel_size,
                                   spec.num_speculative_tokens if spec is not None else 0,
                                   spec.num_lookahead_tokens if spec is not None else 0,
                                   config.lora_config.max_loras if config.lora_config is not None else 0)
        # Pipeline parallel: batches in flight, oldest first, so that every stage works on one (vLLM's batch queue).
        self.batch_queue_size = self.executor.max_concurrent_batches
        self.batch_queue: deque[tuple[ModelRunnerOutputFuture, SchedulerOutput]] = deque()
        self._block_hasher = make_block_hasher(config.cache_config.block_size)
        self._added_loras: set[int] = set()  # the adapter ids every worker has loaded once (_add_lora)
        # PAGEDLLM_STEP_TRACE: a line per step (step()'s; the pipeline-parallel batch queue's are not traced).
        self.step_trace = StepTrace.from_env(config.parallel_config.data_parallel_rank)
        # sleep(): nothing is scheduled while paused (requests added meanwhile wait); the workers' KV caches are
        # dropped while kv_cache_asleep.
        self.paused = False
        self.kv_cache_asleep = False

    def _fit_max_model_len(self, num_blocks: int) -> None:
        """vLLM's max_model_len -1: max_model_len lowered to the longest request ``num_blocks`` hold, here and in
        every worker (whose config is a copy), before the workers size their KV caches by it."""
        config = self.config
        cache, configured = config.cache_config, config.model_config.max_model_len
        # Bounded by the step's slots as the scheduler bounds them: fewer would fit a length whose requests it refuses.
        fitted = longest_request(cache.group_windows, cache.block_size, num_blocks, config.max_step_slots, configured)
        if fitted < 2:  # a request needs a prompt token and room for one output token
            raise ValueError(f"Cannot auto-fit max_model_len: the KV cache ({num_blocks} blocks of "
                             f"{cache.block_size} tokens) holds no request; raise kv_cache_memory")
        if fitted == configured:
            logger.info("Auto-fit max_model_len: the model's context length %d fits in the KV cache", configured)
            return
        logger.info("Auto-fit max_model_len: reduced from %d to %d to fit in the KV cache (%d blocks of %d tokens)",
                    configured, fitted, num_blocks, cache.block_size)
        config.model_config.max_model_len = config.scheduler_config.max_model_len = fitted
        self.executor.collective_rpc("update_max_model_len", (fitted,))

    def add_request(self, request: EngineCoreRequest) -> None:
        new = Request(
            request.request_id, request.prompt_token_ids, request.sampling_params,
            eos_token_id=request.eos_token_id, arrival_time=request.arrival_time, priority=request.priority,
            cache_salt=request.cache_salt, block_hasher=self._block_hasher, lora_request=request.lora_request)
        error = self._add_lora(request.lora_request)
        if error is not None:
            self.scheduler.reject(new, error)
            return
        try:
            self.scheduler.add_request(new)
        except ValueError as e:
            # An id already in flight (the frontends never send one; a direct caller of the engine core may): this
            # request fails with an error output and the engine serves on, as vLLM's fails a request it cannot take
            # (_handle_request_preproc_error) rather than the engine.
            self.scheduler.reject(new, str(e))

    def _add_lora(self, lora_request: Optional[LoRARequest]) -> Optional[str]:
        """Every worker loads an adapter the first time a request names it (vLLM loads it when it is added), and
        again for each request that reloads it (load_inplace), so that files that cannot be read fail that request
        rather than a step; why the request cannot run, else None."""
        if lora_request is None or (lora_request.lora_int_id in self._added_loras and not lora_request.load_inplace):
            return None
        error = self._lora_error("add_lora", lora_request)
        if error is None:
            self._added_loras.add(lora_request.lora_int_id)
        return error

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: every worker loads the adapter now (again with load_inplace), for requests to come; True, as vLLM's
        for one already loaded too. What loading raised is this ValueError; the engine serves on."""
        lora_request = msgspec.convert(lora_request, LoRARequest)  # from the frontend's socket, a plain array
        error = self._lora_error("add_lora", lora_request)
        if error is not None:
            raise ValueError(error)
        self._added_loras.add(lora_request.lora_int_id)
        return True

    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's: the adapter is dropped from every worker; whether it was loaded. A later request naming it loads
        it again."""
        self._added_loras.discard(lora_id)
        return all(self.executor.collective_rpc("remove_lora", (lora_id,)))

    def pin_lora(self, lora_id: int) -> bool:
        """vLLM's: the adapter is never dropped from the workers' kept ones (WorkerLoRAManager.pin)."""
        error = self._lora_error("pin_lora", lora_id)
        if error is not None:
            raise ValueError(error)
        return True

    def list_loras(self) -> list[int]:
        """vLLM's: the ids of the adapters the workers keep loaded (a list, for the frontend's socket)."""
        return sorted(self.executor.collective_rpc("list_loras")[0])

    def _lora_error(self, method: str, arg: Any) -> Optional[str]:
        """The first worker's refusal of the LoRA call ``method`` (Worker.add_lora, pin_lora: returned, not raised, so
        that the engine serves on), else None."""
        return next((e for e in self.executor.collective_rpc(method, (arg,)) if e is not None), None)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def can_schedule(self) -> bool:
        """Whether a step may schedule: requests to run, and the engine not paused (sleep, pause_scheduler)."""
        return not self.paused and self.scheduler.has_requests()

    def has_work(self) -> bool:
        """Whether a step would do anything: schedule, or finish pipeline-parallel batches in flight (a paused
        engine finishes those)."""
        return self.can_schedule() or bool(self.batch_queue)

    def step(self) -> EngineCoreOutputs:
        if self.batch_queue_size > 1:
            return self.step_with_batch_queue()
        if not self.can_schedule():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        step_start = time.perf_counter()
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Only requests whose grammars are compiling: sleep until one is ready rather than spin.
            self.structured_output_manager.wait_for_any(self.scheduler.waiting_for_grammars(), timeout=0.01)
        start = time.perf_counter()
        model_runner_output = self.executor.execute_model(scheduler_output)
        executed = time.perf_counter()
        if not model_runner_output.captured_graph:  # a capture's time would tell dynamic speculation nothing true
            self.scheduler.record_step_time(scheduler_output, executed - start)
        outputs = self.scheduler.update_from_output(scheduler_output, model_runner_output)
        if self.step_trace is not None:
            self.step_trace.record(scheduler_output, step_start, start, executed, time.perf_counter())
        return outputs

    def step_with_batch_queue(self) -> EngineCoreOutputs:
        """Submit a new batch while fewer than batch_queue_size are in flight; otherwise (or when nothing new can
        run) wait for the oldest and apply its output. Outputs are empty when the call only submitted."""
        if len(self.batch_queue) < self.batch_queue_size and self.can_schedule():
            scheduler_output = self.scheduler.schedule()
            if (scheduler_output.total_num_scheduled_tokens or scheduler_output.finished_req_ids
                    or scheduler_output.preempted_req_ids):  # the workers must see removals, even without tokens
                future = self.executor.execute_model(scheduler_output, non_block=True)
                self.batch_queue.append((future, scheduler_output))
                if len(self.batch_queue) < self.batch_queue_size:
                    return EngineCoreOutputs()
            else:  # nothing runnable now: deliver refusals, or wait for grammars when nothing is in flight
                if not self.batch_queue and self.scheduler.waiting_for_grammars():
                    self.structured_output_manager.wait_for_any(self.scheduler.waiting_for_grammars(), timeout=0.01)
                outputs = self.scheduler.update_from_output(scheduler_output, EMPTY_MODEL_RUNNER_OUTPUT)
                if outputs.outputs or not self.batch_queue:
                    return outputs
        if not self.batch_queue:
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        future, scheduler_output = self.batch_queue.popleft()
        return self.scheduler.update_from_output(scheduler_output, future.result())

    def reset_prefix_cache(self, reset_running_requests: bool = False) -> bool:
        return self.scheduler.reset_prefix_cache(reset_running_requests)

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def collective_rpc(self, method: WorkerMethod, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict[str, Any]] = None) -> list[Any]:
        """vLLM's: ``method`` (a Worker method's name, or a function called with the worker first) run on every
        worker, their results in rank order. A method that raises on a rank fails this call with a RuntimeError
        naming the method, the rank and its exception; the engine serves on (as vLLM's)."""
        replies = self.executor.collective_rpc(functools.partial(run_user_method, method, args, kwargs),
                                               timeout=timeout)
        failures = [f"worker rank {rank} raised {error}" for rank, (ok, error) in enumerate(replies) if not ok]
        if failures:
            raise RuntimeError(f"collective_rpc {method_name(method)} failed: {'; '.join(failures)}")
        return [result for _, result in replies]

    def pause_scheduler(self, mode: str = "abort", clear_cache: bool = True) -> Optional[Future]:
        """vLLM's: the engine stops scheduling (requests added meanwhile wait); ``mode`` "abort" ends every request
        first, "keep" keeps them, to go on after resume_scheduler. ``clear_cache`` empties the prefix cache, the
        running requests preempted (to recompute when they resume). Returns None, paused: vLLM's "wait" mode (pause
        once the requests in flight finish, a Future) needs the engine's busy loop (EngineCoreProc), and is refused
        here as vLLM's in-process engine refuses it."""
        check_pause_args(mode, clear_cache)
        if mode == "wait":
            raise ValueError("mode 'wait' needs the engine in a process of its own (PAGEDLLM_ENABLE_MULTIPROCESSING=1)"
                             ", as vLLM's: it can't be used in-process.")
        if clear_cache and self.batch_queue:
            self.paused = True  # no new batch: the busy loop finishes those in flight meanwhile
            raise RuntimeError("Cannot empty the caches while pipeline-parallel batches are in flight: the engine is "
                               "paused, and they finish; try again.")
        if mode == "abort":
            self.abort_requests(list(self.scheduler.requests))
        self.paused = True
        if clear_cache:
            self.scheduler.reset_prefix_cache(reset_running_requests=True)
        return None

    def resume_scheduler(self) -> None:
        """vLLM's: scheduling resumes (after pause_scheduler; after sleep(level >= 1), wake_up brings the KV cache
        back first)."""
        if self.kv_cache_asleep:
            raise RuntimeError("The KV cache is asleep (sleep()); call wake_up() to resume.")
        self.paused = False

    def is_scheduler_paused(self) -> bool:
        return self.paused

    def sleep(self, level: int = 1, mode: str = "abort") -> Optional[Future]:
        """vLLM's: pause_scheduler, which at level 1 and 2 also empties the prefix cache, and then drops the workers'
        KV caches, their memory given back (Worker.sleep): on the CPU the weights, in host memory already, stay.
        With ``mode`` "wait" the KV caches go once the pause completes: the Future of that."""
        check_sleep_args(level, mode)
        paused = self.pause_scheduler(mode, clear_cache=level >= 1)
        if level < 1:
            return paused
        if paused is None:
            self._sleep_kv_cache(level)
            return None
        slept: Future = Future()

        def release(pause: Future) -> None:
            try:
                pause.result()
                self._sleep_kv_cache(level)
            except Exception as e:
                slept.set_exception(e)
            else:
                slept.set_result(None)

        paused.add_done_callback(release)
        return slept

    def _sleep_kv_cache(self, level: int) -> None:
        if not self.kv_cache_asleep:
            self._release_kv_cache(level)

    def release_kv_cache_memory(self) -> None:
        """vLLM's: once paused (sleep(level=0), pause_scheduler), the workers' KV caches go as sleep(level=1) drops
        them, the requests kept preempted to recompute after wake_up(tags=["kv_cache"]), which makes them anew."""
        if not self.paused or self.batch_queue:
            raise RuntimeError("release_kv_cache_memory() requires a completed pause first (sleep(level=0))")
        if self.kv_cache_asleep:
            raise RuntimeError("release_kv_cache_memory(): the KV cache is released already (sleep())")
        self.scheduler.reset_prefix_cache(reset_running_requests=True)
        self._release_kv_cache(1)

    def _release_kv_cache(self, level: int) -> None:
        self.executor.collective_rpc("sleep", kwargs={"level": level})
        self.kv_cache_asleep = True

    def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        """vLLM's: ``tags`` None wakes everything; else of "weights" (nothing to do on the CPU, where they never
        leave), "kv_cache" (the workers' KV caches made anew) and "scheduling". Scheduling resumes once the KV cache
        is back; returns whether the engine is fully awake."""
        check_wake_up_tags(tags)
        if self.kv_cache_asleep and (tags is None or "kv_cache" in tags):
            self.executor.initialize_kv_cache(self.config.cache_config.num_blocks)
            self.kv_cache_asleep = False
        if not self.kv_cache_asleep:
            self.resume_scheduler()
        return not self.paused

    def is_sleeping(self) -> bool:
        return self.paused

    def profile(self, is_start: bool = True, profile_prefix: Optional[str] = None) -> None:
        """vLLM's: every worker starts or stops its profiler (Worker.profile); a refusal fails the call only."""
        self.collective_rpc("profile", args=(is_start, profile_prefix))

    def get_engine_view(self) -> EngineView:
        return make_engine_view(self.scheduler)

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()


def check_pause_args(mode: str, clear_cache: bool = True) -> None:
    """pause's (and sleep's) arguments, checked by the frontend before anything happens (and by the engine)."""
    if mode not in ("abort", "wait", "keep"):
        raise ValueError(f"mode must be 'abort', 'wait' or 'keep', got {mode!r}.")
    check_bool("clear_cache", clear_cache)


def check_sleep_args(level: int, mode: str) -> None:
    if level not in (0, 1, 2) or isinstance(level, bool):
        raise ValueError(f"level must be 0, 1 or 2, got {level!r}.")
    check_pause_args(mode)


def check_wake_up_tags(tags: Optional[list[str]]) -> None:
    unknown = [tag for tag in tags or () if tag not in ("weights", "kv_cache", "scheduling")]
    if unknown:
        raise ValueError(f"tags must be of 'weights', 'kv_cache' and 'scheduling', got {unknown!r}.")


def _load_tokenizer(path: str):
    """The tokenizer, for the grammars of structured output: imported here, when a first request needs one, so
    that an engine process never imports transformers (most of its start-up) for requests that do not."""
    from pagedllm.models.hf_config import load_tokenizer
    return load_tokenizer(path)
