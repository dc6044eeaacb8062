"""Qwen3-MoE: Qwen3 (per-head q/k RMS norms) with sparse layers of routed experts and no shared expert
(models/moe.py); layers in mlp_only_layers, or off the decoder_sparse_step, stay dense."""

from __future__ import annotations

from pagedllm.models.moe import experts_run_natively, qwen_moe_dense_mlp, qwen_moe_mlp
from pagedllm.models.qwen3 import Qwen3ForCausalLM


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    supports_cpu_graphs = property(experts_run_natively)
    expert_weight_names = ("gate_proj", "down_proj", "up_proj")
    make_mlp = staticmethod(qwen_moe_mlp)
    dense_mlp = staticmethod(qwen_moe_dense_mlp)
