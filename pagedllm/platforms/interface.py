"""What the engine asks of the hardware it runs on: one interface, a class per platform (vLLM's
``vllm/platforms``). The CPU (platforms/cpu.py) and CUDA (platforms/cuda.py) answer the same questions: is it here,
which dtype ``auto`` means, which attention backends it offers, which kernels a model runs and which
torch.distributed backend joins its ranks. Code that differs by platform asks this, so
that nothing CPU-specific runs on a GPU and nothing CUDA-specific is imported on a CPU."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class KernelChoice:
    """The kernels one engine runs: decided once per engine where its model runs (Platform.choose_kernels), before
    the model loads, and handed to the loader, so that two engines in one process never share the decision.

    ``dtype`` is the model's, which is also its KV cache's. ``bf16_panels``: a bfloat16 model runs its dense
    GEMMs against bf16 weight panels (native/gemm_bf16.c) with float32 activations, so that the float32 kernels
    around the GEMMs (fused ops, attention, CPU graphs) serve it unchanged; the attention kernels read the bf16
    cache in place, widening as they load. ``fused_silu``: a gated MLP's activation is fused into its gate_up GEMM
    where the layout has a kernel for it (bf16 panels); off for engines serving LoRA adapters, which add to the
    projection before the activation (the gated panels have no plain GEMM). ``attention_backend``: the engine's
    (ModelConfig.attention_backend), which the loader gives the model's Attention layers."""

    dtype: torch.dtype
    bf16_panels: bool = False
    fused_silu: bool = True
    attention_backend: str = "TORCH_SDPA"
    device: str = "cpu"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of activations: float32 under bf16 panels, else the model's."""
        return torch.float32 if self.bf16_panels else self.dtype


class Platform(ABC):
    #: torch's device type, as in ``torch.device(device_type)``.
    device_type: str
    #: The torch.distributed backend that joins this platform's ranks.
    dist_backend: str
    #: The attention backends it runs (AttentionBackend.get_name()), its default first.
    attention_backends: tuple[str, ...]

    @classmethod
    @abstractmethod
    def is_available(cls) -> bool:
        """Whether this process can run on it."""

    @abstractmethod
    def default_dtype(self) -> torch.dtype:
        """What ``dtype="auto"`` means here: the fastest dtype whose results stay close to float32's."""

    def supported_dtypes(self) -> list[torch.dtype]:
        """The dtypes ``dtype="auto"`` keeps a checkpoint's in (vLLM's Platform.supported_dtypes), the default first:
        those computed at full speed here. The default and float32 unless a platform says more: on the CPU float16
        runs torch's own kernels, many times slower than bfloat16's panels, so a float16 checkpoint runs as the
        default."""
        return list(dict.fromkeys((self.default_dtype(), torch.float32)))

    @abstractmethod
    def choose_kernels(self, dtype: torch.dtype, attention_backend: str) -> KernelChoice:
        """The kernels an engine's model of ``dtype`` runs here."""

    def check_attention_backend(self, name: str) -> None:
        """A ValueError naming the choices where ``name`` is not an attention backend of this platform (subclasses
        add what else a backend needs here)."""
        if name not in self.attention_backends:
            raise ValueError(f"attention_backend must be one of {', '.join(self.attention_backends)} on "
                             f"{self.device_type}; got {name!r}")

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"
