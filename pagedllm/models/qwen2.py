"""Qwen2: the Llama architecture with a bias on q/k/v (none on o_proj)."""

from transformers import PretrainedConfig

from pagedllm.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        return True, False
