"""Executor: how the engine core reaches its workers (in process today; multi-process and Ray later)."""
from __future__ import annotations

from abc import ABC, abstractmethod

from pagedllm.config import EngineConfig
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.worker.outputs import ModelRunnerOutput


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._init_executor()

    @abstractmethod
    def _init_executor(self) -> None:
        """Start the workers and load the model."""

    @abstractmethod
    def determine_num_kv_blocks(self) -> int:
        """The number of KV blocks every worker can hold."""

    @abstractmethod
    def initialize_kv_cache(self, num_blocks: int) -> None: ...

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput: ...

    def shutdown(self) -> None:
        """Release worker resources."""
