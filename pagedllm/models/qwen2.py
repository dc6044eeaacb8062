"""Qwen2: the Llama architecture with a bias on q/k/v (none on o_proj)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.models.llama import LlamaForCausalLM

if TYPE_CHECKING:  # the engine process gets a plain copy (config.HFConfigValues), not this class
    from transformers import PretrainedConfig


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return True, False
