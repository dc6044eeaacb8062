"""Llama decoder-only model (also Mistral and Phi-3, and the base of Qwen2 and Qwen3), over a flattened batch and a
paged KV cache; layers with a sliding window (config.layer_sliding_window) attend only to it.

Phi-3 checkpoints hold q/k/v fused in ``qkv_proj`` ([q; k; v] rows) and gate/up in ``gate_up_proj`` ([gate; up]),
named as the fused parameters here: they reach the fused layers' loaders without a shard id, which cut them into
their outputs and each rank's slice of each. Their config's dropouts act only in training, and their longrope is
the rotary embedding's (layers/rope_scaling.py, where it parts from transformers' Phi-3 generate past the original
length)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from pagedllm.config import head_dim, layer_sliding_window
from pagedllm.distributed.parallel_state import ParallelRank
from pagedllm.layers.activation import GeluAndMul, SiluAndMul
from pagedllm.layers.attention import Attention, AttentionMetadata, KVCache
from pagedllm.layers.fused_moe import expert_weight_target
from pagedllm.layers.gemm_layout import WeightLayout
from pagedllm.layers.layernorm import HeadRMSNorm, RMSNorm
from pagedllm.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.quantization import QuantizationConfig
from pagedllm.layers.rotary import RotaryEmbedding, get_rope
from pagedllm.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pagedllm.models.weights import default_weight_loader

if TYPE_CHECKING:  # the engine process gets a plain copy (config.HFConfigValues), not this class
    from transformers import PretrainedConfig


_GATED_ACTIVATIONS = {"silu": SiluAndMul, "gelu_pytorch_tanh": GeluAndMul}
# A checkpoint's KV cache scales, by the names vLLM's maybe_remap_kv_scale_name takes (compressed-tensors'
# kv_cache_scheme: self_attn.k_scale, v_scale, q_scale; vLLM's own self_attn.attn.k_scale; ModelOpt's k_proj.k_scale;
# qkv_proj.k_scale; the deprecated kv_scale, which vLLM reads as the k_scale; older exports' k_proj / v_proj
# output_scale; compressed-tensors' q/k/v_zero_point, zeros beside a symmetric scheme's scales). The k and v scales
# are the layer's fp8 cache's (Attention.set_kv_cache_scales); q_scale and prob_scale are fp8 attention's, which no
# kernel here computes, output_scale vLLM no longer reads, and the zero points vLLM ignores too: skipped.
KV_CACHE_SCALE = re.compile(r"(?P<layer>.*)\.self_attn\.(?:(?:[kv]_proj|qkv_proj|attn)\.)?"
                            r"(?P<kind>k|v|q|kv|prob)_scale|.*\.self_attn\.[kqv]_proj\.output_scale"
                            r"|.*\.self_attn\.(?:attn\.)?[qkv]_zero_point")


def kv_cache_scale(checkpoint_name: str, tensor: torch.Tensor, num_kv_heads: int,
                   strategy: str | None = None) -> float | torch.Tensor:
    """A checkpoint's k_scale or v_scale, as vLLM scales an fp8 cache: one value (per tensor) as a float, or one per
    KV head of the model's ``num_kv_heads`` (a compressed-tensors kv_cache_scheme of strategy "attn_head"; saved as
    ``[num_kv_heads]`` or, by LLM-Compressor, ``[num_kv_heads, 1, 1]``) as float32 ``[num_kv_heads]``; each value
    positive and finite. ``strategy``: the checkpoint's kv_cache_scheme's, if it declares one; under "tensor" a
    scale is one value, as vLLM's one-element k_scale / v_scale parameters take no other (its load fails)."""
    if strategy == "tensor" and tensor.numel() != 1:
        raise ValueError(f"Checkpoint tensor {checkpoint_name!r}: the kv_cache_scheme's strategy 'tensor' takes one "
                         f"KV cache scale a layer, got shape {tuple(tensor.shape)} (per-head scales are strategy "
                         f"'attn_head')")
    if tensor.numel() not in (1, num_kv_heads):
        raise ValueError(f"Checkpoint tensor {checkpoint_name!r}: a KV cache scale must be one (per-tensor) value or "
                         f"one per KV head ({num_kv_heads}), got shape {tuple(tensor.shape)}")
    values = tensor.float().flatten()
    bad = values[~(values.isfinite() & (values > 0))]
    if bad.numel():
        raise ValueError(f"Checkpoint tensor {checkpoint_name!r}: a KV cache scale must be positive and finite, "
                         f"got {bad[0].item()}")
    return values.item() if tensor.numel() == 1 else values


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, bias: bool,
                 tp_size: int, tp_rank: int, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 reduce_results: bool = True):
        """``hidden_act``: the gate's activation, ``silu`` (SwiGLU; fused into the gate_up GEMM where its layout
        has a kernel for it) or ``gelu_pytorch_tanh`` (GeGLU, Gemma's). ``reduce_results``: False leaves the output
        this rank's partial sum, for a caller that adds it to another partial sum and all-reduces once (an MoE
        block's shared expert)."""
        super().__init__()
        if hidden_act not in _GATED_ACTIVATIONS:
            raise NotImplementedError(f"hidden_act {hidden_act!r} is not supported, only {sorted(_GATED_ACTIVATIONS)}")
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size] * 2, bias=bias, tp_size=tp_size, tp_rank=tp_rank,
            quant_config=quant_config, prefix=f"{prefix}.gate_up_proj", gated_silu=hidden_act == "silu",
        )
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, tp_size=tp_size, tp_rank=tp_rank,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj",
                                           reduce_results=reduce_results)
        self.act_fn = _GATED_ACTIVATIONS[hidden_act]()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        activated = self.gate_up_proj.silu_and_mul(x)  # the activation fused into the GEMM, where it can be
        if activated is None:
            activated = self.act_fn(self.gate_up_proj(x))
        return self.down_proj(activated)


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, tp_size: int, tp_rank: int,
                 rotary_emb: RotaryEmbedding, quant_config: QuantizationConfig | None = None, prefix: str = "",
                 qk_norm: bool = False, sliding_window: int | None = None, scale: float | None = None,
                 logits_soft_cap: float | None = None):
        """``qk_norm``: each query and key head is RMS-normalised before the rotary embedding (Qwen3);
        ``sliding_window``: this layer's window (None: full attention); ``scale``: of the attention scores
        (default head_dim ** -0.5); ``logits_soft_cap``: the scaled scores' soft cap (Gemma 2's; None: none)."""
        super().__init__()
        self.head_dim = head_dim(config)
        self.qkv_proj = QKVParallelLinear(
            config.hidden_size,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            bias=qkv_bias,
            tp_size=tp_size,
            tp_rank=tp_rank,
            quant_config=quant_config,
            prefix=f"{prefix}.qkv_proj",
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias=o_bias,
            tp_size=tp_size, tp_rank=tp_rank, quant_config=quant_config, prefix=f"{prefix}.o_proj",
        )
        self.rotary_emb = rotary_emb  # one module for all layers: cos/sin once per step
        self.attn = Attention(self.num_heads, self.head_dim, scale or self.head_dim**-0.5, self.num_kv_heads,
                              sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
        self.q_norm = self.k_norm = None
        if qk_norm:
            self.q_norm = HeadRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = HeadRMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor, kv_cache: KVCache,
                attn_metadata: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(hidden_states)
        if self.q_norm is not None:
            self.q_norm.forward_heads_(qkv, self.num_heads)
            self.k_norm.forward_heads_(qkv[:, self.q_size:], self.num_kv_heads)
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, qk).split([self.q_size, self.kv_size], dim=-1)
        return self.o_proj(self.attn(q, k, v, kv_cache, attn_metadata))


