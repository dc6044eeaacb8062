"""Worker: one rank's model runner; joins the engine's process groups, sizes and allocates its KV cache from a
memory budget."""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Optional

import psutil
import torch

from pagedllm.config import EngineConfig, parse_memory_size
from pagedllm.core.kv_cache_groups import stage_cache_tensors
from pagedllm.core.kv_cache_manager import max_blocks
from pagedllm.core.sched.output import SchedulerOutput
from pagedllm.distributed.parallel_state import (ParallelRank, get_tp_group, init_distributed_environment,
                                                 initialize_model_parallel)
from pagedllm.kv_cache_dtype import kv_cache_torch_dtype, row_bytes
from pagedllm.layers.attention.kv_cache import kv_heads_per_rank
from pagedllm.platforms import resolve_platform
from pagedllm.platforms.cpu import cores_of_rank, keep_freed_memory, release_freed_memory
from pagedllm.platforms.cuda import kv_cache_memory_from_profile, profile_memory
from pagedllm.platforms.populate import engine_step
from pagedllm.worker.model_runner import ModelRunner
from pagedllm.worker.outputs import ModelRunnerOutput

logger = logging.getLogger(__name__)

# Without an explicit budget, the CPU KV cache takes this share of available RAM, up to the cap.
DEFAULT_CPU_KV_FRACTION = 0.1
DEFAULT_CPU_KV_CAP = 4 << 30


def kv_cache_bytes_per_block(config: EngineConfig, rank: ParallelRank = ParallelRank()) -> int:
    """One block's K and V bytes on ``rank``: its stage's cache tensors (one per layer, or a hybrid model's shared by
    its KV cache groups, core/kv_cache_groups.py), its share of the KV heads; with a draft model, the draft's layers
    too (its cache has the same blocks, so both are sized, held and freed together)."""
    mc = config.model_config
    start, end = config.parallel_config.stage_layers(rank.pp_rank, mc.num_layers)
    cache_dtype = config.cache_config.cache_dtype
    num_tensors = len(set(stage_cache_tensors(config.cache_config.kv_cache_groups, start, end)))
    per_block = _kv_bytes_per_block(mc, num_tensors, kv_heads_per_rank(mc.num_kv_heads, rank.tp_size),
                                    config.cache_config.block_size, cache_dtype)
    draft = config.speculative_config.draft_model_config if config.speculative_config else None
    if draft is not None:
        per_block += _kv_bytes_per_block(draft, draft.num_layers, draft.num_kv_heads, config.cache_config.block_size,
                                         cache_dtype)
    return per_block


def _kv_bytes_per_block(mc, num_layers: int, num_kv_heads: int, block_size: int, cache_dtype: str) -> int:
    head_row = row_bytes(mc.head_dim, kv_cache_torch_dtype(cache_dtype, mc.dtype))
    return 2 * num_layers * block_size * num_kv_heads * head_row


