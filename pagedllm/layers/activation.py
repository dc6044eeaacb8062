"""Gated activation for the fused gate_up projection."""

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.native import fused


class SiluAndMul(nn.Module):
    """``silu(x[..., :d]) * x[..., d:]`` where the input is ``[gate | up]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = fused.silu_and_mul(x)
        if native is not None:
            return native
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


class GeluAndMul(nn.Module):
    """``gelu(x[..., :d], approximate="tanh") * x[..., d:]`` (GeGLU: Gemma's gelu_pytorch_tanh) where the input is
    ``[gate | up]``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        native = fused.gelu_tanh_and_mul(x)
        if native is not None:
            return native
        gate, up = x.chunk(2, dim=-1)
        return F.gelu(gate, approximate="tanh") * up
