"""The adapter slots of one linear layer (vLLM's ...LinearWithLoRA layers): preallocated A and B tensors for
``max_loras`` adapters of up to ``max_lora_rank``, so that activating an adapter is a copy into a slot.

Tensor parallel, as the base layer splits: a column-parallel layer (qkv, gate_up) holds each slice's full A and
this rank's rows of B (its output shard, cut as its weight_loader cuts the weight); a row-parallel layer (o_proj,
down_proj) holds this rank's columns of A (its input shard) and the full B, and its partial x·A·B joins the base
output before the layer's one all-reduce, which sums both.
"""
from __future__ import annotations

import torch

from pagedllm.lora.lora_model import LoRALayerWeights
from pagedllm.lora.punica import PunicaWrapper
from pagedllm.native.lora_ops import lanes, lora_add


class LinearLoRA:
    """``lora_a_t[slot]``: ``[in, lanes]``, each slice's A transposed side by side (slice i in lanes
    ``i x max_rank ..``), zeros past the last; ``lora_b[slot]``: ``[max_rank, out]``, slice i's B transposed in its
    own output columns. So one shrink serves every slice and B holds no zero blocks; a slice the adapter leaves
    alone, and the rank padding past an adapter's rank, are zeros and add exactly nothing. ``holds[slot]``: whether
    the slot's adapter has weights for this layer at all. lora.c reads all of it, and each token's slot, when it
    runs, so a CPU graph replays a LoRA step for any adapters in any slots. The slots are in the model's dtype
    (bf16 for a bf16 model: half the bytes each step reads), the sums in float32."""

    def __init__(self, layer, max_loras: int, max_lora_rank: int, punica: PunicaWrapper,
                 dtype: torch.dtype = torch.float32):
        from pagedllm.layers.linear import RowParallelLinear

        self.punica = punica
        self.row_parallel = isinstance(layer, RowParallelLinear)
        self.tp_rank = layer.tp_rank
        self.max_lora_rank = max_lora_rank
        if self.row_parallel:
            self.in_features = layer.input_size_per_partition
            self.shards = [(0, layer.output_size, 0)]
        else:
            self.in_features = layer.input_size
            self.shards = layer.output_shards()
        offsets = [offset for offset, _, _ in self.shards]
        out_features = sum(size for _, size, _ in self.shards)
        self.lora_a_t = torch.zeros(max_loras, self.in_features, lanes(len(self.shards) * max_lora_rank),
                                    dtype=dtype)
        self.lora_b = torch.zeros(max_loras, max_lora_rank, out_features, dtype=dtype)
        self.slice_offsets = torch.tensor([*offsets, out_features], dtype=torch.int64)
        self.holds = torch.zeros(max_loras, dtype=torch.uint8)

    def set_slot(self, slot: int, weights: LoRALayerWeights | None) -> None:
        """Copy an adapter's weights for this layer into ``slot`` (None: the adapter leaves the layer alone)."""
        self.lora_a_t[slot].zero_()
        self.lora_b[slot].zero_()
        self.holds[slot] = weights is not None and any(pair is not None for pair in weights.slices)
        if not self.holds[slot]:
            return
        for i, ((offset, size, shard_rank), pair) in enumerate(zip(self.shards, weights.slices)):
            if pair is None:
                continue
            a, b = pair
            if self.row_parallel:
                a = a.narrow(1, self.tp_rank * self.in_features, self.in_features)
            else:
                b = b.narrow(0, shard_rank * size, size)
            r, first = a.shape[0], i * self.max_lora_rank
            self.lora_a_t[slot, :, first:first + r].copy_(a.T)
            self.lora_b[slot, :r, offset:offset + size].copy_(b.T)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """Adds this step's adapters' x·A·B to the layer's output ``y`` (its rows of each slot), in place."""
        y, x = y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1])
        if lora_add(y, x, self.punica.token_slots, self.holds, self.lora_a_t, self.lora_b, self.slice_offsets):
            return
        rank = self.max_lora_rank
        for slot, rows in self.punica.groups():
            if not self.holds[slot]:
                continue
            shrunk = (x if rows is None else x.index_select(0, rows)) @ self.lora_a_t[slot].to(x.dtype)
            for i, (offset, size, _) in enumerate(self.shards):
                delta = shrunk[:, i * rank:(i + 1) * rank] @ self.lora_b[slot, :, offset:offset + size].to(x.dtype)
                if rows is None:
                    y[:, offset:offset + size] += delta
                else:
                    y[:, offset:offset + size].index_add_(0, rows, delta)
