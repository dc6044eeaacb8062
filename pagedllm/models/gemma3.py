"""Gemma 3 (text; ``Gemma3ForCausalLM``, model_type ``gemma3_text``): Llama's attention and gated MLP with Gemma's
differences, as transformers has them:
- every RMS norm scales by ``1 + weight`` (its checkpoints store the offset from one): the weights get their one
  added once, after loading, so the norm kernels serve unchanged (the same float32 product where the weights are
  float32, as with float32 activations; a bfloat16 model on torch's path rounds 1 + weight to bf16);
- four norms a layer: the attention's and the MLP's outputs are normed again before they join the residual;
- the embedded tokens are multiplied by sqrt(hidden_size);
- the MLP's gate is GeGLU (gelu_pytorch_tanh), the query and key heads are RMS-normed, the scores are scaled by
  ``query_pre_attn_scalar ** -0.5``;
- local and global layers (``layer_types``): "sliding_attention" layers attend to a window with their own rope
  base (``rope_parameters["sliding_attention"]``), "full_attention" layers to everything with theirs.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.config import head_dim, layer_sliding_window
from pagedllm.distributed.parallel_state import ParallelRank
from pagedllm.layers.layernorm import HeadRMSNorm, RMSNorm
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary import get_rope
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, input_norm

if TYPE_CHECKING:  # the engine process gets a plain copy (config.HFConfigValues), not this class
    from transformers import PretrainedConfig


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, self_attn: LlamaAttention, mlp: LlamaMLP):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            setattr(self, name, RMSNorm(config.hidden_size, eps=config.rms_norm_eps))

    def forward(self, positions, hidden_states, residual, kv_cache, attn_metadata):
        """Returns (normed MLP output, residual); the next layer's input norm adds them."""
        hidden_states, residual = input_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.post_attention_layernorm(self.self_attn(positions, hidden_states, kv_cache,
                                                                     attn_metadata))
        hidden_states, residual = self.pre_feedforward_layernorm(hidden_states, residual)
        return self.post_feedforward_layernorm(self.mlp(hidden_states)), residual


class Gemma3ForCausalLM(LlamaForCausalLM):
    qk_norm = True

    def layer_factory(self, config: PretrainedConfig, rank: ParallelRank,
                      quant_config: QuantizationConfig | None) -> Callable[[int, str], nn.Module]:
        rotary = {kind: get_rope(head_dim(config), config, kind) for kind in sorted(set(config.layer_types))}
        bias = getattr(config, "attention_bias", False)

        def make_layer(layer_index: int, prefix: str) -> nn.Module:
            attention = LlamaAttention(config, bias, bias, rank.tp_size, rank.tp_rank,
                                       rotary[config.layer_types[layer_index]], quant_config, f"{prefix}.self_attn",
                                       qk_norm=True, sliding_window=layer_sliding_window(config, layer_index),
                                       scale=config.query_pre_attn_scalar ** -0.5)
            mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_activation, False,
                           rank.tp_size, rank.tp_rank, quant_config, f"{prefix}.mlp")
            return Gemma3DecoderLayer(config, attention, mlp)

        return make_layer

    @staticmethod
    def embed_scale(config: PretrainedConfig) -> float:
        return config.hidden_size ** 0.5

    def process_weights_after_loading(self, layout=None) -> None:
        """Gemma's norms scale by 1 + weight: the one is added here, once, to every norm's weight."""
        with torch.no_grad():
            for module in self.model.modules():
                if isinstance(module, (RMSNorm, HeadRMSNorm)):
                    module.weight += 1.0
        super().process_weights_after_loading(layout)
