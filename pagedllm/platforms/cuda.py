"""The CUDA platform: an NVIDIA GPU through a CUDA build of torch, Triton attention kernels, NCCL between ranks.

Nothing here runs a native C kernel or touches the CPU's memory settings; the modules that hold those are not
imported on this path. The KV cache takes what ``gpu_memory_utilization`` of the GPU leaves after the weights and the
peak of a profiling forward, as vLLM sizes it (profile_memory, kv_cache_memory_from_profile).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from pagedllm.platforms.interface import KernelChoice, Platform

logger = logging.getLogger(__name__)


class CudaPlatform(Platform):
    device_type = "cuda"
    dist_backend = "nccl"
    attention_backends = ("TRITON_ATTN",)

    @classmethod
    def is_available(cls) -> bool:
        return torch.cuda.is_available()

    def default_dtype(self) -> torch.dtype:
        """bfloat16 on GPUs that compute it (Ampere and later), else float16."""
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16

    def supported_dtypes(self) -> list[torch.dtype]:
        """The default, float16 and float32, as vLLM's CUDA platform."""
        return list(dict.fromkeys((self.default_dtype(), torch.float16, torch.float32)))

    def choose_kernels(self, dtype: torch.dtype, attention_backend: str) -> KernelChoice:
        """torch's GEMMs and element-wise ops in the model's dtype, the Triton attention kernels."""
        return KernelChoice(dtype, attention_backend=attention_backend, device=self.device_type)


@dataclass(frozen=True)
class MemoryProfile:
    """The GPU's memory as a profiling forward left it, in bytes.

    ``weights``: what torch's allocator held before the forward (the model). ``peak_activations``: how far the
    allocator's peak rose above that during the forward (activations, attention and sampler workspaces at the
    largest step the scheduler may send). ``non_torch``: memory in use that the allocator does not account for (the
    CUDA context, cuBLAS and NCCL workspaces), read as the device's used memory minus the allocator's reservation."""

    total: int
    weights: int
    peak_activations: int
    non_torch: int


def kv_cache_memory_from_profile(profile: MemoryProfile, gpu_memory_utilization: float) -> int:
    """Bytes the KV cache may take: the engine's share of the GPU (``gpu_memory_utilization`` of its memory) less
    what the model needs besides the cache. A ValueError naming the knobs when nothing is left."""
    budget = int(profile.total * gpu_memory_utilization)
    needed = profile.weights + profile.peak_activations + profile.non_torch
    if budget <= needed:
        raise ValueError(
            f"No GPU memory left for the KV cache: gpu_memory_utilization={gpu_memory_utilization} of "
            f"{_gib(profile.total)} is {_gib(budget)}, and the model takes {_gib(needed)} (weights "
            f"{_gib(profile.weights)}, peak activations {_gib(profile.peak_activations)}, outside torch "
            f"{_gib(profile.non_torch)}); raise gpu_memory_utilization, or lower max_num_batched_tokens / "
            "max_num_seqs (the activations' peak)")
    return budget - needed


def profile_memory(forward: Callable[[], None]) -> MemoryProfile:
    """Runs ``forward`` (a step at the scheduler's largest size) on the current GPU and measures what it and the
    loaded model take (MemoryProfile says what each figure is)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    weights = torch.cuda.memory_allocated()
    forward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    free, total = torch.cuda.mem_get_info()
    non_torch = max(0, total - free - torch.cuda.memory_reserved())
    profile = MemoryProfile(total, weights, peak - weights, non_torch)
    logger.info("GPU memory: %s total; weights %s, peak activations %s, outside torch %s", _gib(profile.total),
                _gib(profile.weights), _gib(profile.peak_activations), _gib(profile.non_torch))
    return profile


def _gib(nbytes: int) -> str:
    return f"{nbytes / (1 << 30):.2f} GiB"
