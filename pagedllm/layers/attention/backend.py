"""The interface an attention backend (CPU today, CUDA later) implements."""

from abc import ABC, abstractmethod

import torch

from pagedllm.kv_cache_dtype import unit_kv_scales
from pagedllm.layers.attention.metadata import AttentionMetadata

KVCache = tuple[torch.Tensor, torch.Tensor]


class AttentionImpl(ABC):
    """Computes attention for one layer over the paged KV cache."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        """``sliding_window``: the query at position p attends only to the keys at positions > p - sliding_window
        (transformers' sliding_window_overlay, vLLM's per-layer sliding_window); None attends to all before it.
        ``logits_soft_cap`` (vLLM's name; Gemma 2's attn_logit_softcapping): the scaled scores become
        cap * tanh(score / cap) before the softmax; None (or 0) leaves them as they are."""
        if num_heads % num_kv_heads != 0:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.group = num_heads // num_kv_heads  # query heads per KV head
        self.sliding_window = sliding_window
        self.logits_soft_cap = logits_soft_cap or None
        # An fp8 cache's scales, float32 [2, num_kv_heads]: the rows k_scale and v_scale (vLLM's _k_scale and
        # _v_scale), one a KV head, all equal for per-tensor ones: it holds KV head h's k / k_scale[h] and
        # v / v_scale[h]. A checkpoint's, set by Attention.set_kv_cache_scales after loading; 1 without them, and for
        # every other cache (kv_cache_dtype.is_fp8).
        self.kv_scales = unit_kv_scales(num_kv_heads)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Write this step's K/V into ``kv_cache`` at ``slot_mapping``, then attend.

        ``query`` is ``[T, num_heads, head_size]``, ``key``/``value`` are
        ``[T, num_kv_heads, head_size]``; returns ``[T, num_heads, head_size]``.
        """


class AttentionBackend(ABC):
    """A family of attention kernels plus the KV-cache layout they expect."""

    @staticmethod
    @abstractmethod
    def get_name() -> str: ...

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        """Shape of ONE of a layer's (key_cache, value_cache) tensors. Every backend so far keeps this layout: a
        token's heads are one contiguous row, a block's tokens consecutive rows, so ``view(-1, heads, size)``
        indexes the cache by slot."""
        return (num_blocks, block_size, num_kv_heads, head_size)
