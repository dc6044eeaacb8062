"""AsyncLLM: the asyncio frontend used by the server.

Requests are tokenized here (never in the engine process) and sent to the EngineCore process; one background
task pulls the engine's output batches, detokenizes them in the OutputProcessor and routes each RequestOutput
to its request's RequestOutputCollector, which merges those its consumer has not taken yet (vLLM's). A consumer
that stops iterating (client disconnect) aborts its request in the engine.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from typing import Any, AsyncIterator, Callable, Iterable, Mapping, Optional, Union

import msgspec

from pagedllm.beam_search import BeamSearchInstance, BeamSearchSequence
from pagedllm.core.sched.engine_view import EngineView
from pagedllm.config import EngineConfig, check_profile_iterations, check_profile_prefix
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import check_pause_args, check_sleep_args, check_wake_up_tags
from pagedllm.engine.core_client import make_async_client, start_client_and_tokenizer
from pagedllm.engine.exceptions import EngineDeadError, not_a_pooling_model
from pagedllm.engine.output_processor import OutputProcessor, RequestOutputCollector
from pagedllm.engine.parallel_sampling import fan_out
from pagedllm.engine.processor import Processor, assign_request_id, cache_salt_of
from pagedllm.engine.protocol import SUPPORTED_TASKS, EngineCoreOutputs, SchedulerStats
from pagedllm.executor.abstract import WorkerMethod
from pagedllm.inputs import PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.logger_factories import log_stat_loggers, start_stat_loggers
from pagedllm.metrics.loggers import default_stat_loggers
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import BeamSearchParams, SamplingParams

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.05  # how often wait_for_requests_to_drain looks


class AsyncLLM:
    def __init__(self, config, tokenizer: Any, engine_core: Any,
                 stat_loggers: Optional[list[Callable[[Any], Any]]] = None, log_requests: bool = False) -> None:
        """``engine_core``: make_async_client's client for ``config``, started (from_engine_args makes both).
        ``stat_loggers``: factories (vLLM's StatLoggerFactory: called with the resolved config and an engine's
        index, per data-parallel engine; pagedllm's own, marked aggregate, with the config once: logger_factories),
        whose loggers record every step's stats; each that has vLLM's log_engine_initialized() is called once the
        engine has started. ``log_requests``: log each request added and aborted (vLLM's)."""
        self.config = self.vllm_config = config  # vLLM's name too, as its model_config
        self.log_requests = log_requests
        self.model_config = config.model_config
        self.tokenizer = tokenizer
        self.processor = Processor(config.model_config, tokenizer, config.lora_config, config.reasoning_config)
        self.stat_loggers = start_stat_loggers(stat_loggers or (), config, engine_core)
        self.output_processor = OutputProcessor(tokenizer, log_stats=bool(self.stat_loggers),
                                                stream_interval=config.scheduler_config.stream_interval)
        self.engine_core = engine_core
        self._dead_error: Optional[EngineDeadError] = None
        # Request id -> an event per beam search running under it, set when abort() names the id (beam_search)
        self._beam_search_aborts: dict[str, list[asyncio.Event]] = {}
        # The task taking the engine's outputs (in a list the finalizer shares): started here where an event loop
        # runs, else by the first request, in its loop (vLLM's: an AsyncLLM may be made before its loop runs).
        self._output_handler: list[asyncio.Task] = []
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            self._start_output_handler()
        # The engine stops with this object: on shutdown(), when it is garbage-collected, or at the interpreter's
        # exit, whichever comes first (vLLM's __del__). Nothing it starts holds it (the output handler has a weak
        # reference), so an AsyncLLM dropped without shutdown() does not keep its engine process for ever.
        self._finalizer = weakref.finalize(self, _stop, engine_core, self._output_handler)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: Optional[list[Callable[[Any], Any]]] = None) -> "AsyncLLM":
        """vLLM's, with or without an event loop running (without, the engine's outputs go to the loop of the first
        request). As vLLM's, the ``stat_loggers`` factories' loggers, and vLLM's defaults unless
        ``engine_args.disable_log_stats``: the log line (logged when do_log_stats() is called) and the pagedllm:
        metrics in prometheus_client's default registry. ``engine_args.enable_log_requests`` (AsyncEngineArgs')
        logs each request. ``start_engine_loop`` and ``usage_context`` are taken as vLLM's V1 takes them and change
        nothing: its output handler starts as this one's does, and its usage context feeds its usage statistics,
        which pagedllm does not collect."""
        disable_log_stats = not engine_args.log_stats()  # a bad value refused before the config loads
        return cls.from_vllm_config(engine_args.create_engine_config(), stat_loggers=stat_loggers,
                                    enable_log_requests=getattr(engine_args, "enable_log_requests", False),
                                    disable_log_stats=disable_log_stats)

    @classmethod
    def from_vllm_config(cls, vllm_config: EngineConfig, start_engine_loop: bool = True, usage_context: Any = None,
                         stat_loggers: Optional[list[Callable[[Any], Any]]] = None, enable_log_requests: bool = False,
                         aggregate_engine_logging: bool = False, disable_log_stats: bool = False) -> "AsyncLLM":
        """vLLM's: the AsyncLLM of a config (EngineArgs.create_engine_config's: pagedllm's VllmConfig), its engine
        started; as from_engine_args (``start_engine_loop`` and ``usage_context`` as there), with vLLM's default
        stat loggers, after ``stat_loggers``', unless ``disable_log_stats``, when the custom loggers run alone
        (vLLM's StatLoggerManager keeps its Prometheus logger then, unless a custom logger is one). vLLM's
        ``aggregate_engine_logging`` (one stats line for all data-parallel engines) is refused: the line here is
        per engine."""
        if aggregate_engine_logging:
            raise ValueError("aggregate_engine_logging is not supported: the stats line is logged per data-parallel "
                             "engine")
        stat_loggers = list(stat_loggers or ()) + ([] if disable_log_stats else default_stat_loggers())
        engine_core, tokenizer = start_client_and_tokenizer(vllm_config, make_async_client)
        return cls(vllm_config, tokenizer, engine_core, stat_loggers, enable_log_requests)

    def get_tokenizer(self) -> Any:
        """vLLM's: the tokenizer (Processor.get_tokenizer), a ValueError with skip_tokenizer_init."""
        return self.processor.get_tokenizer()

    def get_num_unfinished_requests(self) -> int:
        """vLLM's: the requests generate() is still running (an n > 1 request's sequences each)."""
        return self.output_processor.get_num_unfinished_requests()

    async def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's: what this engine's model serves."""
        return SUPPORTED_TASKS

    async def reset_mm_cache(self) -> None:
        """vLLM's (LLM.reset_mm_cache): no multi-modal cache here."""

    async def reset_encoder_cache(self) -> None:
        """vLLM's: no encoder cache here (the models take text only)."""

    async def wait_for_requests_to_drain(self, drain_timeout: float = 300) -> None:
        """vLLM's: returns once no request is in flight, else a TimeoutError after ``drain_timeout`` seconds."""
        deadline = time.monotonic() + drain_timeout
        while self.output_processor.has_unfinished_requests():
            if time.monotonic() >= deadline:
                raise TimeoutError(f"Timeout reached after {drain_timeout} seconds waiting for requests to drain.")
            await asyncio.sleep(DRAIN_POLL_S)

    @property
    def is_running(self) -> bool:
        """vLLM's: the engine serves (neither shut down nor dead)."""
        return not self.errored

    @property
    def is_stopped(self) -> bool:
        return self.errored

    @property
    def dead_error(self) -> BaseException:
        """The error of a shut-down or dead engine: one that died before the output handler took its death (no
        request yet) is known by the client's error, with the engine's last words. Each one new (anew)."""
        error = self._dead_error or self.engine_core.dead_error
        return EngineDeadError() if error is None else error.anew()

    async def do_log_stats(self) -> None:
        """vLLM's: the stat loggers' log line now (the server's also logs by a timer of its own)."""
        log_stat_loggers(self.stat_loggers)

    @property
    def errored(self) -> bool:
        return self._dead_error is not None or self.engine_core.dead

    async def check_health(self) -> None:
        """Raises once an engine is dead (with data parallelism, any one: the others still take requests)."""
        if self.errored:
            raise self.dead_error
        dead = getattr(self.engine_core, "dead_engines", [])
        if dead:
            raise EngineDeadError(f"data-parallel engine(s) {dead} died; {len(self.engine_core.engines) - len(dead)} "
                                  f"still serve")

    # ------------------------------------------------------------------------------------------ requests
    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: Optional[float] = None, lora_request: Optional[LoRARequest] = None,
                          tokenization_kwargs: Optional[dict[str, Any]] = None,
                          trace_headers: Optional[Mapping[str, str]] = None, priority: int = 0,
                          data_parallel_rank: Optional[int] = None, *,
                          prompt_text: Optional[str] = None) -> RequestOutputCollector:
        """vLLM's low-level API, its arguments in its order: adds the request and returns the collector its outputs
        come to (generate() reads it). vLLM's ``tokenization_kwargs`` go to the tokenizer for a text prompt;
        ``trace_headers`` are dropped, as vLLM's drops them without tracing (none here); ``data_parallel_rank`` runs
        the request on that data-parallel engine; ``prompt_text`` is unused, as vLLM's is for every prompt but an
        already processed request (which it does not take here): the outputs' prompt is the prompt's own text. Bad
        input is a ValueError, nothing added."""
        if self.errored:
            raise self.dead_error
        self._start_output_handler()
        text, request = self.processor.process(request_id, prompt, params, arrival_time, priority, lora_request,
                                               tokenization_kwargs)
        if data_parallel_rank is not None:
            num_ranks = self.config.parallel_config.data_parallel_size
            if (isinstance(data_parallel_rank, bool) or not isinstance(data_parallel_rank, int)
                    or not 0 <= data_parallel_rank < num_ranks):
                raise ValueError(f"data_parallel_rank {data_parallel_rank!r} is out of range [0, {num_ranks}).")
            request = msgspec.structs.replace(request, data_parallel_rank=data_parallel_rank)
        request = assign_request_id(request)
        if self.log_requests:
            logger.info("Added request %s.", request.request_id)
        collector = RequestOutputCollector(params.output_kind, request.request_id)
        parent, requests = fan_out(request)
        self.output_processor.add_requests(requests, text, parent, collector)
        try:
            for engine_request in requests:
                self.engine_core.add_request(engine_request)
        except BaseException:  # a dead engine: none of its sequences is left behind
            self._abort([request.request_id], internal=True)
            raise
        return collector

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams, request_id: str,
                       priority: int = 0, lora_request: Optional[LoRARequest] = None, *,
                       tokenization_kwargs: Optional[dict[str, Any]] = None,
                       trace_headers: Optional[Mapping[str, str]] = None,
                       data_parallel_rank: Optional[int] = None,
                       prompt_text: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as ``sampling_params.output_kind`` says, as vLLM's: by default each holds everything
        so far (CUMULATIVE); a stream asks for DELTA, a caller wanting only the end for FINAL_ONLY. As vLLM's,
        ``request_id`` may be one already running: the request runs under a unique id of its own
        (assign_request_id), its outputs carry ``request_id``, and abort(request_id) stops all it names. The
        keywords are add_request's. A consumer that stops iterating aborts the request."""
        collector = await self.add_request(request_id, prompt, sampling_params, None, lora_request,
                                           tokenization_kwargs, trace_headers, priority, data_parallel_rank,
                                           prompt_text=prompt_text)
        finished = False
        try:
            while not finished:
                output = await collector.get()
                finished = output.finished
                yield output
        finally:
            if not finished:
                self._abort([collector.request_id], internal=True)

    async def encode(self, prompt: PromptType, pooling_params: Any, request_id: str,
                     lora_request: Optional[LoRARequest] = None, trace_headers: Optional[Mapping[str, str]] = None,
                     priority: int = 0, tokenization_kwargs: Optional[dict[str, Any]] = None,
                     reasoning_ended: Optional[bool] = None) -> AsyncIterator[Any]:
        """vLLM's pooling counterpart of generate(), with its arguments. pagedllm runs generative models only, so
        this is vLLM's ValueError for one (its input processor's "This model does not support pooling"), raised as
        vLLM's is: by the first step of the iteration, not by the call, and before any request reaches the engine."""
        raise not_a_pooling_model("This model does not support pooling.")
        yield  # unreached: it makes encode an async generator, as vLLM's

    async def beam_search(self, prompt: PromptType, request_id: str, params: BeamSearchParams, priority: int = 0,
                          lora_request: Optional[LoRARequest] = None) -> AsyncIterator[RequestOutput]:
        """vLLM's frontend beam search (see pagedllm.beam_search): yields one finished RequestOutput whose
        outputs are the beam_width best beams, best first. Each step runs the live beams concurrently, each under
        ``request_id`` (as generate() runs requests sharing an id, each under a unique one of its own), so that
        abort(request_id) stops all of them; the search then ends as vLLM's does on an aborted step, its live beams
        finishing with "abort". An abort that comes between two steps, when no step request runs, ends it before
        the next."""
        text, token_ids = self.processor.tokenize(prompt)
        instance = BeamSearchInstance(token_ids, params, self.processor.eos_token_id, cache_salt_of(prompt))
        step_params = params.step_sampling_params()

        async def last_output(beam: BeamSearchSequence) -> RequestOutput:
            async for output in self.generate(instance.step_prompt(beam), step_params, request_id, priority,
                                              lora_request):
                pass
            return output

        aborted = asyncio.Event()
        self._beam_search_aborts.setdefault(request_id, []).append(aborted)
        try:
            while not instance.finished:
                if aborted.is_set():
                    instance.abort()
                    break
                outputs = await asyncio.gather(*(last_output(beam) for beam in instance.beams))
                if any(output.outputs[0].finish_reason == "abort" for output in outputs):
                    instance.abort()
                else:
                    instance.step(outputs)
        finally:
            searches = self._beam_search_aborts[request_id]
            searches.remove(aborted)
            if not searches:
                del self._beam_search_aborts[request_id]
        yield instance.request_output(request_id, text, self.tokenizer)

    async def abort(self, request_id: Union[str, Iterable[str]], internal: bool = False) -> None:
        """vLLM's: stops one request or several, each id one generate() was given, which stops every request
        running under it (all the sequences of an n > 1 one); the generate() of each ends with a last output whose
        finish_reason is "abort". With ``internal`` (vLLM's), each id is the unique one a request runs under
        (add_request's collector.request_id), which stops that request alone."""
        request_ids = [request_id] if isinstance(request_id, str) else list(request_id)
        if self.log_requests:
            logger.info("Aborted request(s) %s.", ",".join(request_ids))
        for request_id in [] if internal else request_ids:  # a beam search is known by the id it was given
            for aborted in self._beam_search_aborts.get(request_id, ()):
                aborted.set()
        self._abort(request_ids, internal)

    def _abort(self, request_ids: list[str], internal: bool = False) -> None:
        processed = self.output_processor.abort_requests(request_ids, internal)
        if not self.errored and processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)

    def _abort_all_as_the_engine(self) -> None:
        """Ends every request with the "abort" output vLLM's engine sends when it pauses or sleeps (abort_outputs),
        which the stat loggers count, and aborts them in the engine core."""
        outputs = self.output_processor.abort_outputs()
        self._process_outputs(outputs)
        if not self.errored and outputs.outputs:
            self.engine_core.abort_requests([output.request_id for output in outputs.outputs])

    # ------------------------------------------------------------------------------------------ outputs
    def _start_output_handler(self) -> None:
        """The output handler, in the running event loop, unless it has started. Outputs go to one loop, as
        vLLM's: a request from another (a second asyncio.run()) is a RuntimeError, where it would wait for ever."""
        loop = asyncio.get_running_loop()
        if not self._output_handler:
            self._output_handler.append(loop.create_task(self._run_output_handler(weakref.ref(self),
                                                                                  self.engine_core)))
        elif self._output_handler[0].get_loop() is not loop:
            raise RuntimeError("This AsyncLLM serves the event loop of its first request (or the one it was made "
                               "in); make another for this loop.")

    @staticmethod
    async def _run_output_handler(engine_ref: "weakref.ref[AsyncLLM]", engine_core: Any) -> None:
        """Hands each batch of the engine's outputs to the AsyncLLM, holding it only meanwhile."""
        try:
            while True:
                outputs = await engine_core.get_output_async()
                engine = engine_ref()
                if engine is None:
                    return
                engine._process_outputs(outputs)
                del engine
        except EngineDeadError as e:
            engine = engine_ref()
            if engine is not None:
                engine._dead_error = e
                logger.error("The engine process died; failed %d in-flight requests.",
                             engine.output_processor.propagate_error(e))

    def _process_outputs(self, outputs: EngineCoreOutputs) -> None:
        if outputs.engine_dead is not None:  # one data-parallel engine died: only its requests fail
            logger.error("%s; failing its %d in-flight requests, the other engines serve on.",
                         outputs.engine_dead, len(outputs.failed_request_ids))
            self._fail_requests(outputs.failed_request_ids, EngineDeadError(outputs.engine_dead))
            for stat_logger in self.stat_loggers:  # its gauges fall to nothing held, its log line stops
                stat_logger.record(SchedulerStats(), None, engine_idx=outputs.engine_index)
            return
        processed = self.output_processor.process_engine_outputs(outputs, self.stat_loggers)
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)

    def _fail_requests(self, engine_request_ids: list[str], error: EngineDeadError) -> None:
        """The generate() of each raises ``error`` (before the abort outputs that forget the requests reach it); that
        of an n > 1 request then aborts its sequences on the engines that serve on."""
        self.output_processor.propagate_error(error, engine_request_ids)
        self.output_processor.abort_requests(engine_request_ids, internal=True)

    # ------------------------------------------------------------------------------------------ utilities
    async def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's; ``reset_connector`` (its KV connector's cache) has nothing to reset here (LLM.reset_prefix_cache)."""
        return await self.engine_core.call_utility_async("reset_prefix_cache", reset_running_requests)

    async def get_stats(self) -> SchedulerStats:
        return msgspec.convert(await self.engine_core.call_utility_async("get_stats"), SchedulerStats)

    async def collective_rpc(self, method: WorkerMethod, timeout: Optional[float] = None, args: tuple = (),
                             kwargs: Optional[dict[str, Any]] = None) -> list[Any]:
        """vLLM's (LLM.collective_rpc): with data parallelism, it runs on every engine's workers and returns the
        first engine's results, as vLLM's."""
        return await self.engine_core.collective_rpc_async(method, timeout, args, kwargs)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's (LLMEngine.add_lora)."""
        self.processor.validate_lora_to_add(lora_request)
        return await self.engine_core.call_utility_async("add_lora", lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """vLLM's (LLMEngine.remove_lora)."""
        self.processor.validate_lora_id(lora_id)
        self.processor.forget_lora(lora_id)
        return await self.engine_core.call_utility_async("remove_lora", lora_id)

    async def list_loras(self) -> set[int]:
        """vLLM's (LLMEngine.list_loras)."""
        self.processor.check_lora_enabled()
        return set(await self.engine_core.call_utility_async("list_loras"))

    async def pin_lora(self, lora_id: int) -> bool:
        """vLLM's (LLMEngine.pin_lora)."""
        self.processor.validate_lora_id(lora_id)
        if lora_id not in await self.list_loras():
            raise ValueError(f"Pinning failed. LoRA {lora_id} is not registered.")
        return await self.engine_core.call_utility_async("pin_lora", lora_id)

    async def pause_generation(self, *, mode: str = "abort", clear_cache: bool = True) -> None:
        """vLLM's (EngineCore.pause_scheduler): nothing is scheduled until resume_generation(); with ``mode`` "abort"
        every request ends first with an "abort" output, with "wait" it returns once they have finished (requests
        added meanwhile wait), with "keep" they wait."""
        check_pause_args(mode, clear_cache)
        if mode == "abort":
            self._abort_all_as_the_engine()
        await self.engine_core.call_utility_async("pause_scheduler", mode, clear_cache)

    async def resume_generation(self) -> None:
        await self.engine_core.call_utility_async("resume_scheduler")

    async def is_paused(self) -> bool:
        return await self.engine_core.call_utility_async("is_scheduler_paused")

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's (EngineCore.sleep): with ``mode`` "abort" every request ends first with an "abort" output, with
        "wait" the engine sleeps once they have finished; requests added meanwhile, or while asleep, wait for
        wake_up."""
        check_sleep_args(level, mode)
        if mode == "abort":
            self._abort_all_as_the_engine()
        await self.engine_core.call_utility_async("sleep", level, mode)

    async def release_kv_cache_memory(self) -> None:
        """vLLM's (LLM.release_kv_cache_memory)."""
        await self.engine_core.call_utility_async("release_kv_cache_memory")

    async def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        """vLLM's (EngineCore.wake_up): whether the engine is fully awake."""
        check_wake_up_tags(tags)
        return await self.engine_core.call_utility_async("wake_up", tags)

    async def is_sleeping(self) -> bool:
        return await self.engine_core.call_utility_async("is_sleeping")

    async def start_profile(self, profile_prefix: Optional[str] = None, *, delay_iterations: Optional[int] = None,
                            max_iterations: Optional[int] = None) -> None:
        """vLLM's (LLM.start_profile); the workers are traced, not this process."""
        check_profile_prefix(profile_prefix)
        check_profile_iterations(delay_iterations, max_iterations)
        await self.engine_core.call_utility_async("profile", True, profile_prefix)

    async def stop_profile(self) -> None:
        await self.engine_core.call_utility_async("profile", False)

    async def get_engine_views(self) -> list[EngineView]:
        """Each engine's view (one per data-parallel rank, in rank order; the dead ones left out)."""
        views = await self.engine_core.call_utility_async("get_engine_view")
        return msgspec.convert(views if isinstance(views, list) else [views], list[EngineView])

    def shutdown(self, timeout: Optional[float] = None) -> None:
        """Ends in-flight requests with finish_reason "abort", then stops the engine process, killing it if it has not
        exited within ``timeout`` seconds (vLLM's; None: the default wait). A ``timeout`` that is no finite number of
        seconds, 0 or more, is a ValueError, nothing stopped."""
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not math.isfinite(timeout) or timeout < 0):
            raise ValueError(f"timeout must be a number of seconds (0 or more) or None, got {timeout!r}")
        self._dead_error = EngineDeadError("The engine is shut down.")
        self.output_processor.abort_all()
        if self._finalizer.detach() is not None:
            _stop(self.engine_core, self._output_handler, timeout)


def _stop(engine_core: Any, output_handler: list[asyncio.Task], timeout: Optional[float] = None) -> None:
    """Stops the engine and the output handler where it has started (from any thread: the collector may run the
    finalizer anywhere)."""
    engine_core.shutdown(timeout)
    for task in output_handler:
        loop = task.get_loop()
        if not loop.is_closed():
            loop.call_soon_threadsafe(task.cancel)


AsyncLLMEngine = AsyncLLM  # vLLM's name for it (vllm.AsyncLLMEngine)
