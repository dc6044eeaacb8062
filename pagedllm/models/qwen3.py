"""Qwen3: the Llama architecture with each query and key head RMS-normalised (q_norm, k_norm over the head size)
before the rotary embedding, and one ``attention_bias`` flag for q/k/v and o_proj (none in the released models)."""

from __future__ import annotations

from pagedllm.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
