from pagedllm.layers.attention.backend import AttentionBackend, AttentionImpl, KVCache
from pagedllm.layers.attention.kv_cache import allocate_kv_caches
from pagedllm.layers.attention.layer import Attention
from pagedllm.layers.attention.metadata import AttentionMetadata
from pagedllm.layers.attention.selector import get_attn_backend, use_attention_backend

__all__ = [
    "Attention",
    "AttentionBackend",
    "AttentionImpl",
    "AttentionMetadata",
    "KVCache",
    "allocate_kv_caches",
    "get_attn_backend",
    "use_attention_backend",
]
