"""EngineCore: the busy loop's body — schedule, execute, update — plus request admission and aborts."""
from __future__ import annotations

import logging

from pagedllm.config import EngineConfig
from pagedllm.core.kv_cache_utils import make_block_hasher
from pagedllm.core.request import Request, RequestStatus
from pagedllm.core.sched.scheduler import Scheduler
from pagedllm.engine.protocol import EngineCoreOutputs, EngineCoreRequest, SchedulerStats
from pagedllm.executor.abstract import Executor
from pagedllm.models.hf_config import load_tokenizer
from pagedllm.structured_output.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(self, config: EngineConfig, executor_class: type[Executor] | None = None) -> None:
        self.config = config
        self.executor = (executor_class or Executor.get_class(config.parallel_config))(config)
        try:
            num_blocks = config.cache_config.num_blocks or self.executor.determine_num_kv_blocks()
            config.cache_config.num_blocks = num_blocks
            self.executor.initialize_kv_cache(num_blocks)
        except BaseException:
            self.executor.shutdown()  # no worker outlives an engine that failed to start
            raise
        model_config = config.model_config
        self.structured_output_manager = StructuredOutputManager(
            lambda: load_tokenizer(model_config.path), model_config.vocab_size, config.scheduler_config.max_num_seqs)
        self.scheduler = Scheduler(config.scheduler_config, config.cache_config, self.structured_output_manager,
                                   use_pp=config.parallel_config.pipeline_parallel_size > 1)
        self._block_hasher = make_block_hasher(config.cache_config.block_size)

    def add_request(self, request: EngineCoreRequest) -> None:
        self.scheduler.add_request(Request(
            request.request_id, request.prompt_token_ids, request.sampling_params,
            eos_token_id=request.eos_token_id, arrival_time=request.arrival_time, priority=request.priority,
            cache_salt=request.cache_salt, block_hasher=self._block_hasher))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def step(self) -> EngineCoreOutputs:
        if not self.scheduler.has_requests():
            return EngineCoreOutputs(scheduler_stats=self.scheduler.make_stats())
        scheduler_output = self.scheduler.schedule()
        if scheduler_output.total_num_scheduled_tokens == 0:
            # Only requests whose grammars are compiling: sleep until one is ready rather than spin.
            self.structured_output_manager.wait_for_any(self.scheduler.waiting_for_grammars(), timeout=0.01)
        model_runner_output = self.executor.execute_model(scheduler_output)
        return self.scheduler.update_from_output(scheduler_output, model_runner_output)

    def reset_prefix_cache(self) -> bool:
        return self.scheduler.reset_prefix_cache()

    def get_stats(self) -> SchedulerStats:
        return self.scheduler.make_stats()

    def shutdown(self) -> None:
        self.structured_output_manager.shutdown()
        self.executor.shutdown()
