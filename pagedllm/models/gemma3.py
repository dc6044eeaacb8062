"""Gemma 3 (text; ``Gemma3ForCausalLM``, model_type ``gemma3_text``): Gemma 2 (gemma2.py: (1 + weight) norms, four a
layer, scaled embeddings, GeGLU, query_pre_attn_scalar, soft-capping where the config sets it, local and global
layers) with two differences, as transformers has them:
- the query and key heads are RMS-normed before the rotary embedding;
- each kind of layer has its own rope base: "sliding_attention" layers ``rope_parameters["sliding_attention"]``'s,
  "full_attention" layers theirs.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedllm.config import head_dim
from pagedllm.layers.rotary import RotaryEmbedding, get_rope
from pagedllm.models.gemma2 import Gemma2ForCausalLM

if TYPE_CHECKING:  # the engine process gets a plain copy (config.HFConfigValues), not this class
    from transformers import PretrainedConfig


class Gemma3ForCausalLM(Gemma2ForCausalLM):
    qk_norm = True

    @staticmethod
    def rotary_embeddings(config: PretrainedConfig) -> dict[str, RotaryEmbedding]:
        """Each layer type's rotary embedding, from its own rope parameters."""
        return {kind: get_rope(head_dim(config), config, kind) for kind in sorted(set(config.layer_types))}
