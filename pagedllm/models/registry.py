"""Map a checkpoint's architecture to the model class that runs it."""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from pagedllm.layers.rope_scaling import check_rope_types
from pagedllm.models.gemma2 import Gemma2ForCausalLM
from pagedllm.models.gemma3 import Gemma3ForCausalLM, Gemma3ForConditionalGeneration
from pagedllm.models.llama import LlamaForCausalLM
from pagedllm.models.mixtral import MixtralForCausalLM
from pagedllm.models.qwen2 import Qwen2ForCausalLM
from pagedllm.models.qwen2_moe import Qwen2MoeForCausalLM
from pagedllm.models.qwen3 import Qwen3ForCausalLM
from pagedllm.models.qwen3_moe import Qwen3MoeForCausalLM

if TYPE_CHECKING:  # the engine process gets a plain copy (config.HFConfigValues), not this class
    from transformers import PretrainedConfig

_MODELS: dict[str, type[nn.Module]] = {
    "Gemma2ForCausalLM": Gemma2ForCausalLM,
    "Gemma3ForCausalLM": Gemma3ForCausalLM,
    "Gemma3ForConditionalGeneration": Gemma3ForConditionalGeneration,  # its language model (models/hf_config.py)
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    # Checkpoints with q/k/v and gate/up fused, which the fused layers' loaders cut per shard (layers/linear.py).
    "Phi3ForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
}
# GGUF configs carry no ``architectures``, only ``model_type``.
_MODEL_TYPES = {
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def get_model_architecture(config: PretrainedConfig) -> type[nn.Module]:
    """Return the model class for ``config``; raise if it is not supported."""
    architectures = list(getattr(config, "architectures", None) or [])
    if config.model_type in _MODEL_TYPES:
        architectures.append(_MODEL_TYPES[config.model_type])
    for arch in architectures:
        if arch in _MODELS:
            return _MODELS[arch]
    raise ValueError(
        f"Unsupported model (architectures={architectures}, model_type={config.model_type!r}); "
        f"supported: {sorted(_MODELS)}"
    )


# The MLP activations the layers compute: the dense gated MLP's (layers/activation.py), the experts' (silu only).
DENSE_ACTIVATIONS = ("gelu_pytorch_tanh", "silu")
_EXPERT_MODELS = (MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM)
# The kinds of layer the attention computes (config.layer_sliding_window): windowed, or over the whole history.
LAYER_TYPES = ("full_attention", "sliding_attention")


def check_model_config(config: PretrainedConfig) -> None:
    """A ValueError naming the config's field for what its model class does not compute, before any process starts
    or weight is read: the architecture, the rope type, the MLP's activation, Gemma's bidirectional attention
    (an embedding model's, which would silently run causal), a kind of layer other than LAYER_TYPES (which ran as
    full attention, or failed in the engine process), a negative sliding window, key/value heads that do not divide
    the query heads and more experts a token than there are (these failed in the engine process)."""
    model_class = get_model_architecture(config)
    check_rope_types(config)
    field = "hidden_activation" if getattr(config, "hidden_activation", None) is not None else "hidden_act"
    activation = getattr(config, field, None) or "silu"
    supported = ("silu",) if issubclass(model_class, _EXPERT_MODELS) else DENSE_ACTIVATIONS
    if activation not in supported:
        raise ValueError(f"{field}: {activation!r} is not supported for {model_class.__name__}; supported: "
                         f"{', '.join(supported)}")
    if getattr(config, "use_bidirectional_attention", False):
        raise ValueError("use_bidirectional_attention: bidirectional attention (an embedding model's) is not "
                         "supported; the models here attend causally")
    unsupported = sorted(set(getattr(config, "layer_types", None) or ()) - set(LAYER_TYPES))
    if unsupported:
        raise ValueError(f"layer_types: {', '.join(map(repr, unsupported))} is not supported; supported: "
                         f"{', '.join(LAYER_TYPES)}")
    window = getattr(config, "sliding_window", None)
    if window is not None and window < 0:
        raise ValueError(f"sliding_window: {window} is not supported; a window is a number of tokens (0 or null: "
                         f"none)")
    heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
    if kv_heads is not None and (kv_heads < 1 or heads % kv_heads):
        raise ValueError(f"num_key_value_heads: {kv_heads} is not supported with {heads} attention heads; each "
                         f"key/value head serves a whole group of query heads, so it must divide {heads}")
    num_experts = getattr(config, "num_experts", None) if issubclass(model_class, _EXPERT_MODELS) else None
    if num_experts and not 1 <= config.num_experts_per_tok <= num_experts:
        raise ValueError(f"num_experts_per_tok: {config.num_experts_per_tok} is not supported with {num_experts} "
                         f"experts; it must be between 1 and {num_experts}")
