"""FusedMoE: a mixture-of-experts feed-forward layer whose experts are stacked into two tensors, as vLLM's FusedMoE.

Every expert is a SiLU-gated MLP. ``w13_weight`` is ``[experts, 2 * intermediate, hidden]`` (each expert's gate rows,
then its up rows) and ``w2_weight`` ``[experts, hidden, intermediate]``. A step's tokens are routed (softmax over the
router's logits, top-k, optionally renormalised, as transformers computes it), then grouped by expert with one sort,
so each active expert runs one GEMM over all its tokens and nothing loops over tokens in Python.

A step of up to NATIVE_MAX_TOKENS float32 tokens on a rank holding every expert takes all of it in one native call
(native/fused_moe.c, the same routing and order of sums), which a CPU graph can replay, since it decides the routing
as it runs; larger steps run the torch code below, whose per-expert GEMMs suit many tokens an expert. A bfloat16
model's experts in bf16 panels take native/moe_bf16.c at every step (UnquantizedFusedMoEMethod).

The layer's ``quant_method`` (vLLM's structure) holds the experts' weights and runs them: UnquantizedFusedMoEMethod
the stacks above; a quantization config may give another (layers/quantization/gguf_moe.py keeps a GGUF file's packed
experts in gemm.c's quantized panels, run by native/moe_quant.c or through routed_experts), with the same routing
and order of sums.

Parallelism, as vLLM's: with tensor parallelism every rank holds every expert's slice of the intermediate
dimension; with expert parallelism (``enable_expert_parallel``) each rank holds whole experts, a contiguous share of
them. Either way a rank's output is a partial sum of the layer's, and one all-reduce over the TP group completes it.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn

from pagedllm import native
from pagedllm.distributed.communication_op import tensor_model_parallel_all_reduce
from pagedllm.distributed.parallel_state import ParallelRank
from pagedllm.layers.gemm_layout import WeightLayout, as_bf16_panels, bf16_panel_pairs
from pagedllm.layers.linear import divide
from pagedllm.layers.quantization.base import QuantizationConfig
from pagedllm.native.fused import fused_moe
from pagedllm.native.gemms import moe_bf16

NATIVE_MAX_TOKENS = 128  # float32 experts: fused_moe.c up to decode-sized steps, torch's GEMMs beyond
# An expert's tensor: its weight, or (a GGUF expert kept packed) its codes and per-block scales and zeros.
_EXPERT_WEIGHT = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.(weight|qweight|scales|zeros)$")


def expert_weight_target(name: str, expert_weight_names: tuple[str, str, str]) -> Optional[tuple[str, int, str]]:
    """For a checkpoint tensor of one expert (``...experts.<id>.<proj>.<part>``, where ``expert_weight_names`` are
    the checkpoint's names for the gate, down and up projections): the fused parameter it loads into
    (``w13_<part>`` or ``w2_<part>``), the expert's id and its shard (``w1`` gate, ``w2`` down, ``w3`` up); None for
    any other tensor."""
    match = _EXPERT_WEIGHT.match(name)
    if match is None or match.group(3) not in expert_weight_names:
        return None
    shard = ("w1", "w2", "w3")[expert_weight_names.index(match.group(3))]
    return f"{match.group(1)}.{expert_param_name(shard, match.group(4))}", int(match.group(2)), shard


def expert_param_name(shard: str, part: str = "weight") -> str:
    """The FusedMoE parameter a shard's ``part`` loads into: ``w13_<part>`` for the gate (``w1``) and up (``w3``),
    ``w2_<part>`` for the down (``w2``)."""
    return f"{'w2' if shard == 'w2' else 'w13'}_{part}"


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's ``top_k`` experts and their weights (float32): softmax over the experts in float32, the
    largest ``top_k``, divided by their sum when ``renormalize``."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, ids


def routed_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, num_local_experts: int,
                   expert_mlp: Callable[[int, torch.Tensor], torch.Tensor], first_expert: int = 0) -> torch.Tensor:
    """``[T, hidden]`` -> ``[T, hidden]``: the weighted sum of each token's experts among those held here (experts
    ``first_expert`` onwards, ``expert_mlp(local index, rows)`` each; a token's other experts contribute nothing
    here).

    The token-expert pairs are sorted by expert (one stable sort), so each held expert with tokens runs once over a
    contiguous block of rows; the weighted rows are summed back into their tokens with one index_add."""
    num_tokens, top_k = topk_ids.shape
    local_ids = topk_ids.flatten() - first_expert
    order = torch.argsort(local_ids, stable=True)
    counts = torch.bincount(local_ids.clamp(-1, num_local_experts) + 1, minlength=num_local_experts + 2).tolist()
    token_of = order // top_k
    out = torch.zeros_like(x)
    start = counts[0]  # pairs whose expert sits before this rank's
    for expert, count in enumerate(counts[1:-1]):
        if count:
            pairs = slice(start, start + count)
            rows = expert_mlp(expert, x[token_of[pairs]])
            rows *= topk_weights.flatten()[order[pairs]].unsqueeze(-1).to(rows.dtype)
            out.index_add_(0, token_of[pairs], rows)
            start += count
    return out


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, first_expert: int = 0) -> torch.Tensor:
    """routed_experts over stacked weights (``w13``/``w2`` hold experts ``first_expert`` onwards): one GEMM pair
    per held expert with tokens."""

    def expert_mlp(expert: int, rows: torch.Tensor) -> torch.Tensor:
        gate, up = (rows @ w13[expert].t()).chunk(2, dim=-1)
        return (F.silu(gate) * up) @ w2[expert].t()

    return routed_experts(x, topk_weights, topk_ids, w13.shape[0], expert_mlp, first_expert)


def _stacked_panels(stack: torch.Tensor, layout: WeightLayout, gated: bool = False) -> torch.Tensor:
    """``[experts, N, K]`` float32 -> ``[experts, ...]`` each expert's pack_bf16_panels, written one expert at a time
    into the layout's memory (no packed copy of the stack on the way)."""
    first = bf16_panel_pairs(stack[0], gated)
    panels = layout.zeros((stack.shape[0], *first.shape), torch.int32)
    panels[0].copy_(first)
    for expert in range(1, stack.shape[0]):
        panels[expert].copy_(bf16_panel_pairs(stack[expert], gated))
    return as_bf16_panels(panels)


