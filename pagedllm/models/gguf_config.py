"""What transformers' GGUF config reading leaves out, from the file's own metadata.

The attention window: transformers drops ``{arch}.attention.sliding_window`` for phi3 (llama.cpp writes Phi-3-mini-4k's
2047), which the layers then attend within, as from the HF config.

The head size: transformers drops ``{arch}.attention.key_length`` for qwen3, whose config class then says 128 whatever
the file's q/k/v rows hold; llama.cpp (which writes it wherever the HF config has a head_dim) takes it as the head size.

The experts: transformers maps a GGUF's ``expert_count`` and ``expert_used_count`` for qwen2moe / qwen3moe but not the experts'
sizes, and reads a Mixtral file (GGUF architecture ``llama`` with experts) as a dense LlamaConfig. llama.cpp
renormalises a token's top-k expert weights for Mixtral and Qwen3-MoE and not for Qwen2-MoE (its per-architecture
default, unless the file says ``expert_weights_norm``).

Rope scaling: transformers keeps none of llama.cpp's ``{arch}.rope.scaling.*`` (type linear or yarn, factor,
original context, yarn's betas) nor the ``rope_freqs`` tensor, Llama 3.1's scaling as a divisor per frequency; they
become the config's rope parameters (the divisors as ``freq_factors``, which layers/rope_scaling.py applies as
llama.cpp does). Gemma 3 scales its global layers only (its ``full_attention`` parameters).

Biases: a Llama-architecture file with q/k/v or MLP biases (the converter writes them when the HF model has
them) loads with them; transformers' config says attention_bias and mlp_bias false.

Gemma: transformers keeps its config class's soft caps (Gemma 2's 50 and 30, Gemma 3's none) over the file's
``{arch}.attn_logit_softcapping`` and ``final_logit_softcapping``, and the file has no query_pre_attn_scalar:
llama.cpp scales the scores by head_dim ** -0.5, or for the 27B models (46 layers of Gemma 2, 62 of Gemma 3) by
(hidden_size / heads) ** -0.5, which is what those models' HF configs say.
"""
from __future__ import annotations

from collections.abc import Container

from transformers import MixtralConfig, PretrainedConfig

from pagedllm.models.gguf_loader import GGUFTensorInfo, check_gguf_tensors, read_gguf_header, read_gguf_tensor


def complete_gguf_config(config: PretrainedConfig, path: str) -> PretrainedConfig:
    """``config`` (transformers' reading of the GGUF file at ``path``) completed as the module's docstring says."""
    metadata, tensors = read_gguf_header(path)
    check_gguf_tensors(metadata, tensors)
    arch = metadata["general.architecture"]
    window = metadata.get(f"{arch}.attention.sliding_window")
    if window is not None and getattr(config, "sliding_window", None) is None:
        config.sliding_window = int(window)
    key_length = metadata.get(f"{arch}.attention.key_length")
    if key_length is not None:
        config.head_dim = int(key_length)
    if arch in _GEMMA_27B_LAYERS:
        _set_gemma_attention(config, metadata, arch)
    tensors_by_name = {t.name: t for t in tensors}
    _set_rope_scaling(config, metadata, arch, path, tensors_by_name.get("rope_freqs.weight"))
    if arch == "llama":
        _set_llama_biases(config, tensors_by_name)
    return _with_experts(config, metadata, arch)


def _set_llama_biases(config: PretrainedConfig, tensor_names: Container[str]) -> None:
    """A Llama-architecture file's q/k/v/o and MLP biases, which its config does not say it has (transformers'
    reading gives none): from the first layer's tensors, as the HF config's attention_bias and mlp_bias."""
    config.attention_bias = "blk.0.attn_q.bias" in tensor_names
    config.mlp_bias = "blk.0.ffn_gate.bias" in tensor_names or "blk.0.ffn_up.bias" in tensor_names


_ROPE_SCALING_TYPES = ("none", "linear", "yarn")


def _set_rope_scaling(config: PretrainedConfig, metadata: dict, arch: str, path: str,
                      rope_freqs: GGUFTensorInfo | None) -> None:
    """The file's rope scaling into the config's rope parameters (see the module's docstring); ``rope_freqs``: the
    header's entry of that tensor, if the file has it."""
    kind = str(metadata.get(f"{arch}.rope.scaling.type", "none"))
    if kind not in _ROPE_SCALING_TYPES:
        raise ValueError(f"{arch}.rope.scaling.type: {kind!r} is not supported; supported: "
                         f"{', '.join(_ROPE_SCALING_TYPES)}")
    scaling: dict = {}
    if kind != "none":
        scaling = {"rope_type": kind, "factor": float(metadata[f"{arch}.rope.scaling.factor"])}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = int(metadata[f"{arch}.rope.scaling.original_context_length"])
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if f"{arch}.rope.scaling.{key}" in metadata:
                scaling[name] = float(metadata[f"{arch}.rope.scaling.{key}"])
    if rope_freqs is not None:
        scaling["freq_factors"] = [float(f) for f in read_gguf_tensor(path, rope_freqs).reshape(-1)]
    if not scaling:
        return
    params = dict(getattr(config, "rope_parameters", None) or {})
    if isinstance(params.get("full_attention"), dict):  # Gemma 3: one set per kind of layer
        params["full_attention"] = {**params["full_attention"], **scaling}
    else:
        params.update(scaling)
        params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    config.rope_parameters = params


_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


def _set_gemma_attention(config: PretrainedConfig, metadata: dict, arch: str) -> None:
    """The soft caps the file has, and the scores' scale as llama.cpp takes it (see the module's docstring)."""
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if f"{arch}.{key}" in metadata:
            setattr(config, key, float(metadata[f"{arch}.{key}"]))
    if config.num_hidden_layers == _GEMMA_27B_LAYERS[arch]:
        config.query_pre_attn_scalar = config.hidden_size // config.num_attention_heads
    else:
        config.query_pre_attn_scalar = config.head_dim


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