def input_norm(norm: RMSNorm, hidden_states: torch.Tensor, residual: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's first norm over the residual stream: (normed, residual). The first layer starts the stream
    with its input; a later one adds the previous layer's output to it first (fused into the norm)."""
    if residual is None:
        return norm(hidden_states), hidden_states
    return norm(hidden_states, residual)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, qkv_bias: bool, o_bias: bool, tp_size: int, tp_rank: int,
                 rotary_emb: RotaryEmbedding, mlp: nn.Module, mlp_name: str = "mlp",
                 quant_config: QuantizationConfig | None = None, prefix: str = "", qk_norm: bool = False,
                 sliding_window: int | None = None):
        """``mlp``: the feed-forward block (dense, or a mixture of experts), registered as ``mlp_name`` (the
        checkpoint's name for it, e.g. Mixtral's ``block_sparse_moe``); ``sliding_window``: the attention's."""
        super().__init__()
        self.self_attn = LlamaAttention(config, qkv_bias, o_bias, tp_size, tp_rank, rotary_emb, quant_config,
                                        f"{prefix}.self_attn", qk_norm, sliding_window)
        self.mlp_name = mlp_name
        self.add_module(mlp_name, mlp)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual, kv_cache, attn_metadata):
        """Returns (mlp output, residual); the next layer's norm adds them."""
        hidden_states, residual = input_norm(self.input_layernorm, hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states, kv_cache, attn_metadata)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return getattr(self, self.mlp_name)(hidden_states), residual


