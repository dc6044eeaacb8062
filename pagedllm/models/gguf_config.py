"""What transformers' GGUF config reading leaves out, from the file's own metadata.

The attention window: transformers drops ``{arch}.attention.sliding_window`` for phi3 (llama.cpp writes Phi-3-mini-4k's
2047), which the layers then attend within, as from the HF config.

The experts: transformers maps a GGUF's ``expert_count`` and ``expert_used_count`` for qwen2moe / qwen3moe but not the experts'
sizes, and reads a Mixtral file (GGUF architecture ``llama`` with experts) as a dense LlamaConfig. llama.cpp
renormalises a token's top-k expert weights for Mixtral and Qwen3-MoE and not for Qwen2-MoE (its per-architecture
default, unless the file says ``expert_weights_norm``).
"""
from __future__ import annotations

from transformers import MixtralConfig, PretrainedConfig

from pagedllm.models.gguf_loader import read_gguf_header


def complete_gguf_config(config: PretrainedConfig, path: str) -> PretrainedConfig:
    """``config`` (transformers' reading of the GGUF file at ``path``) completed with its window and experts."""
    metadata, _ = read_gguf_header(path)
    arch = metadata["general.architecture"]
    window = metadata.get(f"{arch}.attention.sliding_window")
    if window is not None and getattr(config, "sliding_window", None) is None:
        config.sliding_window = int(window)
    return _with_experts(config, metadata, arch)


def _with_experts(config: PretrainedConfig, metadata: dict, arch: str) -> PretrainedConfig:
    num_experts = int(metadata.get(f"{arch}.expert_count", 0))
    if not num_experts:
        return config
    used = int(metadata[f"{arch}.expert_used_count"])
    if arch == "llama":
        values = {k: v for k, v in config.to_dict().items() if k not in ("model_type", "architectures")}
        return MixtralConfig(**values, num_local_experts=num_experts, num_experts_per_tok=used,
                             architectures=["MixtralForCausalLM"])
    config.num_experts, config.num_experts_per_tok = num_experts, used
    config.moe_intermediate_size = int(metadata[f"{arch}.expert_feed_forward_length"])
    shared = int(metadata.get(f"{arch}.expert_shared_feed_forward_length", 0))
    if shared:
        config.shared_expert_intermediate_size = shared
    config.norm_topk_prob = bool(metadata.get(f"{arch}.expert_weights_norm", arch == "qwen3moe"))
    return config
