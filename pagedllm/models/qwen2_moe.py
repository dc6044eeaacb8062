"""Qwen2-MoE: Qwen2 (a bias on q/k/v unless ``qkv_bias`` is off) with sparse layers of routed experts plus a shared
expert every token takes, gated by ``sigmoid(shared_expert_gate(x))`` (models/moe.py); layers in mlp_only_layers, or
off the decoder_sparse_step, stay dense."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.models.moe import experts_run_natively, qwen_moe_dense_mlp, qwen_moe_mlp
from pagedllm.models.qwen2 import Qwen2ForCausalLM

if TYPE_CHECKING:  # the engine process gets a plain copy (config.HFConfigValues), not this class
    from transformers import PretrainedConfig


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    supports_cpu_graphs = property(experts_run_natively)
    expert_weight_names = ("gate_proj", "down_proj", "up_proj")
    make_mlp = staticmethod(qwen_moe_mlp)
    dense_mlp = staticmethod(qwen_moe_dense_mlp)

    @staticmethod
    def attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return getattr(config, "qkv_bias", True), False