class UnquantizedFusedMoEMethod:
    """The experts as two stacked tensors in the model's dtype (``w13_weight``, ``w2_weight``, see the module's
    docstring), filled by FusedMoE.weight_loader.

    A bfloat16 model laid out in bf16 panels (WeightLayout.bf16_panels) keeps the experts held here (all of them,
    or a tensor-parallel rank's slice of each, or an expert-parallel rank's share) in gemm_bf16's panels instead,
    as its dense layers: each expert's ``[gate | up]`` gated for the fused activation, its down plain; the float32
    stacks are dropped (half the memory), and every step is one moe_bf16 call (native/moe_bf16.c, the same routing
    and order of sums, the products those of the dense bf16 layers)."""

    def __init__(self):
        self.w13_panels: torch.Tensor | None = None  # [experts, ...] gated bf16 panels, under bf16 panels
        self.w2_panels: torch.Tensor | None = None

    def create_weights(self, layer: "FusedMoE") -> None:
        local, inter, hidden = layer.num_local_experts, layer.intermediate_size_per_partition, layer.hidden_size
        layer.w13_weight = nn.Parameter(torch.empty(local, 2 * inter, hidden), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(local, hidden, inter), requires_grad=False)
        for param in (layer.w13_weight, layer.w2_weight):
            param.weight_loader = layer.weight_loader

    def process_weights_after_loading(self, layer: "FusedMoE", layout: WeightLayout | None = None) -> None:
        """Under bf16 panels (where the native layer builds), the stacks become the experts' panels; otherwise they
        serve both paths as they are."""
        if (layout is None or not layout.bf16_panels or layer.w13_weight.dtype != torch.float32
                or native.moe_bf16() is None):
            return
        self.w13_panels = _stacked_panels(layer.w13_weight, layout, gated=True)
        del layer.w13_weight  # before the down's panels: one float32 stack less at the peak
        self.w2_panels = _stacked_panels(layer.w2_weight, layout)
        del layer.w2_weight

    def runs_natively(self, layer: "FusedMoE") -> bool:
        """Whether every step of up to NATIVE_MAX_TOKENS tokens takes a native kernel (bf16 panels; or float32
        experts, every one on this rank), so a CPU graph can replay it."""
        return self.w13_panels is not None or (layer.w13_weight.dtype == torch.float32 and layer.tp_size == 1
                                               and layer.num_local_experts == layer.num_experts)

    def apply(self, layer: "FusedMoE", hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        if self.w13_panels is not None:  # float32 activations, as under every bf16-panel layer
            return moe_bf16(native.moe_bf16(), hidden_states.contiguous(), router_logits.float().contiguous(),
                            self.w13_panels, self.w2_panels, layer.intermediate_size_per_partition, layer.top_k,
                            layer.renormalize, layer.first_expert)
        if hidden_states.shape[0] <= NATIVE_MAX_TOKENS and self.runs_natively(layer):
            out = fused_moe(hidden_states, router_logits, layer.w13_weight, layer.w2_weight, layer.top_k,
                            layer.renormalize)
            if out is not None:
                return out
        topk_weights, topk_ids = select_experts(router_logits, layer.top_k, layer.renormalize)
        return fused_experts(hidden_states, layer.w13_weight, layer.w2_weight, topk_weights, topk_ids,
                             layer.first_expert)


class FusedMoE(nn.Module):
    """The experts of one layer (router weights live with the caller, as in vLLM). forward takes the hidden
    states and the router's logits."""

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, renormalize: bool,
                 rank: ParallelRank = ParallelRank(), reduce_results: bool = True,
                 quant_config: QuantizationConfig | None = None, prefix: str = ""):
        """``reduce_results``: False leaves the output this rank's partial sum (the caller adds to it and
        all-reduces once). ``quant_config`` may give the experts a quantized method (by ``prefix``, the experts'
        checkpoint name, e.g. ``model.layers.0.mlp.experts``)."""
        super().__init__()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.reduce_results = hidden_size, reduce_results
        self.tp_size = rank.tp_size
        self.params_dtype = torch.get_default_dtype()
        if rank.expert_parallel:
            self.num_local_experts = divide(num_experts, rank.tp_size)
            self.first_expert = rank.tp_rank * self.num_local_experts
            self.intermediate_size_per_partition, self.intermediate_start = intermediate_size, 0
        else:
            self.num_local_experts, self.first_expert = num_experts, 0
            self.intermediate_size_per_partition = divide(intermediate_size, rank.tp_size)
            self.intermediate_start = rank.tp_rank * self.intermediate_size_per_partition
        method = quant_config.get_quant_method(self, prefix) if quant_config else None
        self.quant_method = method or UnquantizedFusedMoEMethod()
        self.quant_method.create_weights(self)

    def local_expert(self, expert_id: int) -> int | None:
        """The index among this rank's experts of expert ``expert_id``; None where another rank holds it."""
        local = expert_id - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def rank_slice(self, loaded: torch.Tensor, shard_id: str, per_input: int = 1) -> torch.Tensor:
        """This rank's part of one expert's projection, or of a tensor with one column per ``per_input`` of its
        inputs (a GGUF part's per-block scales): the gate's and up's rows (``w1``, ``w3``), the down's columns
        (``w2``) of this rank's slice of the intermediate dimension."""
        inter, start = self.intermediate_size_per_partition, self.intermediate_start
        if shard_id == "w2":
            return loaded.narrow(1, start // per_input, inter // per_input)
        return loaded.narrow(0, start, inter)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, expert_id: int, shard_id: str) -> None:
        """One expert's projection (``w1`` gate, ``w3`` up: ``[intermediate, hidden]``; ``w2`` down:
        ``[hidden, intermediate]``) into this rank's slice; an expert held by another rank is skipped."""
        local = self.local_expert(expert_id)
        if local is None:
            return
        inter = self.intermediate_size_per_partition
        source = self.rank_slice(loaded_weight, shard_id)
        target = param.data[local] if shard_id == "w2" else \
            param.data[local].narrow(0, 0 if shard_id == "w1" else inter, inter)
        if target.shape != source.shape:
            raise ValueError(f"expert {expert_id} {shard_id}: checkpoint shape {tuple(loaded_weight.shape)} does "
                             f"not fit {tuple(target.shape)} (this rank's slice)")
        target.copy_(source)

    @property
    def runs_natively(self) -> bool:
        """Whether a decode step's pass is one native call (which a CPU graph can replay)."""
        return self.quant_method.runs_natively(self)

    def forward(self, hidden_states: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        out = self.quant_method.apply(self, hidden_states, router_logits)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_local_experts}/{self.num_experts} (from {self.first_expert}), top_k={self.top_k}, "
                f"intermediate={self.intermediate_size_per_partition}, renormalize={self.renormalize}")
