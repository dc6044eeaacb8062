"""The platform an engine runs on, from its ``device`` (vLLM's --device): platforms/interface.py says what a platform
answers."""
from __future__ import annotations

from pagedllm.config import DEVICES
from pagedllm.platforms.cpu import CpuPlatform
from pagedllm.platforms.cuda import CudaPlatform
from pagedllm.platforms.interface import Platform


def resolve_platform(device: str = "auto") -> Platform:
    """The platform of ``device``: auto is CUDA where torch sees a GPU, else the CPU. A ValueError naming what is
    wrong where ``device`` is not one of DEVICES or not here, before anything loads or starts."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {', '.join(DEVICES)}; got {device!r}")
    if device == "cuda" and not CudaPlatform.is_available():
        import torch
        build = "a CPU build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise ValueError(f"device='cuda', but torch sees no CUDA GPU (torch {torch.__version__}, {build}); use "
                         "device='cpu' or 'auto'")
    if device == "cuda" or device == "auto" and CudaPlatform.is_available():
        return CudaPlatform()
    return CpuPlatform()


__all__ = ["CpuPlatform", "CudaPlatform", "Platform", "resolve_platform"]
