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


# Where a Gemma 3 multimodal checkpoint keeps its language model (the hub's layout, and the one transformers 4.52-4.5x
# saved), and the prefixes of what only images use.
_LANGUAGE_MODEL_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                            ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _language_model_name(name: str) -> str | None:
    """A multimodal checkpoint tensor's name in Gemma3ForCausalLM, or None for the vision tower's and projector's."""
    if name.startswith(_VISION_PREFIXES):
        return None
    for prefix, replacement in _LANGUAGE_MODEL_PREFIXES:
        if name.startswith(prefix):
            return replacement + name.removeprefix(prefix)
    return name


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The language model of a Gemma 3 multimodal checkpoint (the 4B and larger models), text in and text out: its
    config is the checkpoint's text config (models/hf_config.py), its weights the language model's, the vision
    tower and projector left unread. Prompts are token ids or text; there is no image input."""

    def load_weights(self, weights):
        renamed = ((_language_model_name(name), tensor) for name, tensor in weights)
        return super().load_weights((name, tensor) for name, tensor in renamed if name is not None)
