"""Engine configuration, validated where it is built so a bad value fails with its name."""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional


from pagedllm.core.sched.request_queue import SchedulingPolicy


def head_dim(hf_config) -> int:
    """Per-head size: explicit in newer configs, else hidden_size split evenly over the attention heads."""
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


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


_MEMORY_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2,
                 "mib": 1 << 20, "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4,
                 "tib": 1 << 40}


def parse_memory_size(value: int | str) -> int:
    """Bytes from an int or a string such as "2GiB", "512MiB", "1.5GB"."""
    if isinstance(value, int):
        size = value
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not match or match.group(2).lower() not in _MEMORY_UNITS:
            raise ValueError(f"kv_cache_memory must be a byte count or a size like '2GiB', got {value!r}")
        size = int(float(match.group(1)) * _MEMORY_UNITS[match.group(2).lower()])
    if size <= 0:
        raise ValueError(f"kv_cache_memory must be positive, got {value!r}")
    return size


@dataclass
class ModelConfig:
    """The model: where it lives, its HF config, its dtype (also its KV cache's; the activations' dtype is the
    engine's platforms/cpu.KernelChoice), and the context length we serve."""

    model: str
    path: str
    hf_config: object
    dtype: object  # torch.dtype
    max_model_len: int
    seed: int = 0
    # Weight quantization ("gguf_int4": GGUF Q4_0/Q4_1 weights kept 4-bit); None computes with dense weights.
    quantization: Optional[str] = None
    # Run every step eagerly: no CPU graphs for decode steps (worker/cpu_graphs.py), as vLLM's flag turns off
    # CUDA graphs.
    enforce_eager: bool = False

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        return head_dim(self.hf_config)

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    # torch threads of the worker; None keeps torch's default (one per core).
    num_cpu_threads: Optional[int] = None
