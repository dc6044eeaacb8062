"""Mixtral: the Llama architecture with a sparse mixture of experts in each layer (``block_sparse_moe``): the router
picks num_experts_per_tok of num_local_experts SiLU-gated experts (w1 gate, w3 up, w2 down) per token and their
weights are renormalised to sum to one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from pagedllm.distributed.parallel_state import ParallelRank
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.moe import SparseMoeBlock, experts_run_natively

if TYPE_CHECKING:  # the engine process gets a plain copy (config.HFConfigValues), not this class
    from transformers import PretrainedConfig


class MixtralForCausalLM(LlamaForCausalLM):
    mlp_name = "block_sparse_moe"
    supports_cpu_graphs = property(experts_run_natively)
    expert_weight_names = ("w1", "w2", "w3")

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int, rank: ParallelRank,
                 quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        return SparseMoeBlock(config, config.num_local_experts, config.intermediate_size, True, rank, quant_config,
                              prefix)

    @staticmethod
    def dense_mlp(config: PretrainedConfig, layer_index: int) -> bool:
        return False  # every layer's is experts
