"""Worker: owns one device's model runner; sizes and allocates its KV cache from a memory budget."""
from __future__ import annotations

import logging

import psutil
import torch

from pagedllm.config import EngineConfig, parse_memory_size
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.platforms.cpu import keep_freed_memory
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.outputs import ModelRunnerOutput

logger = logging.getLogger(__name__)

# Without an explicit budget, the CPU KV cache takes this share of available RAM, up to the cap.
DEFAULT_CPU_KV_FRACTION = 0.1
DEFAULT_CPU_KV_CAP = 4 << 30


def kv_cache_bytes_per_block(config: EngineConfig) -> int:
    mc = config.model_config
    element_size = torch.empty((), dtype=mc.dtype).element_size()
    return 2 * mc.num_layers * config.cache_config.block_size * mc.num_kv_heads * mc.head_dim * element_size


def kv_cache_budget(config: EngineConfig) -> int:
    if config.cache_config.kv_cache_memory is not None:
        return parse_memory_size(config.cache_config.kv_cache_memory)
    return min(int(psutil.virtual_memory().available * DEFAULT_CPU_KV_FRACTION), DEFAULT_CPU_KV_CAP)


class Worker:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        keep_freed_memory()
        if config.num_cpu_threads:
            torch.set_num_threads(config.num_cpu_threads)
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_kv_blocks(self) -> int:
        budget = kv_cache_budget(self.config)
        num_blocks = budget // kv_cache_bytes_per_block(self.config)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory ({budget} bytes) is too small for one KV block "
                             f"({kv_cache_bytes_per_block(self.config)} bytes)")
        return num_blocks

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        block_size = self.config.cache_config.block_size
        max_len = self.config.model_config.max_model_len
        logger.info("KV cache: %d blocks of %d tokens (%d tokens); max concurrency at %d tokens per request: "
                    "%.2fx", num_blocks, block_size, num_blocks * block_size, max_len,
                    num_blocks * block_size / max_len)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.model_runner.execute_model(scheduler_output)