class PPMissingLayer(nn.Module):
    """Stands where a module lives on another pipeline stage: no parameters, never called."""

    def forward(self, *args, **kwargs):
        raise RuntimeError("PPMissingLayer: this module runs on another pipeline stage")


class IntermediateTensors(dict):
    """What one pipeline stage hands the next: ``hidden_states`` and ``residual``, each ``[T, hidden_size]``."""

    KEYS = ("hidden_states", "residual")


class LlamaModel(nn.Module):
    """The decoder stack, or the layers ``[start_layer, end_layer)`` of one pipeline stage: the first stage holds
    the embedding, the last the final norm; layers of other stages are PPMissingLayer (and get no KV cache)."""

    def __init__(self, config: PretrainedConfig, make_layer: Callable[[int, str], nn.Module], tp_size: int,
                 tp_rank: int, quant_config: QuantizationConfig | None = None, prefix: str = "model",
                 layer_range: tuple[int, int] | None = None, embed_scale: float = 1.0):
        """``make_layer(layer_index, prefix)``: a decoder layer, called with ``(positions, hidden_states, residual,
        kv_cache, attn_metadata)`` and returning ``(hidden_states, residual)``; ``embed_scale`` multiplies the
        embedded tokens (Gemma's sqrt(hidden_size))."""
        super().__init__()
        self.start_layer, self.end_layer = layer_range or (0, config.num_hidden_layers)
        self.is_first_stage = self.start_layer == 0
        self.is_last_stage = self.end_layer == config.num_hidden_layers
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, tp_size=tp_size, tp_rank=tp_rank, quant_config=quant_config,
            prefix=f"{prefix}.embed_tokens", embed_scale=embed_scale,
        ) if self.is_first_stage else PPMissingLayer()
        self.layers = nn.ModuleList(
            make_layer(i, f"{prefix}.layers.{i}") if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps) if self.is_last_stage else PPMissingLayer()

    def forward(self, input_ids, positions, kv_caches: list[KVCache], attn_metadata,
                intermediate_tensors: IntermediateTensors | None = None) -> torch.Tensor | IntermediateTensors:
        """``kv_caches``: one per layer of this stage. The first stage embeds ``input_ids``, later ones continue
        from ``intermediate_tensors``; the last returns final hidden states, the others IntermediateTensors."""
        if self.is_first_stage:
            hidden_states, residual = self.embed_tokens(input_ids), None
        else:
            hidden_states, residual = intermediate_tensors["hidden_states"], intermediate_tensors["residual"]
        stage = self.layers[self.start_layer:self.end_layer]
        for layer, kv_cache in zip(stage, kv_caches, strict=True):
            hidden_states, residual = layer(positions, hidden_states, residual, kv_cache, attn_metadata)
        if not self.is_last_stage:
            return IntermediateTensors(hidden_states=hidden_states, residual=residual)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    qk_norm = False  # whether each query and key head is RMS-normalised before the rotary embedding
    mlp_name = "mlp"  # the checkpoint's name for a layer's feed-forward block
    supports_cpu_graphs = True  # a step's forward is native kernels only, so decode steps can replay CPU graphs
    # A mixture of experts' checkpoint names for an expert's gate, down and up projections (e.g. Mixtral's w1, w2,
    # w3), which load into the layer's fused expert weights (layers/fused_moe.py); empty for a dense model.
    expert_weight_names: tuple[str, ...] = ()
    # Checkpoint projections that live inside one fused parameter here:
    # (fused param name, checkpoint name, shard id)
    stacked_params_mapping = [
        (".qkv_proj", ".q_proj", "q"),
        (".qkv_proj", ".k_proj", "k"),
        (".qkv_proj", ".v_proj", "v"),
        (".gate_up_proj", ".gate_proj", 0),
        (".gate_up_proj", ".up_proj", 1),
    ]

    def __init__(self, config: PretrainedConfig, quant_config: QuantizationConfig | None = None,
                 rank: ParallelRank = ParallelRank(), layer_range: tuple[int, int] | None = None):
        """``rank``: the tensor-parallel slice this process holds; ``layer_range``: its pipeline stage's layers
        (None: all)."""
        super().__init__()
        self.config = config
        tp_size, tp_rank = rank.tp_size, rank.tp_rank
        self.model = LlamaModel(config, self.layer_factory(config, rank, quant_config), tp_size, tp_rank,
                                quant_config, layer_range=layer_range, embed_scale=self.embed_scale(config))
        if not self.model.is_last_stage:
            self.lm_head = PPMissingLayer()
        elif config.tie_word_embeddings and self.model.is_first_stage:
            self.lm_head = self.model.embed_tokens
        else:  # untied, or tied with the embedding on another stage: this stage loads its own copy
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp_size=tp_size, tp_rank=tp_rank,
                                          quant_config=quant_config,
                                          prefix="model.embed_tokens" if config.tie_word_embeddings else "lm_head")
        self.logits_processor = LogitsProcessor(config.vocab_size)

    def layer_factory(self, config: PretrainedConfig, rank: ParallelRank,
                      quant_config: QuantizationConfig | None) -> Callable[[int, str], nn.Module]:
        """``make_layer(layer_index, prefix)`` for LlamaModel: Llama's decoder layers, sharing one rotary
        embedding, each with its feed-forward block (``make_mlp``) and its attention window."""
        rotary_emb = get_rope(head_dim(config), config)
        qkv_bias, o_bias = self.attention_biases(config)

        def make_layer(layer_index: int, prefix: str) -> nn.Module:
            mlp = self.make_mlp(config, layer_index, rank, quant_config, f"{prefix}.{self.mlp_name}")
            return LlamaDecoderLayer(config, qkv_bias, o_bias, rank.tp_size, rank.tp_rank, rotary_emb, mlp,
                                     self.mlp_name, quant_config, prefix, self.qk_norm,
                                     layer_sliding_window(config, layer_index))

        return make_layer

    @staticmethod
    def embed_scale(config: PretrainedConfig) -> float:
        """What the embedded tokens are multiplied by: 1 for Llama."""
        return 1.0

    @staticmethod
    def make_mlp(config: PretrainedConfig, layer_index: int, rank: ParallelRank,
                 quant_config: QuantizationConfig | None, prefix: str) -> nn.Module:
        """Layer ``layer_index``'s feed-forward block: Llama's is dense in every layer."""
        return LlamaMLP(config.hidden_size, config.intermediate_size, config.hidden_act,
                        getattr(config, "mlp_bias", False), rank.tp_size, rank.tp_rank, quant_config, prefix)

    @staticmethod
    def dense_mlp(config: PretrainedConfig, layer_index: int) -> bool:
        """Whether layer ``layer_index``'s feed-forward block (``make_mlp``'s) is a dense MLP, gate_up_proj and
        down_proj, on which LoRA adapters serve: every layer's for Llama."""
        return True

    @staticmethod
    def attention_biases(config: PretrainedConfig) -> tuple[bool, bool]:
        """Whether (qkv_proj, o_proj) have a bias; Llama uses one flag for both."""
        bias = getattr(config, "attention_bias", False)
        return bias, bias

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                attn_metadata: AttentionMetadata, intermediate_tensors: IntermediateTensors | None = None
                ) -> torch.Tensor | IntermediateTensors:
        """``[T]`` token ids and positions -> ``[T, hidden_size]`` final hidden states (or, before the last
        pipeline stage, the IntermediateTensors for the next)."""
        return self.model(input_ids, positions, kv_caches, attn_metadata, intermediate_tensors)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """``[N, hidden_size]`` -> float32 ``[N, vocab_size]`` on TP rank 0 (None on the other TP ranks)."""
        return self.logits_processor(self.lm_head, hidden_states)

    def process_weights_after_loading(self, layout: WeightLayout | None = None) -> None:
        if self.model.is_last_stage:
            self.lm_head.prepare_projection(layout)

    def _on_other_stage(self, name: str) -> bool:
        """Whether checkpoint tensor ``name`` belongs to a module of another pipeline stage. A module the model does
        not have at all (a layer past its last, a name no architecture of its kind has) is not: such a tensor is a
        checkpoint that does not fit the config, an error rather than a tensor to skip."""
        module: nn.Module = self
        for part in name.split(".")[:-1]:
            module = getattr(module, part, None)
            if module is None:
                return False
            if isinstance(module, PPMissingLayer):
                return True
        return False

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF-named checkpoint tensors; returns the parameter names filled (a fused one once each of the
        checkpoint's parts of it has loaded: a part that never comes would leave its rows uninitialised memory)."""
        params = dict(self.named_parameters())
        loaded = set()
        fused_parts: dict[str, set] = {}  # fused parameter -> the shard ids of its parts loaded so far
        kv_scales: dict[str, dict[str, tuple[str, torch.Tensor]]] = {}  # a layer's -> its "k" and "v" scales' tensors
        for checkpoint_name, tensor in weights:
            name = checkpoint_name  # the parameter it loads into, once named so (a fused one, an expert stack)
            if "rotary_emb.inv_freq" in name:
                continue
            if scale := KV_CACHE_SCALE.fullmatch(name):
                if scale["kind"] in ("k", "v", "kv") and not self._on_other_stage(name):
                    kind = "v" if scale["kind"] == "v" else "k"  # kv_scale: vLLM's k_scale
                    kv_scales.setdefault(scale["layer"], {})[kind] = checkpoint_name, tensor
                continue
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if (name.startswith("model.embed_tokens.") and self.config.tie_word_embeddings
                    and isinstance(self.lm_head, ParallelLMHead)):
                # The tied LM head of a last stage without the embedding: the embedding's rows are its weight.
                lm_name = "lm_head." + name.removeprefix("model.embed_tokens.")
                params[lm_name].weight_loader(params[lm_name], tensor)
                loaded.add(lm_name)
            expert = expert_weight_target(name, self.expert_weight_names) if self.expert_weight_names else None
            shard_id = None
            if expert is not None:  # before the stacked names: an expert's gate_proj is not a dense gate_proj
                name = expert[0]
            else:
                for fused, original, stacked_shard_id in self.stacked_params_mapping:
                    if original in name:
                        name, shard_id = name.replace(original, fused), stacked_shard_id
                        break
            if name not in params and self._on_other_stage(name):
                continue
            if name not in params:
                raise ValueError(f"Checkpoint tensor {checkpoint_name!r} matches no parameter of {type(self).__name__}")
            param = params[name]
            try:
                if expert is not None:  # its id and shard (w1, w2, w3)
                    param.weight_loader(param, tensor, *expert[1:])
                elif shard_id is None:
                    getattr(param, "weight_loader", default_weight_loader)(param, tensor)
                else:
                    param.weight_loader(param, tensor, shard_id)
            except ValueError as e:  # a shape that does not fit the config: name the tensor
                raise ValueError(f"Checkpoint tensor {checkpoint_name!r}: {e}") from None
            if shard_id is None:
                loaded.add(name)
            else:
                fused_parts.setdefault(name, set()).add(shard_id)
        # (A GGUF part's zeros come from the tensor its codes do, and some kinds have none: a Q6_K v beside Q4_K q, k.)
        missing = sorted(name.replace(fused, original) for name, parts in fused_parts.items()
                         for fused, original, shard_id in self.stacked_params_mapping
                         if fused in name and shard_id not in parts and not name.endswith(".zeros"))
        if missing:
            raise ValueError(f"Checkpoint lacks tensors {missing}: the other parts of their fused layers are there")
        for layer, scales in kv_scales.items():
            self._set_kv_cache_scales(layer, scales)
        return loaded | set(fused_parts)

    def _set_kv_cache_scales(self, layer: str, scales: dict[str, tuple[str, torch.Tensor]]) -> None:
        """Layer ``layer``'s attention takes the checkpoint's ``scales`` ("k", "v": each its tensor's name and the
        tensor); one alone stands for both, as vLLM duplicates a lone k_scale (the deprecated kv_scale's) to the
        v_scale. Of per-head scales this rank keeps its own KV heads' (those its qkv_proj holds), as vLLM's
        tensor-parallel loader of "attn_head" scales does."""
        try:
            attention = self.get_submodule(f"{layer}.self_attn")
        except AttributeError:
            raise ValueError(f"Checkpoint KV cache scales of {layer!r} match no attention layer of "
                             f"{type(self).__name__}") from None
        qkv = attention.qkv_proj
        first = qkv.tp_rank // qkv.num_kv_head_replicas * qkv.num_kv_heads
        scheme = (getattr(self.config, "quantization_config", None) or {}).get("kv_cache_scheme") or {}
        values = {}
        for kind, (name, tensor) in scales.items():
            value = kv_cache_scale(name, tensor, qkv.total_num_kv_heads, scheme.get("strategy"))
            values[kind] = value if isinstance(value, float) else value[first : first + qkv.num_kv_heads]
        attention.attn.set_kv_cache_scales(values.get("k", values.get("v")), values.get("v", values.get("k")))
