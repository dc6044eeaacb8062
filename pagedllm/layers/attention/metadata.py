"""Per-step description of the flattened batch that attention layers read."""

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


@dataclass
class AttentionMetadata:
    """What every attention layer needs to write and read the paged KV cache.

    Request ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``;
    these are its newest tokens, so its context after this step is
    ``seq_lens[i]`` tokens stored in order in blocks ``block_table[i]``.
    """

    num_actual_tokens: int
    # [T] int64: cache slot (block_id * block_size + offset) for each token's K/V.
    slot_mapping: torch.Tensor
    # [B+1] cumulative query lengths.
    query_start_loc: torch.Tensor
    # [B] context length of each request after this step (int32 from the model runner).
    seq_lens: torch.Tensor
    # [B, max_blocks_per_req] int32 block ids; entries past a request's blocks are ignored.
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int
    # Set where the model runner splits the batch itself (a verify step of speculative decoding; a step of prompt
    # chunks, its decode rows first): the first ``num_decodes`` requests are one-row decodes, rows 0 ..
    # num_decodes - 1, for the decode kernel; every later request's query rows are one chunk for the native prefill
    # kernel (in a verify step one-row queries too), described by these [B - num_decodes] int32 tensors, which the
    # kernel reads when it runs, so a CPU graph (worker/cpu_graphs.py) replays over new query lengths; the same
    # computation eagerly. None: the backend sorts the rows into decode rows and chunks itself.
    chunk_query_start: Optional[torch.Tensor] = None
    chunk_query_len: Optional[torch.Tensor] = None
    num_decodes: int = 0
    # A hybrid model's (core/kv_cache_groups.py): each KV cache group's metadata, its own slot_mapping and
    # block_table, the rest as here (this is the first group's); an Attention layer reads its group's. None: every
    # layer reads through these.
    group_metadata: Optional[list["AttentionMetadata"]] = None
    # Scratch for a backend to keep what it derives from the fields above
    # (gather indices, masks) once per step and reuse in every layer.
    # Builders leave it empty.
    backend_cache: dict[Any, Any] = field(default_factory=dict, repr=False, compare=False)

    def with_groups(self, tables: list[tuple[torch.Tensor, torch.Tensor]]) -> "AttentionMetadata":
        """Sets group_metadata from each KV cache group's (slot_mapping, block_table), the first group's being this
        metadata's own (one group: nothing to set); returns self."""
        if len(tables) > 1:
            self.group_metadata = [self] + [dataclasses.replace(self, slot_mapping=slots, block_table=table,
                                                                backend_cache={}) for slots, table in tables[1:]]
        return self
