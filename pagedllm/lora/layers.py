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


class LinearLoRA:
    def __init__(self, layer, max_loras: int, max_lora_rank: int, punica: PunicaWrapper,
                 dtype: torch.dtype = torch.float32):
        from pagedllm.layers.linear import RowParallelLinear

        self.punica = punica
        self.row_parallel = isinstance(layer, RowParallelLinear)
        self.tp_rank = layer.tp_rank
        if self.row_parallel:
            self.in_features = layer.input_size_per_partition
            self.shards = [(0, layer.output_size, 0)]
        else:
            self.in_features = layer.input_size
            self.shards = layer.output_shards()
        self.output_slices = [(offset, size) for offset, size, _ in self.shards]
        self.lora_a = [torch.zeros(max_loras, max_lora_rank, self.in_features, dtype=dtype) for _ in self.shards]
        self.lora_b = [torch.zeros(max_loras, size, max_lora_rank, dtype=dtype) for _, size, _ in self.shards]
        self.ranks = [[0] * len(self.shards) for _ in range(max_loras)]

    def set_slot(self, slot: int, weights: LoRALayerWeights | None) -> None:
        """Copy an adapter's weights for this layer into ``slot`` (None: the adapter leaves the layer alone)."""
        for i, (_, size, shard_rank) in enumerate(self.shards):
            pair = weights.slices[i] if weights is not None else None
            if pair is None:
                self.ranks[slot][i] = 0
                continue
            a, b = pair
            if self.row_parallel:
                a = a.narrow(1, self.tp_rank * self.in_features, self.in_features)
            else:
                b = b.narrow(0, shard_rank * size, size)
            r = a.shape[0]
            self.lora_a[i][slot, :r].copy_(a)
            self.lora_b[i][slot, :, :r].copy_(b)
            self.ranks[slot][i] = r

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """Adds this step's adapters' x·A·B to the layer's output ``y`` (its rows of each slot), in place."""
        self.punica.add_lora(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), self.lora_a, self.lora_b,
                             self.output_slices, self.ranks)
