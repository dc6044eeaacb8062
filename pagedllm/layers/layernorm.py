"""RMSNorm, optionally fused with the residual add that precedes it."""

import torch
from torch import nn

from pagedllm.native import fused


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, normalized in float32 like the HF reference."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.variance_epsilon = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without ``residual`` return norm(x); with it return (norm(x + residual), x + residual)."""
        native = fused.add_rms_norm(x, residual, self.weight, self.variance_epsilon)
        if native is not None:
            return native
        if residual is not None:
            x = x + residual
            residual = x
        orig_dtype = x.dtype
        x32 = x.to(torch.float32)
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
        out = self.weight * x32.to(orig_dtype)
        return out if residual is None else (out, residual)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.variance_epsilon}"


class HeadRMSNorm(RMSNorm):
    """RMSNorm of each attention head on its own (Qwen3's q_norm and k_norm: a weight of ``head_size``), in place
    on the heads of a row, so the QKV projection's output is normalised where it lies, before the rotary
    embedding."""

    def forward_heads_(self, x: torch.Tensor, num_heads: int) -> None:
        """Normalise the first ``num_heads`` heads of each row of ``x`` ([T, >= num_heads * head_size], rows may
        be strided) in place."""
        head_size = self.weight.shape[0]
        if fused.head_rms_norm_(x, num_heads, head_size, self.weight, self.variance_epsilon):
            return
        heads = x[:, :num_heads * head_size].view(x.shape[0], num_heads, head_size)
        heads.copy_(super().forward(heads))
