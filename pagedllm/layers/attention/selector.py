"""Choose the attention backend for a device."""

import torch

from pagedllm.layers.attention.backend import AttentionBackend
from pagedllm.layers.attention.cpu_backend import TorchSDPABackend


def get_attn_backend(device: torch.device | str = "cpu") -> type[AttentionBackend]:
    if torch.device(device).type == "cpu":
        return TorchSDPABackend
    raise NotImplementedError(f"No attention backend for device {device!r} yet")
