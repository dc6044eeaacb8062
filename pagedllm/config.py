"""Engine configuration, validated where it is built so a bad value fails with its name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from pagedllm.core.sched.request_queue import SchedulingPolicy


@dataclass
class SchedulerConfig:
    max_model_len: int = 2048
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    # Caps one request's share of a step's budget so a long prompt cannot starve decodes (0: no cap).
    long_prefill_token_threshold: int = 0
    policy: SchedulingPolicy = SchedulingPolicy.FCFS

    def __post_init__(self) -> None:
        self.policy = SchedulingPolicy(self.policy)
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be non-negative, "
                             f"got {self.long_prefill_token_threshold}")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                             f"max_model_len ({self.max_model_len}) when chunked prefill is disabled")


@dataclass
class CacheConfig:
    block_size: int = 16
    enable_prefix_caching: bool = True
    # Bytes for the KV cache (int or "2GiB"-style string); None picks a default from available memory.
    kv_cache_memory: Optional[int | str] = None
    # Set once the KV cache is sized (or directly, in tests without a model).
    num_blocks: Optional[int] = None

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {self.block_size}")
