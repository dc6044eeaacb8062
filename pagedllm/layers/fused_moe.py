"""FusedMoE: a mixture-of-experts feed-forward layer whose experts are stacked into two tensors, as vLLM's FusedMoE.

Every expert is a SiLU-gated MLP. ``w13_weight`` is ``[experts, 2 * intermediate, hidden]`` (each expert's gate rows,
then its up rows) and ``w2_weight`` ``[experts, hidden, intermediate]``. A step's tokens are routed (softmax over the
router's logits, top-k, optionally renormalised, as transformers computes it), then grouped by expert with one sort,
so each active expert runs one GEMM over all its tokens and nothing loops over tokens in Python.

A step of up to NATIVE_MAX_TOKENS float32 tokens on a rank holding every expert takes all of it in one native call
(native/fused_moe.c, the same routing and order of sums), which a CPU graph can replay, since it decides the routing
as it runs; larger steps run the torch code below, whose per-expert GEMMs suit many tokens an expert.

Parallelism, as vLLM's: with tensor parallelism every rank holds every expert's slice of the intermediate
dimension; with expert parallelism (``enable_expert_parallel``) each rank holds whole experts, a contiguous share of
them. Either way a rank's output is a partial sum of the layer's, and one all-reduce over the TP group completes it.
"""
from __future__ import annotations

import re
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm.distributed.communication_op import tensor_model_parallel_all_reduce
from pagedllm.distributed.parallel_state import ParallelRank
from pagedllm.layers.linear import divide
from pagedllm.native.fused import fused_moe

NATIVE_MAX_TOKENS = 128  # the most tokens a CPU graph's step takes (worker/cpu_graphs.py's MAX_GRAPH_TOKENS)
_EXPERT_WEIGHT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")


def expert_weight_target(name: str, expert_weight_names: tuple[str, str, str]) -> Optional[tuple[str, int, str]]:
    """For a checkpoint tensor of one expert (``...experts.<id>.<proj>.weight``, where ``expert_weight_names`` are
    the checkpoint's names for the gate, down and up projections): the fused parameter it loads into, the expert's
    id and its shard (``w1`` gate, ``w2`` down, ``w3`` up); None for any other tensor."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None or match.group(3) not in expert_weight_names:
        return None
    shard = ("w1", "w2", "w3")[expert_weight_names.index(match.group(3))]
    return f"{match.group(1)}.{'w2' if shard == 'w2' else 'w13'}_weight", int(match.group(2)), shard


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights (float32): softmax over the experts in float32, the
    largest ``top_k``, divided by their sum when ``renormalize``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """``[T, hidden]`` -> ``[T, hidden]``: the weighted sum of each token's experts among those held here
    (``w13``/``w2`` hold experts ``first_expert`` onwards; a token's other experts contribute nothing here).

    The token-expert pairs are sorted by expert (one stable sort), so each held expert with tokens runs one GEMM
    pair over a contiguous block of rows; the weighted rows are summed back into their tokens with one index_add."""
    num_tokens, top_k = topk_ids.shape
    local_ids = topk_ids.flatten() - first_expert
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids.clamp(-1, w13.shape[0]) + 1, minlength=w13.shape[0] + 2).tolist()
    token_of = order // top_k
    out = torch.zeros_like(x)
    start = counts[0]  # pairs whose expert sits before this rank's
    for expert, count in enumerate(counts[1:-1]):
        if count:
            pairs = slice(start, start + count)
            gate_up = x[token_of[pairs]] @ w13[expert].t()
            gate, up = gate_up.chunk(2, dim=-1)
            rows = (F.silu(gate) * up) @ w2[expert].t()
            rows *= topk_weights.flatten()[order[pairs]].unsqueeze(-1).to(rows.dtype)
            out.index_add_(0, token_of[pairs], rows)
            start += count
    return out


class FusedMoE(nn.Module):
    """The experts of one layer (router weights live with the caller, as in vLLM). forward takes the hidden
    states and the router's logits."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 rank: ParallelRank = ParallelRank(), reduce_results: bool = True, prefix: str = ""):
        """``reduce_results``: False leaves the output this rank's partial sum (the caller adds to it and
        all-reduces once)."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.reduce_results = reduce_results
        self.tp_size = rank.tp_size
        if rank.expert_parallel:
            self.num_local_experts = divide(num_experts, rank.tp_size)
            self.first_expert = rank.tp_rank * self.num_local_experts
            self.intermediate_size_per_partition, self.intermediate_start = intermediate_size, 0
        else:
            self.num_local_experts, self.first_expert = num_experts, 0
            self.intermediate_size_per_partition = divide(intermediate_size, rank.tp_size)
            self.intermediate_start = rank.tp_rank * self.intermediate_size_per_partition
        local, inter = self.num_local_experts, self.intermediate_size_per_partition
        self.w13_weight = nn.Parameter(torch.empty(local, 2 * inter, hidden_size), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(local, hidden_size, inter), requires_grad=False)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int, shard_id: str) -> None:
        """One expert's projection (``w1`` gate, ``w3`` up: ``[intermediate, hidden]``; ``w2`` down:
        ``[hidden, intermediate]``) into this rank's slice; an expert held by another rank is skipped."""
        local = expert_id - self.first_expert
        if not 0 <= local < self.num_local_experts:
            return
        inter, start = self.intermediate_size_per_partition, self.intermediate_start
        if shard_id == "w2":
            target, source = param.data[local], loaded_weight.narrow(1, start, inter)
        else:
            target = param.data[local].narrow(0, 0 if shard_id == "w1" else inter, inter)
            source = loaded_weight.narrow(0, start, inter)
        if target.shape != source.shape:
            raise ValueError(f"expert {expert_id} {shard_id}: checkpoint shape {tuple(loaded_weight.shape)} does "
                             f"not fit {tuple(target.shape)} (this rank's slice)")
        target.copy_(source)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if hidden_states.shape[0] <= NATIVE_MAX_TOKENS and self.num_local_experts == self.num_experts \
                and self.tp_size == 1:
            out = fused_moe(hidden_states, router_logits, self.w13_weight, self.w2_weight, self.top_k,
                            self.renormalize)
            if out is not None:
                return out
        topk_weights, topk_ids = select_experts(router_logits, self.top_k, self.renormalize)
        out = fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights, topk_ids,
                            self.first_expert)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts}/{self.num_experts} (from {self.first_expert}), top_k={self.top_k}, "
                f"intermediate={self.intermediate_size_per_partition}, renormalize={self.renormalize}")
