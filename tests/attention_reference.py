"""The oracle of the attention kernels' tests (native and Triton): plain float32 attention over one request's
contiguous keys and values."""
import torch


def reference_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                        sliding_window: int | None = None, logits_soft_cap: float | None = None) -> torch.Tensor:
    """query ``[Lq, H, D]``, the last Lq of the ``[Lk, KVH, D]`` positions of keys and values: each row attends to
    the keys up to its own position, with a sliding window only to those after its position - sliding_window; with a
    soft cap the scaled scores are cap * tanh(score / cap), as transformers' Gemma 2 has them. No keys at all:
    zeros."""
    query = query.float()
    if keys.shape[0] == 0:
        return torch.zeros_like(query)
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.float().repeat_interleave(group, dim=1), values.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", query, keys) * scale
    if logits_soft_cap is not None:
        scores = torch.tanh(scores / logits_soft_cap) * logits_soft_cap
    num_queries, num_keys = query.shape[0], keys.shape[0]
    key_positions = torch.arange(num_keys)[None, :]
    query_positions = torch.arange(num_keys - num_queries, num_keys)[:, None]
    visible = key_positions <= query_positions
    if sliding_window is not None:
        visible &= key_positions > query_positions - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values)
