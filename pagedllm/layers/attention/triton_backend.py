"""Paged attention in Triton (TRITON_ATTN): the CUDA platform's backend, and on the CPU the same kernels under
Triton's interpreter (TRITON_INTERPRET=1), which is how they are tested without a GPU.

Each layer writes the step's keys and values into its cache by slot (reshape_and_cache), then attends in one
launch: a step of decode rows only (every request one new token) takes the split-K decode kernel, which reads each
KV block once per query-head group; any other step (prefill chunks, decode rows among them, a speculative verify
step) takes the varlen prefill kernel, each chunk attending to its cached context and causally within itself. Both
read every request's history in place through its block table. The cache holds the model's dtype (kv_cache_dtype
"auto"): the kernels widen it to float32 as they load, so queries may be float32 over a bf16 cache (the CPU's bf16
panels) or in the cache's own dtype (a GPU's).
"""

import torch

from pagedllm.layers.attention.backend import AttentionBackend, AttentionImpl, KVCache
from pagedllm.layers.attention.metadata import AttentionMetadata
from pagedllm.layers.attention.triton_ops import (paged_decode_attention, paged_prefill_attention,
                                                  reshape_and_cache)


class TritonAttentionImpl(AttentionImpl):
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        reshape_and_cache(key, value, key_cache, value_cache, attn_metadata.slot_mapping)
        out = torch.empty_like(query)
        if attn_metadata.max_query_len == 1:
            paged_decode_attention(query, key_cache, value_cache, attn_metadata.block_table, attn_metadata.seq_lens,
                                   out, self.scale, sliding_window=self.sliding_window,
                                   logits_soft_cap=self.logits_soft_cap)
        else:
            paged_prefill_attention(query, key_cache, value_cache, attn_metadata.block_table,
                                    attn_metadata.query_start_loc, attn_metadata.seq_lens, out, self.scale,
                                    attn_metadata.max_query_len, sliding_window=self.sliding_window,
                                    logits_soft_cap=self.logits_soft_cap)
        return out


class TritonAttentionBackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TRITON_ATTN"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TritonAttentionImpl
