"""The sparse mixture-of-experts block of Mixtral and the Qwen MoE models, in their checkpoints' module tree:
``gate`` (the router, one logit per expert), ``experts`` (layers/fused_moe.FusedMoE) and, in Qwen2-MoE, a dense
``shared_expert`` every token takes, scaled by ``sigmoid(shared_expert_gate(x))``.

A step's forward through the block is native calls only where the experts' native path applies (float32 experts:
fused_moe.c; GGUF experts kept packed: moe_quant.c; each routing and running the experts in one call, the shared
expert's gate added by another), so decode steps of such a model replay CPU graphs (``supports_cpu_graphs``, a
property of the model classes: experts_run_natively).

The router stays unquantized and whole on every rank (its logits pick the experts, so every rank must pick alike).
The shared expert's output is a partial sum under tensor parallelism like the experts', so the block all-reduces
once for both.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm import native
from pagedllm.distributed.communication_op import tensor_model_parallel_all_reduce
from pagedllm.distributed.parallel_state import ParallelRank
from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.linear import ReplicatedLinear
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.llama import LlamaMLP
from pagedllm.native.fused import add_sigmoid_gated_

if TYPE_CHECKING:  # the engine process gets a plain copy (config.HFConfigValues), not this class
    from transformers import PretrainedConfig


class SparseMoeBlock(nn.Module):
    def __init__(self, config: PretrainedConfig, num_experts: int, intermediate_size: int, renormalize: bool,
                 rank: ParallelRank, quant_config: QuantizationConfig | None, prefix: str,
                 shared_expert_intermediate_size: int = 0):
        """``renormalize``: a token's top-k expert weights are divided by their sum (Mixtral; Qwen's
        norm_topk_prob). ``shared_expert_intermediate_size``: 0 for no shared expert."""
        super().__init__()
        if config.hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {config.hidden_act!r} is not supported, only 'silu'")
        self.tp_size = rank.tp_size
        self.gate = ReplicatedLinear(config.hidden_size, num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(num_experts, config.num_experts_per_tok, config.hidden_size, intermediate_size,
                                renormalize, rank, reduce_results=False, quant_config=quant_config,
                                prefix=f"{prefix}.experts")
        self.shared_expert = self.shared_expert_gate = None
        if shared_expert_intermediate_size:
            self.shared_expert = LlamaMLP(config.hidden_size, shared_expert_intermediate_size, config.hidden_act,
                                          False, rank.tp_size, rank.tp_rank, quant_config, f"{prefix}.shared_expert",
                                          reduce_results=False)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False,
                                                       prefix=f"{prefix}.shared_expert_gate")

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        out = self.experts(hidden_states, self.gate(hidden_states))
        if self.shared_expert is not None:
            shared, gate = self.shared_expert(hidden_states), self.shared_expert_gate(hidden_states)
            if not add_sigmoid_gated_(out, gate, shared):
                out += torch.sigmoid(gate) * shared
        if self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


def experts_run_natively(model: nn.Module) -> bool:
    """Whether ``model``'s MoE blocks run a decode step in native calls only (FusedMoE.runs_natively: every expert
    on one rank, float32 or packed, and the native kernels built), so its decode steps can replay CPU graphs."""
    return native.fused_ops() is not None and all(m.runs_natively for m in model.modules() if isinstance(m, FusedMoE))


def is_sparse_layer(config: PretrainedConfig, layer_index: int) -> bool:
    """Whether a Qwen MoE layer has experts (transformers' rule: not in mlp_only_layers, and every
    decoder_sparse_step-th layer)."""
    return (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
            and config.num_experts > 0 and (layer_index + 1) % getattr(config, "decoder_sparse_step", 1) == 0)


def qwen_moe_dense_mlp(config: PretrainedConfig, layer_index: int) -> bool:
    """Whether a Qwen MoE layer's feed-forward block is qwen_moe_mlp's dense MLP."""
    return not is_sparse_layer(config, layer_index)


def qwen_moe_mlp(config: PretrainedConfig, layer_index: int, rank: ParallelRank,
                 quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
    """A Qwen2-MoE / Qwen3-MoE layer's feed-forward block: the sparse block, or a dense MLP of intermediate_size."""
    if not is_sparse_layer(config, layer_index):
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act, False, rank.tp_size,
                        rank.tp_rank, quant_config, prefix)
    return SparseMoeBlock(config, config.num_experts, config.moe_intermediate_size, bool(config.norm_topk_prob),
                          rank, quant_config, prefix, getattr(config, "shared_expert_intermediate_size", 0) or 0)
