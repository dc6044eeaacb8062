"""The attention module models use; the math lives in the selected backend."""

import torch
from torch import nn

from pagedllm.layers.attention.backend import KVCache
from pagedllm.layers.attention.metadata import AttentionMetadata
from pagedllm.layers.attention.selector import get_attn_backend


class Attention(nn.Module):
    """Paged attention over flattened ``[T, heads * head_size]`` projections, by the backend the loader chose
    (selector.use_attention_backend); with ``sliding_window`` (vLLM's
    per-layer sliding window) a query attends only to the last ``sliding_window`` positions up to its own; with
    ``logits_soft_cap`` its scores are soft-capped (AttentionImpl says how)."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 sliding_window: int | None = None,
                 logits_soft_cap: float | None = None):
        super().__init__()
        self.num_heads = num_heads
        self.head_size = head_size
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap
        self.kv_cache_group = 0  # whose metadata it reads (core/kv_cache_groups.py; the model runner sets it)
        self.backend = get_attn_backend()
        self.impl = self.backend.get_impl_cls()(num_heads, head_size, scale, self.num_kv_heads,
                                                sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)

    def set_kv_cache_scales(self, k_scale: float | torch.Tensor, v_scale: float | torch.Tensor) -> None:
        """This layer's fp8 KV cache scales from the checkpoint (vLLM's k_scale and v_scale, positive: a float per
        tensor, or float32 ``[num_kv_heads]``, one for each of this layer's KV heads, as a kv_cache_scheme of strategy
        "attn_head" has them): KV head h's keys are cached as k / k_scale[h] and read back times k_scale[h], its
        values so by v_scale[h]. They are constants of the layer, held in one tensor that lives as long as it, so the
        kernel arguments a CPU graph records (the tensor's address) stay valid."""
        self.impl.kv_scales = torch.stack([torch.as_tensor(scale, dtype=torch.float32).expand(self.num_kv_heads)
                                           for scale in (k_scale, v_scale)])

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = query.shape[0]
        if attn_metadata.group_metadata is not None:
            attn_metadata = attn_metadata.group_metadata[self.kv_cache_group]
        out = self.impl.forward(
            query.view(num_tokens, self.num_heads, self.head_size),
            key.view(num_tokens, self.num_kv_heads, self.head_size),
            value.view(num_tokens, self.num_kv_heads, self.head_size),
            kv_cache,
            attn_metadata,
        )
        return out.view(num_tokens, self.num_heads * self.head_size)

    def extra_repr(self) -> str:
        return (
            f"num_heads={self.num_heads}, head_size={self.head_size}, "
            f"num_kv_heads={self.num_kv_heads}, sliding_window={self.sliding_window}, "
            f"logits_soft_cap={self.logits_soft_cap}, "
            f"backend={self.backend.get_name()}"
        )
