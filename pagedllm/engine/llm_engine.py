"""LLMEngine: the synchronous frontend — Processor in, EngineCore step, OutputProcessor out."""
from __future__ import annotations

import weakref
from functools import partial
from typing import Any, Callable, Mapping, Optional

import torch
from prometheus_client import CollectorRegistry

from pagedllm.config import EngineConfig, check_profile_iterations, check_profile_prefix
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.core import check_sleep_args, check_wake_up_tags
from pagedllm.engine.core_client import make_sync_client, multiprocessing_enabled, start_client_and_tokenizer
from pagedllm.engine.launch import engine_core_prestarted
from pagedllm.engine.output_processor import OutputProcessor
from pagedllm.engine.parallel_sampling import fan_out
from pagedllm.engine.processor import Processor, assign_request_id
from pagedllm.engine.protocol import SUPPORTED_TASKS, EngineCoreRequest, SchedulerStats
from pagedllm.executor.abstract import WorkerMethod
from pagedllm.inputs import PromptType
from pagedllm.lora.request import LoRARequest
from pagedllm.metrics.logger_factories import aggregate, log_stat_loggers, start_stat_loggers
from pagedllm.metrics.loggers import LoggingStatLogger, log_stats_interval
from pagedllm.metrics.prometheus import PrometheusStatLogger
from pagedllm.metrics.reader import Metric, get_metrics_snapshot
from pagedllm.outputs import RequestOutput
from pagedllm.sampling_params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any, engine_core: Any,
                 log_stats_interval: Optional[float] = None,
                 stat_loggers: Optional[list[Callable[[EngineConfig], Any]]] = None) -> None:
        """``engine_core``: make_sync_client's client for ``config``, started. ``log_stats_interval``: None, no stats
        (vLLM's log_stats=False); else every step's stats go to the server's Prometheus metrics, in a registry of
        this engine's own (get_metrics reads them), to the server's log line and to a logger made by each of
        ``stat_loggers`` (vLLM's StatLoggerFactory, called with the config and an engine's index, per engine:
        logger_factories); after a step with outputs, once this many seconds have passed since the last, each
        logger's log() is called (vLLM's do_log_stats_with_interval)."""
        self.config = self.vllm_config = config  # vLLM's name too, as its model_config
        self.model_config = config.model_config
        self.tokenizer = tokenizer
        self.processor = Processor(config.model_config, tokenizer, config.lora_config, config.reasoning_config)
        self.log_stats = log_stats_interval is not None
        self.output_processor = OutputProcessor(tokenizer, self.log_stats, config.scheduler_config.stream_interval)
        self.engine_core = engine_core
        self.asleep = False  # since sleep(), until wake_up() wakes it fully: nothing is scheduled meanwhile
        # The last outputs of the requests sleep() aborted, for the next step() to return, and how many engine requests
        # (an n > 1 request's sequences each) they end: unfinished until then, as vLLM's count them.
        self._aborted_outputs: list[RequestOutput] = []
        self._num_aborted = 0
        self.registry = CollectorRegistry()
        self.stat_loggers: list = []
        self.log_line: Optional[LoggingStatLogger] = None
        if self.log_stats:
            log_line = self.log_line = LoggingStatLogger(config.parallel_config.data_parallel_size,
                                                         log_stats_interval, timer=False)
            # This engine's own loggers first, as factories of the config too: made with the user's, in the
            # one place that stops the engine when making a logger fails.
            own = [partial(PrometheusStatLogger.from_config, config.model_config.model, self.registry),
                   lambda _: log_line]
            self.stat_loggers = start_stat_loggers([*map(aggregate, own), *(stat_loggers or ())], config,
                                                   engine_core)
        # The engine core stops with this object: on shutdown(), when it is garbage-collected, or at the
        # interpreter's exit, whichever comes first (the finalizer holds the engine core, not this object).
        self._finalizer = weakref.finalize(self, engine_core.shutdown)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, usage_context: Any = None,
                         stat_loggers: Optional[list[Callable[[EngineConfig], Any]]] = None,
                         enable_multiprocessing: bool = False) -> "LLMEngine":
        """vLLM's, its arguments in its order: the engine ``engine_args`` configure, its engine core started (in a
        process of its own unless PAGEDLLM_ENABLE_MULTIPROCESSING=0 and not ``enable_multiprocessing``: vLLM's
        VLLM_ENABLE_V1_MULTIPROCESSING overrides the argument the same way) and its tokenizer loaded; statistics on
        unless ``engine_args.disable_log_stats`` (vLLM's log_stats), logged every PAGEDLLM_LOG_STATS_INTERVAL
        seconds, also to ``stat_loggers``' (as vLLM's, in addition to the default ones, and only with statistics
        on). ``usage_context`` feeds vLLM's usage statistics, which pagedllm does not collect."""
        disable_log_stats = not engine_args.log_stats()
        if not disable_log_stats:
            log_stats_interval()  # a bad variable: before any process
        multiprocess = bool(enable_multiprocessing) or multiprocessing_enabled()
        # The fork server imports the engine's modules while the config and tokenizer load (launch.py).
        with engine_core_prestarted(multiprocess):
            return cls._start(engine_args.create_engine_config(), stat_loggers, disable_log_stats, multiprocess)

    @classmethod
    def from_vllm_config(cls, vllm_config: EngineConfig, usage_context: Any = None,
                         stat_loggers: Optional[list[Callable[[EngineConfig], Any]]] = None,
                         disable_log_stats: bool = False) -> "LLMEngine":
        """vLLM's, its arguments in its order: the engine of a config (EngineArgs.create_engine_config's: pagedllm's
        VllmConfig), started as from_engine_args starts it by default, with its ``stat_loggers``."""
        return cls._start(vllm_config, stat_loggers, disable_log_stats, multiprocessing_enabled())

    @classmethod
    def _start(cls, config: EngineConfig, stat_loggers: Optional[list[Callable[[EngineConfig], Any]]],
               disable_log_stats: bool, multiprocess: bool) -> "LLMEngine":
        interval = None if disable_log_stats else log_stats_interval()
        engine_core, tokenizer = start_client_and_tokenizer(config, partial(make_sync_client,
                                                                            multiprocess=multiprocess))
        return cls(config, tokenizer, engine_core, interval, stat_loggers)

    def get_tokenizer(self) -> Any:
        """vLLM's: the tokenizer (Processor.get_tokenizer), a ValueError with skip_tokenizer_init."""
        return self.processor.get_tokenizer()

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                    arrival_time: Optional[float] = None, lora_request: Optional[LoRARequest] = None,
                    tokenization_kwargs: Optional[dict[str, Any]] = None,
                    trace_headers: Optional[Mapping[str, str]] = None, priority: int = 0) -> str:
        """vLLM's LLMEngine.add_request: its arguments in its order (``lora_request``: None is the base model;
        ``tokenization_kwargs``: the tokenizer's for a text prompt; ``trace_headers`` dropped, as vLLM's without
        tracing). As vLLM's, ``request_id`` may be one already running: the request runs under a unique id of its
        own, returned (abort_request's with internal=True), and its outputs carry ``request_id``. What step()
        returns for it follows ``params.output_kind``, as vLLM's (CUMULATIVE unless the params say)."""
        return self.add_processed_request(*self.processor.process(request_id, prompt, params, arrival_time, priority,
                                                                  lora_request, tokenization_kwargs))

    def add_processed_request(self, text: Optional[str], request: EngineCoreRequest) -> str:
        """Queues a request the Processor has already validated and tokenized; returns its unique id."""
        request = assign_request_id(request)
        parent, requests = fan_out(request)
        self.output_processor.add_requests(requests, text, parent)
        for engine_request in requests:
            self.engine_core.add_request(engine_request)
        return request.request_id

    def step(self) -> list[RequestOutput]:
        if self._aborted_outputs:
            aborted, self._aborted_outputs, self._num_aborted = self._aborted_outputs, [], 0
            return aborted
        outputs = self.engine_core.get_output()
        processed = self.output_processor.process_engine_outputs(outputs, self.stat_loggers)
        if self.log_line is not None and outputs.outputs and self.log_line.due():
            self.do_log_stats()
        if processed.reqs_to_abort:
            self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def abort_request(self, request_ids: list[str], internal: bool = False) -> None:
        """Stops the requests, here and in the engine core: as vLLM's, each id is one add_request was given, which
        stops every request added under it (all the sequences of an n > 1 one), or with ``internal`` one that
        add_request returned. As vLLM's, step() returns nothing more for them."""
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids, internal).reqs_to_abort)

    def has_unfinished_requests(self) -> bool:
        return bool(self._aborted_outputs) or self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        """vLLM's: the engine requests not yet finished in step()'s outputs (those sleep() aborted included)."""
        return self._num_aborted + self.output_processor.get_num_unfinished_requests()

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's: loads the adapter into the engine now, for requests to come (its files checked here first, as a
        request's are: a ValueError); True, for one already loaded too."""
        self.processor.validate_lora_to_add(lora_request)
        return self.engine_core.call_utility("add_lora", lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        """vLLM's: unloads the adapter (unpinned); False when it was not loaded. A later request naming it, or the id
        naming another adapter, loads that again."""
        self.processor.validate_lora_id(lora_id)
        self.processor.forget_lora(lora_id)
        return self.engine_core.call_utility("remove_lora", lora_id)

    def list_loras(self) -> set[int]:
        """vLLM's: the ids of the adapters loaded (max_cpu_loras, or one more beside that many pinned)."""
        self.processor.check_lora_enabled()
        return set(self.engine_core.call_utility("list_loras"))

    def pin_lora(self, lora_id: int) -> bool:
        """vLLM's: the loaded adapter is never unloaded to make room (at most max_cpu_loras are pinned); its slot
        is given to another only when a step needs every slot. An id that is not loaded is a ValueError."""
        self.processor.validate_lora_id(lora_id)
        if lora_id not in self.list_loras():
            raise ValueError(f"Pinning failed. LoRA {lora_id} is not registered.")
        return self.engine_core.call_utility("pin_lora", lora_id)

    def get_supported_tasks(self) -> tuple[str, ...]:
        """vLLM's (AsyncLLM.get_supported_tasks)."""
        return SUPPORTED_TASKS

    def reset_mm_cache(self) -> None:
        """vLLM's (LLM.reset_mm_cache): no multi-modal cache here."""

    def reset_encoder_cache(self) -> None:
        """vLLM's: no encoder cache here (the models take text only)."""

    def do_log_stats(self) -> None:
        """vLLM's: every stat logger's log() now, the stats line's included, with stats on (step() calls it every
        PAGEDLLM_LOG_STATS_INTERVAL seconds)."""
        log_stat_loggers(self.stat_loggers)

    def get_stats(self) -> SchedulerStats:
        return self.engine_core.get_stats()

    def reset_prefix_cache(self, reset_running_requests: bool = False, reset_connector: bool = False) -> bool:
        """vLLM's; ``reset_connector`` (its KV connector's cache) has nothing to reset here (LLM.reset_prefix_cache)."""
        return self.engine_core.reset_prefix_cache(reset_running_requests)

    def collective_rpc(self, method: WorkerMethod, timeout: Optional[float] = None, args: tuple = (),
                       kwargs: Optional[dict[str, Any]] = None) -> list[Any]:
        """vLLM's (LLM.collective_rpc)."""
        return self.engine_core.collective_rpc(method, timeout, args, kwargs)

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """vLLM's (LLM.apply_model)."""
        return self.collective_rpc("apply_model", args=(func,))

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """vLLM's (EngineCore.sleep): with ``mode`` "abort" the requests added here are aborted first, and the next
        step() returns each one's last output (finish_reason "abort"), as vLLM's engine sends them: so that
        LLM.wait_for_completion() returns the requests LLM.enqueue() queued, aborted, as vLLM's. With "wait" it returns
        once the engine has finished the requests in flight (their outputs for step() to return) and slept."""
        check_sleep_args(level, mode)
        if mode == "abort":
            outputs = self.output_processor.abort_outputs()  # counted by the stat loggers, as vLLM's
            processed = self.output_processor.process_engine_outputs(outputs, self.stat_loggers)
            aborted = [output.request_id for output in outputs.outputs]
            self.engine_core.abort_requests(aborted)
            self._aborted_outputs += processed.request_outputs
            self._num_aborted += len(aborted)
        self.engine_core.sleep(level, mode)
        self.asleep = True

    def release_kv_cache_memory(self) -> None:
        """vLLM's (LLM.release_kv_cache_memory)."""
        self.engine_core.call_utility("release_kv_cache_memory")

    def wake_up(self, tags: Optional[list[str]] = None) -> bool:
        """vLLM's (EngineCore.wake_up): whether the engine is fully awake."""
        check_wake_up_tags(tags)
        self.asleep = not self.engine_core.wake_up(tags)
        return not self.asleep

    def is_sleeping(self) -> bool:
        return self.engine_core.is_sleeping()

    def start_profile(self, profile_prefix: Optional[str] = None, *, delay_iterations: Optional[int] = None,
                      max_iterations: Optional[int] = None) -> None:
        """vLLM's (LLM.start_profile)."""
        check_profile_prefix(profile_prefix)
        check_profile_iterations(delay_iterations, max_iterations)
        self.engine_core.profile(True, profile_prefix)

    def stop_profile(self) -> None:
        self.engine_core.profile(False)

    def get_metrics(self) -> list[Metric]:
        if not self.log_stats:  # vLLM's assertion, as an error that says what to do
            raise ValueError("get_metrics() needs stat logging, which is off: create the LLM with "
                             "disable_log_stats=False")
        return get_metrics_snapshot(self.registry)

    def shutdown(self) -> None:
        self._finalizer()
