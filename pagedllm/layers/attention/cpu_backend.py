"""Paged attention on CPU with torch's scaled_dot_product_attention.

Per step (once, shared by all layers) the batch is split into:
  * decode rows (one new token): batched into one SDPA call over their
    histories, gathered from the cache and padded to the longest one;
  * prefill chunks (several new tokens): one SDPA call each, causal inside the
    chunk and seeing the request's cached earlier tokens.
Only slots below a request's ``seq_len`` are ever read, so never-written
cache memory (even NaN garbage) cannot leak into the result.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedllm.layers.attention.backend import AttentionBackend, AttentionImpl, KVCache
from pagedllm.layers.attention.metadata import AttentionMetadata


@dataclass
class _PrefillChunk:
    start: int
    end: int
    # Cache slots of the request's whole context, or None when the chunk is
    # the whole context (attend to this step's K/V directly, plain causal).
    slots: torch.Tensor | None
    mask: torch.Tensor | None  # [q_len, seq_len] bool, True = may attend


@dataclass
class _SDPAPlan:
    block_size: int
    decode_rows: torch.Tensor | None  # [Bd] query rows of the decode requests
    decode_slots: torch.Tensor | None  # [Bd * S] cache slots, padded positions point at position 0
    decode_seq_len: int  # S, longest decode context
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, S] bool, None if all contexts are S long
    prefills: list[_PrefillChunk]


def _slots(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each token position, given the request's block ids."""
    return block_ids.long().gather(-1, positions // block_size) * block_size + positions % block_size


def _build_plan(md: AttentionMetadata, block_size: int) -> _SDPAPlan:
    qsl = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    decode_reqs, prefills = [], []
    for i, seq_len in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 1:
            decode_reqs.append(i)
        elif q_len > 1 and seq_len == q_len:
            prefills.append(_PrefillChunk(start, end, None, None))
        elif q_len > 1:
            positions = torch.arange(seq_len)
            # Query row r sits at position seq_len - q_len + r and sees keys up to it.
            mask = positions[None, :] <= torch.arange(seq_len - q_len, seq_len)[:, None]
            prefills.append(_PrefillChunk(start, end, _slots(md.block_table[i], positions, block_size), mask))

    decode_rows = decode_slots = decode_mask = None
    decode_seq_len = 0
    if decode_reqs:
        idx = torch.tensor(decode_reqs)
        lens = md.seq_lens[idx].long()
        decode_seq_len = int(lens.max())
        positions = torch.arange(decode_seq_len).expand(len(decode_reqs), -1)
        valid = positions < lens[:, None]
        # Padding reads the request's own first token (real data), then is masked out.
        positions = torch.where(valid, positions, 0)
        decode_slots = _slots(md.block_table[idx], positions, block_size).reshape(-1)
        decode_rows = md.query_start_loc[idx].long()
        if not bool(valid.all()):
            decode_mask = valid[:, None, None, :]
    return _SDPAPlan(block_size, decode_rows, decode_slots, decode_seq_len, decode_mask, prefills)


class TorchSDPABackendImpl(AttentionImpl):
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        block_size = key_cache.shape[1]
        plan = attn_metadata.backend_cache.get("torch_sdpa")
        if plan is None or plan.block_size != block_size:
            plan = attn_metadata.backend_cache["torch_sdpa"] = _build_plan(attn_metadata, block_size)

        key_flat = key_cache.view(-1, self.num_kv_heads, self.head_size)
        value_flat = value_cache.view(-1, self.num_kv_heads, self.head_size)
        slot_mapping = attn_metadata.slot_mapping.long()
        key_flat.index_copy_(0, slot_mapping, key)
        value_flat.index_copy_(0, slot_mapping, value)

        output = torch.empty_like(query)
        if plan.decode_rows is not None:
            self._decode(query, key_flat, value_flat, plan, output)
        for chunk in plan.prefills:
            self._prefill(query, key, value, key_flat, value_flat, chunk, output)
        return output

    def _decode(self, query, key_flat, value_flat, plan: _SDPAPlan, output) -> None:
        num_reqs = plan.decode_rows.shape[0]
        group = self.num_heads // self.num_kv_heads
        # Fold each KV head's query group into the "query length" axis: one
        # SDPA call, no K/V repetition for grouped-query attention.
        q = query.index_select(0, plan.decode_rows).view(num_reqs, self.num_kv_heads, group, self.head_size)
        shape = (num_reqs, plan.decode_seq_len, self.num_kv_heads, self.head_size)
        k = key_flat.index_select(0, plan.decode_slots).view(shape).transpose(1, 2)
        v = value_flat.index_select(0, plan.decode_slots).view(shape).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=plan.decode_mask, scale=self.scale)
        output.index_copy_(0, plan.decode_rows, out.reshape(num_reqs, self.num_heads, self.head_size))

    def _prefill(self, query, key, value, key_flat, value_flat, chunk: _PrefillChunk, output) -> None:
        q = query[chunk.start : chunk.end].transpose(0, 1)
        if chunk.slots is None:
            k = key[chunk.start : chunk.end].transpose(0, 1)
            v = value[chunk.start : chunk.end].transpose(0, 1)
        else:
            k = key_flat.index_select(0, chunk.slots).transpose(0, 1)
            v = value_flat.index_select(0, chunk.slots).transpose(0, 1)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=chunk.mask,
            is_causal=chunk.mask is None,
            scale=self.scale,
            enable_gqa=self.num_heads != self.num_kv_heads,
        )
        output[chunk.start : chunk.end] = out.transpose(0, 1)


class TorchSDPABackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchSDPABackendImpl

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (num_blocks, block_size, num_kv_heads, head_size)
