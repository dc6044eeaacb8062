"""UniProcExecutor: one worker, called directly in the engine core's process."""
from __future__ import annotations

from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.executor.abstract import Executor
from pagedllm.worker.outputs import ModelRunnerOutput
from pagedllm.worker.worker import Worker


class UniProcExecutor(Executor):
    def _init_executor(self) -> None:
        self.worker = Worker(self.config)
        self.worker.load_model()

    def determine_num_kv_blocks(self) -> int:
        return self.worker.determine_num_kv_blocks()

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.worker.initialize_kv_cache(num_blocks)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
