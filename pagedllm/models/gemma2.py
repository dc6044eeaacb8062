"""Gemma 2 (``Gemma2ForCausalLM``, model_type ``gemma2``), and what Gemma 3 (gemma3.py) shares with it: Llama's
attention and gated MLP with Gemma's differences, as transformers has them:
- every RMS norm scales by ``1 + weight`` (its checkpoints store the offset from one): the weights get their one
  added once, after loading, so the norm kernels serve unchanged (the same float32 product where the weights are
  float32, as with float32 activations; a bfloat16 model on torch's path rounds 1 + weight to bf16);
- four norms a layer: the attention's and the MLP's outputs are normed again before they join the residual;
- the embedded tokens are multiplied by sqrt(hidden_size);
- the MLP's gate is GeGLU (gelu_pytorch_tanh), the scores are scaled by ``query_pre_attn_scalar ** -0.5``;
- soft-capping (None: none): the attention's scaled scores become cap * tanh(score / cap) before the softmax
  (``attn_logit_softcapping``, every attention path's ``logits_soft_cap``), and so do the final logits
  (``final_logit_softcapping``, in the LogitsProcessor, as vLLM has it);
- local and global layers (``layer_types``; Gemma2Config's default alternates them, local first):
  "sliding_attention" layers attend to a window, "full_attention" layers to everything, all with one rope base.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.config import head_dim, layer_sliding_window
from pagedllm.distributed.parallel_state import ParallelRank
from pagedllm.layers.layernorm import HeadRMSNorm, RMSNorm
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary import RotaryEmbedding, get_rope
from pagedllm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, input_norm

if TYPE_CHECKING:  # the engine process gets a plain copy (config.HFConfigValues), not this class
    from transformers import PretrainedConfig


class Gemma2DecoderLayer(nn.Module):
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


class Gemma2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None,
                 rank: ParallelRank = ParallelRank(), layer_range: tuple[int, int] | None = None):
        super().__init__(config, quant_config, rank, layer_range)
        self.logits_processor = LogitsProcessor(config.vocab_size, soft_cap=config.final_logit_softcapping)

    @staticmethod
    def rotary_embeddings(config: PretrainedConfig) -> dict[str, RotaryEmbedding]:
        """Each layer type's rotary embedding: Gemma 2 has one for all its layers."""
        return dict.fromkeys(config.layer_types, get_rope(head_dim(config), config))

    def layer_factory(self, config: PretrainedConfig, rank: ParallelRank,
                      quant_config: QuantizationConfig | None) -> Callable[[int, str], nn.Module]:
        rotary = self.rotary_embeddings(config)
        bias = getattr(config, "attention_bias", False)

        def make_layer(layer_index: int, prefix: str) -> nn.Module:
            attention = LlamaAttention(config, bias, bias, rank.tp_size, rank.tp_rank,
                                       rotary[config.layer_types[layer_index]], quant_config, f"{prefix}.self_attn",
                                       qk_norm=self.qk_norm, sliding_window=layer_sliding_window(config, layer_index),
                                       scale=config.query_pre_attn_scalar ** -0.5,
                                       logits_soft_cap=config.attn_logit_softcapping)
            mlp = LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_activation, False,
                           rank.tp_size, rank.tp_rank, quant_config, f"{prefix}.mlp")
            return Gemma2DecoderLayer(config, attention, mlp)

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
