"""The adapter slots of one linear layer (vLLM's ...LinearWithLoRA layers), of the LM head (LogitsProcessorWithLoRA)
and of the token embedding (VocabParallelEmbeddingWithLoRA): preallocated A and B tensors for ``max_loras`` adapters of
up to ``max_lora_rank``, so that activating an adapter is a copy into a slot.

Tensor parallel, as the base layer splits: a column-parallel layer (qkv, gate_up) holds each slice's full A and
this rank's rows of B (its output shard, cut as its weight_loader cuts the weight); a row-parallel layer (o_proj,
down_proj) holds this rank's columns of A (its input shard) and the full B, and its partial x·A·B joins the base
output before the layer's one all-reduce, which sums both.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

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

        self.row_parallel = isinstance(layer, RowParallelLinear)
        self.tp_rank = layer.tp_rank
        if self.row_parallel:
            self.create_lora_weights(layer.input_size_per_partition, [(0, layer.output_size, 0)], max_loras,
                                     max_lora_rank, punica, dtype)
        else:
            self.create_lora_weights(layer.input_size, layer.output_shards(), max_loras, max_lora_rank, punica, dtype)

    def create_lora_weights(self, in_features: int, shards: list[tuple[int, int, int]], max_loras: int,
                            max_lora_rank: int, punica: PunicaWrapper, dtype: torch.dtype) -> None:
        """The slots of a layer of ``in_features`` inputs and output ``shards`` (offset, size, shard rank each)."""
        self.punica = punica
        self.max_lora_rank = max_lora_rank
        self.in_features, self.shards = in_features, shards
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


class LogitsLoRA(LinearLoRA):
    """The LM head's slots (vLLM's LogitsProcessorWithLoRA): x·A·B of the final hidden states added to the logits
    of the whole vocabulary, after the TP gather (on rank 0, which has them) and before any soft cap, as PEFT adds it
    to lm_head's output. Its PunicaWrapper maps each logits row, not each token of the step, to its slot."""

    def __init__(self, hidden_size: int, vocab_size: int, max_loras: int, max_lora_rank: int, punica: PunicaWrapper,
                 dtype: torch.dtype = torch.float32):
        self.row_parallel, self.tp_rank = False, 0
        self.create_lora_weights(hidden_size, [(0, vocab_size, 0)], max_loras, max_lora_rank, punica, dtype)

    def add_to(self, y: torch.Tensor, x: torch.Tensor) -> None:
        """The logits are float32: so is the hidden states' x·A·B."""
        super().add_to(y, x.float())


class EmbeddingLoRA:
    """The token embedding's slots (vLLM's VocabParallelEmbeddingWithLoRA): ``lora_a[slot]`` ``[vocab, max_rank]``,
    PEFT's lora_embedding_A transposed (a token's A is its row: a lookup), ``lora_b[slot]`` ``[max_rank, hidden]``,
    B·scaling transposed, zeros past the adapter's rank; ``holds[slot]``: whether the slot's adapter has this LoRA.
    A token of such an adapter embeds as its base row plus A[token]·B, both times the embedding's ``embed_scale``
    (Gemma's: transformers and vLLM scale the embedding's whole output). Every TP rank holds the whole A and adds
    the whole A[token]·B to the all-reduced rows. The lookup is torch ops, which a CPU graph does not replay: a step
    with such an adapter runs eagerly (PunicaWrapper.needs_eager)."""

    def __init__(self, embedding, max_loras: int, max_lora_rank: int, punica: PunicaWrapper,
                 dtype: torch.dtype = torch.float32):
        self.punica = punica
        self.embed_scale = embedding.embed_scale
        self.lora_a = torch.zeros(max_loras, embedding.num_embeddings, max_lora_rank, dtype=dtype)
        self.lora_b = torch.zeros(max_loras, max_lora_rank, embedding.embedding_dim, dtype=dtype)
        self.holds = torch.zeros(max_loras, dtype=torch.bool)

    def set_slot(self, slot: int, weights: LoRALayerWeights | None) -> None:
        """Copy an adapter's embedding LoRA into ``slot`` (None: the adapter has none)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.holds[slot] = weights is not None
        if weights is not None:
            (a, b), = weights.slices
            self.lora_a[slot, :, :a.shape[0]].copy_(a.T)
            self.lora_b[slot, :b.shape[1]].copy_(b.T)

    def add_to(self, y: torch.Tensor, input_ids: torch.Tensor) -> None:
        """Adds this step's adapters' A[token]·B (times embed_scale) to the embedded rows ``y``, in place."""
        y, input_ids = y.view(-1, y.shape[-1]), input_ids.reshape(-1)
        for slot, rows in self.punica.groups():
            if not self.holds[slot]:
                continue
            ids = input_ids if rows is None else input_ids.index_select(0, rows)
            delta = F.embedding(ids, self.lora_a[slot]).to(y.dtype) @ self.lora_b[slot].to(y.dtype)
            if self.embed_scale != 1.0:
                delta *= torch.tensor(self.embed_scale, dtype=y.dtype)
            if rows is None:
                y += delta
            else:
                y.index_add_(0, rows, delta)