def kv_cache_budget(config: EngineConfig) -> int:
    """Bytes for one rank's KV cache: the kv_cache_memory asked for (per rank, as vLLM's is per GPU), or a share
    of the memory available, split among the ranks that share this machine."""
    if config.cache_config.kv_cache_memory is not None:
        return parse_memory_size(config.cache_config.kv_cache_memory)
    pc = config.parallel_config
    ranks_here = pc.world_size * pc.data_parallel_size
    return min(int(psutil.virtual_memory().available * DEFAULT_CPU_KV_FRACTION), DEFAULT_CPU_KV_CAP) // ranks_here


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: Optional[str] = None) -> None:
        """``distributed_init_method``: where the ranks meet (e.g. tcp://127.0.0.1:PORT); needed for more than
        one rank."""
        self.config = config
        pc = config.parallel_config
        self.rank = ParallelRank.of(rank, pc.tensor_parallel_size, pc.pipeline_parallel_size,
                                    pc.enable_expert_parallel)
        self.distributed_init_method = distributed_init_method
        self.platform = resolve_platform(config.model_config.device)
        if self.platform.device_type == "cpu":
            keep_freed_memory()
            self._bind_threads()
        torch.manual_seed(config.model_config.seed)
        self.model_runner = ModelRunner(config, self.rank)
        self.profiler: Optional[torch.profiler.profile] = None  # while profile() traces

    def _bind_threads(self) -> None:
        """torch threads: num_cpu_threads if given, else one per core of this rank's share; with more than one rank
        on the machine (ranks of this engine, or of its data-parallel siblings), the process keeps to its own
        cores."""
        pc = self.config.parallel_config
        ranks_here = pc.world_size * pc.data_parallel_size
        threads = self.config.num_cpu_threads
        if ranks_here > 1:
            cores = cores_of_rank(pc.data_parallel_rank * pc.world_size + self.rank.rank, ranks_here)
            if cores is not None:
                os.sched_setaffinity(0, cores)
            threads = threads or (len(cores) if cores else 1)
        if threads:
            torch.set_num_threads(threads)

    def init_device(self) -> None:
        """Take this rank's GPU (CUDA) and join the engine's process groups (more than one rank)."""
        pc = self.config.parallel_config
        if self.platform.device_type == "cuda":
            torch.cuda.set_device(self.rank.rank % torch.cuda.device_count())
        if pc.world_size == 1:
            return
        init_distributed_environment(pc.world_size, self.rank.rank, self.distributed_init_method,
                                     pc.torch_distributed_backend)
        initialize_model_parallel(pc.tensor_parallel_size, pc.pipeline_parallel_size)
        assert get_tp_group().world_size == pc.tensor_parallel_size

    def load_model(self) -> None:
        self.model_runner.load_model()

    def determine_num_kv_blocks(self) -> int:
        """Blocks of this rank's KV cache: kv_cache_memory where given; else on the CPU a share of the available
        RAM (kv_cache_budget), on a GPU what gpu_memory_utilization leaves after a profiling forward, which must hold
        at least one max_model_len request (as vLLM checks at start-up)."""
        cache_config = self.config.cache_config
        per_block = kv_cache_bytes_per_block(self.config, self.rank)
        if cache_config.kv_cache_memory is None and self.platform.device_type == "cuda":
            budget = kv_cache_memory_from_profile(profile_memory(self.model_runner.profile_run),
                                                  cache_config.gpu_memory_utilization)
            num_blocks = budget // per_block
            max_len = self.config.model_config.max_model_len
            if num_blocks * cache_config.block_size < max_len and not self.config.model_config.auto_fit_max_model_len:
                raise ValueError(f"The KV cache holds {num_blocks * cache_config.block_size} tokens on this GPU, "
                                 f"fewer than one request of max_model_len ({max_len}); raise "
                                 "gpu_memory_utilization or lower max_model_len")
            return num_blocks
        budget = kv_cache_budget(self.config)
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory ({budget} bytes) is too small for one KV block ({per_block} bytes)")
        return num_blocks

    def update_max_model_len(self, max_model_len: int) -> None:
        """The engine's auto-fitted max_model_len (EngineCore._fit_max_model_len), lower than the one this worker
        started with: its buffers, sized for that, hold it."""
        self.config.model_config.max_model_len = self.config.scheduler_config.max_model_len = max_model_len

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.model_runner.initialize_kv_cache(num_blocks)
        release_freed_memory()  # the last of start-up: what loading the model freed goes back to the OS
        if self.rank.rank != 0:
            return
        cache_config = self.config.cache_config
        block_size = cache_config.block_size
        max_len = self.config.model_config.max_model_len
        windows = cache_config.group_windows
        per_request = max_blocks(windows, block_size, max_len, self.config.max_step_slots)
        logger.info("KV cache: %d blocks of %d tokens in %d group(s) (%d tokens); max concurrency at %d tokens per "
                    "request: %.2fx", num_blocks, block_size, len(windows), num_blocks * block_size // len(windows),
                    max_len, num_blocks / per_request)
        if num_blocks < per_request:
            # vLLM refuses to start here; this engine starts, and refuses (with an error in its output) each request
            # that could need more than the cache holds, so a deliberately small cache still serves short requests.
            logger.warning("The KV cache (%d blocks of %d tokens) is smaller than one request of max_model_len (%d) "
                           "can need (%d blocks): a request that could need more is refused. Raise kv_cache_memory "
                           "or lower max_model_len.", num_blocks, block_size, max_len, per_request)

    def execute_model(self, scheduler_output: SchedulerOutput) -> Optional[ModelRunnerOutput]:
        with engine_step():  # the KV cache's populating waits meanwhile
            return self.model_runner.execute_model(scheduler_output)

    def add_lora(self, lora_request) -> Optional[str]:
        """Loads an adapter ahead of its requests' steps; what went wrong (its files unreadable, gone), else None.
        Returned, not raised: an RPC that raises ends the engine, and this fails one adapter's requests only."""
        try:
            self.model_runner.lora_manager.add(lora_request)
        except Exception as e:
            return f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e)
        return None

    def remove_lora(self, lora_id: int) -> bool:
        return self.model_runner.lora_manager.remove(lora_id)

    def pin_lora(self, lora_id: int) -> Optional[str]:
        """Why the adapter cannot be pinned, else None (returned, as add_lora's errors)."""
        return self.model_runner.lora_manager.pin(lora_id)

    def list_loras(self) -> set[int]:
        return set(self.model_runner.lora_manager.loaded)

    def check_health(self) -> bool:
        return True

    def sleep(self, level: int = 1) -> None:
        """vLLM's sleep at level 1 or 2 on the CPU: the KV cache's memory goes back to the OS, its contents lost; the
        weights, in host memory already (where vLLM's level 1 offloads them), stay. initialize_kv_cache wakes it."""
        self.model_runner.release_kv_cache()
        if self.platform.device_type == "cuda":
            torch.cuda.empty_cache()
        release_freed_memory()

    def profile(self, is_start: bool = True, profile_prefix: Optional[str] = None) -> None:
        """vLLM's: starts this rank's torch profiler (profiler_config), or stops it, which writes its trace to
        torch_profiler_dir, named ``<profile_prefix>_dp<X>_pp<Y>_tp<Z>`` (without a prefix, from dp on)."""
        config = self.config.profiler_config
        if config.profiler is None:
            raise RuntimeError("Profiling is not enabled: give the engine a profiler_config (--profiler-config "
                               '\'{"profiler": "torch", "torch_profiler_dir": "DIR"}\').')
        if not is_start:
            if self.profiler is None:
                logger.warning("Profiler was not started, nothing to stop.")
                return
            profiler, self.profiler = self.profiler, None
            profiler.stop()
            return
        if self.profiler is not None:  # vLLM's ProfilerAlreadyActiveError
            raise RuntimeError("A profiling session is already active. Call stop_profile before starting another "
                               "session.")
        name = f"dp{self.config.parallel_config.data_parallel_rank}_pp{self.rank.pp_rank}_tp{self.rank.tp_rank}"
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.platform.device_type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities, record_shapes=config.torch_profiler_record_shapes,
            profile_memory=config.torch_profiler_with_memory, with_stack=config.torch_profiler_with_stack,
            with_flops=config.torch_profiler_with_flops,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                config.torch_profiler_dir, f"{profile_prefix}_{name}" if profile_prefix else name,
                use_gzip=config.torch_profiler_use_gzip))
        self.profiler.start()

    def apply_model(self, fn: Callable[[torch.nn.Module], Any]) -> Any:
        """vLLM's: ``fn`` called with this rank's model (LLM.apply_model)."""
        return fn(self.model_runner.model)


def start_worker(config: EngineConfig, rank: int = 0, distributed_init_method: Optional[str] = None) -> Worker:
    """A worker ready to run steps, whatever process it lives in: in its process groups, its slice loaded."""
    worker = Worker(config, rank, distributed_init_method)
    worker.init_device()
    worker.load_model()
    return worker
