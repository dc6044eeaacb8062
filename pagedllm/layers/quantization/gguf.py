"""``quantization="gguf"`` (vLLM's name) and ``"gguf_int4"``: a GGUF file's linear weights stay in their GGUF type
wherever a kernel multiplies by them in it; everything else is dequantized at load, as without quantization.

``gguf``: Q4_0/Q4_1/Q4_K layers by GGUFInt4LinearMethod (gemm_q4_f32, gemm_q4kc_f32 and gemm_q4k_f32; elsewhere torch's
int4 kernel), Q8_0 layers by GGUFQ8LinearMethod (gemm_q8_f32, where it applies: float32 activations on AVX-512 or AVX2),
Q6_K and Q3_K, Q5_K, Q2_K layers by GGUFQ6KLinearMethod, GGUFQ5KLinearMethod and GGUFQ2KLinearMethod (gemm_q6kc_f32
and gemm_q3kc_f32, gemm_q5kc_f32, gemm_q2kc_f32, or with float32 scales gemm_q6k_f32, gemm_q5k_f32, gemm_q2k_f32, the
same), IQ4_NL and IQ4_XS ones by GGUFIQ4LinearMethod (gemm_iq4nl_f32 and gemm_iq4xs_f32,
the same). ``gguf_int4``: the Q4 layers only. Under both a Q8_0 embedding (and LM head) keeps its codes
(layers/vocab_embedding.py). The other types (F16, BF16, F32), and any fused layer with a part of those (a qkv_proj of
Q4_K q/k and an F16 v), are dequantized at load; a fused layer whose parts are packed kinds that differ (Q4_K q/k with a
Q6_K v, as Q4_K_M files have some) keeps each shard in its own kind (GGUFMixedLinearMethod). A mixture-of-experts
layer's stacked experts stay packed where each of its three stacks is of such a kind (GGUFFusedMoEMethod). ``summary``
says which layers got which.
"""

from collections import Counter

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.layers.fused_moe import FusedMoE
from pagedllm.layers.gemm_layout import Q6K_BLOCK, QBLOCK, native_applies
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.base import QuantizationConfig, checkpoint_modules
from pagedllm.layers.quantization.gguf_int4 import Q4_TYPES, GGUFInt4LinearMethod
from pagedllm.layers.quantization.gguf_iq4 import GGUFIQ4LinearMethod
from pagedllm.layers.quantization.gguf_linear import GGUFLinearMethod
from pagedllm.layers.quantization.gguf_mixed import GGUFMixedLinearMethod
from pagedllm.layers.quantization.gguf_moe import GGUFFusedMoEMethod
from pagedllm.layers.quantization.gguf_q8 import (GGUFQ2KLinearMethod, GGUFQ5KLinearMethod, GGUFQ6KLinearMethod,
                                                  GGUFQ8LinearMethod)


class GGUFConfig(QuantizationConfig):
    """Quantizes each linear layer whose checkpoint tensors one packed method takes (``_methods``).

    ``tensor_types`` maps HF weight names to their GGUF types; a fused layer (``qkv_proj``) is looked up through
    the checkpoint names it stacks (``q_proj``, ``k_proj``, ``v_proj``), given as the model's
    ``stacked_params_mapping``, or by its own name where the checkpoint holds it fused too (phi3's ``attn_qkv``).
    """

    name = "gguf"
    q8_layers = True  # Q8_0 layers stay packed where gemm_q8_f32 applies

    def __init__(self, tensor_types: dict[str, GGMLQuantizationType],
                 stacked_params_mapping: list[tuple[str, str, object]], expert_weight_names: tuple[str, ...] = ()):
        """``expert_weight_names``: an MoE model's checkpoint names of its experts' gate, down and up projections."""
        self.tensor_types = tensor_types
        self.stacked_params_mapping = stacked_params_mapping
        self.expert_weight_names = expert_weight_names

    @staticmethod
    def _methods(layer: nn.Module, q8_layers: bool) -> dict[GGMLQuantizationType, type[GGUFLinearMethod]]:
        """GGUF type -> the method keeping ``layer``'s weight of that type packed; a type not here is dequantized.
        Decided as the model is built, so the loader knows which weights to leave packed. ``q8_layers``: whether
        the int8-code kinds count."""
        methods = dict.fromkeys(Q4_TYPES, GGUFInt4LinearMethod)
        if q8_layers and native_applies("gemm_q8", layer.params_dtype, torch.device("cpu")):
            methods[GGMLQuantizationType.Q8_0] = GGUFQ8LinearMethod
            methods[GGMLQuantizationType.Q6_K] = methods[GGMLQuantizationType.Q3_K] = GGUFQ6KLinearMethod
            methods[GGMLQuantizationType.Q5_K] = GGUFQ5KLinearMethod
            methods[GGMLQuantizationType.Q2_K] = GGUFQ2KLinearMethod
            methods[GGMLQuantizationType.IQ4_NL] = methods[GGMLQuantizationType.IQ4_XS] = GGUFIQ4LinearMethod
        return methods

    def _checkpoint_modules(self, prefix: str) -> list[str]:
        """The checkpoint modules behind ``prefix``: itself where the file holds it fused too (phi3's attn_qkv)."""
        if f"{prefix}.weight" in self.tensor_types:
            return [prefix]
        return checkpoint_modules(prefix, self.stacked_params_mapping)

    def _types(self, prefix: str) -> list[GGMLQuantizationType | None]:
        return [self.tensor_types.get(f"{name}.weight") for name in self._checkpoint_modules(prefix)]

    def get_quant_method(self, layer, prefix):
        if isinstance(layer, FusedMoE):
            return self._experts_method(layer, prefix)
        if not isinstance(layer, LinearBase):
            return None
        methods = self._methods(layer, self.q8_layers)
        parts = [methods.get(t) for t in self._types(prefix)]
        if len(set(parts)) == 1:
            return None if parts[0] is None else parts[0]()
        # A fused layer of packed parts of different kinds: each shard in its own kind's panels, where every part
        # has a native kernel (torch's int4 kernel cannot write a shard's columns).
        native_q4 = native_applies("gemm_q4", layer.params_dtype, torch.device("cpu"))
        if None not in parts and hasattr(layer, "output_shards") and (native_q4 or GGUFInt4LinearMethod not in parts):
            return GGUFMixedLinearMethod(parts)
        return None

    def _expert_modules(self, prefix: str) -> list[str]:
        """The checkpoint modules of the experts ``prefix`` (gate, down, up), ``{expert}`` standing for the index,
        as the loader names a file's stacked ``_exps`` tensors."""
        return [f"{prefix}.{{expert}}.{name}" for name in self.expert_weight_names]

    def _experts_method(self, layer: FusedMoE, prefix: str) -> GGUFFusedMoEMethod | None:
        """Packed experts where every stack is of a kind a native kernel takes (the Q4 kinds need gemm_q4: torch's
        int4 kernel cannot write half an output); else None, and the layer's experts are dequantized. Under
        gguf_int4 too the int8-code kinds count here: a Q4_K_M file's Q6_K down stacks would otherwise take the
        whole layer's experts to float32, several times the memory of the packed ones."""
        methods = self._methods(layer, q8_layers=True)
        kinds = [methods.get(self.tensor_types.get(f"{name}.weight")) for name in self._expert_modules(prefix)]
        if not kinds or None in kinds or (GGUFInt4LinearMethod in kinds and
                                          not native_applies("gemm_q4", layer.params_dtype, torch.device("cpu"))):
            return None
        return GGUFFusedMoEMethod(dict(zip(("w1", "w2", "w3"), kinds)))

    def int8_rows_block(self, prefix: str) -> int | None:
        """A Q8_0 embedding (or LM head) keeps its codes, 32 inputs a scale; so does a Q6_K one (as Q4_K_M files
        hold the LM head, or a tied embedding), 16 a scale."""
        return {GGMLQuantizationType.Q8_0: QBLOCK, GGMLQuantizationType.Q6_K: Q6K_BLOCK}.get(
            self.tensor_types.get(f"{prefix}.weight"))

    def packed_modules(self, model: nn.Module) -> set[str]:
        """Checkpoint modules whose weights must load as codes and scales: the layers quantized here and the
        embeddings and LM heads that keep int8 codes."""
        linear = {name for prefix, module in model.named_modules()
                  if isinstance(getattr(module, "quant_method", None), GGUFLinearMethod)
                  for name in self._checkpoint_modules(prefix)}
        experts = {name for prefix, module in model.named_modules()
                   if isinstance(getattr(module, "quant_method", None), GGUFFusedMoEMethod)
                   for name in self._expert_modules(prefix)}
        return linear | experts | _q8_embeddings(model)

    def summary(self, model: nn.Module) -> str:
        """Which linear layers stay packed and which are dequantized, counted by their GGUF types (a fused layer's
        parts joined by ``+``), and the embeddings and LM heads that keep their codes."""
        counts = {True: Counter(), False: Counter()}
        experts = {True: Counter(), False: Counter()}
        for prefix, module in model.named_modules():
            if isinstance(module, LinearBase):
                types = "+".join(sorted({t.name for t in self._types(prefix) if t is not None}))
                if types:
                    counts[isinstance(module.quant_method, GGUFLinearMethod)][types] += 1
            elif isinstance(module, FusedMoE):
                types = "+".join(sorted({t.name for name in self._expert_modules(prefix)
                                         if (t := self.tensor_types.get(f"{name}.weight")) is not None}))
                experts[isinstance(module.quant_method, GGUFFusedMoEMethod)][types] += 1
        q8 = sorted(_q8_embeddings(model))

        def listed(counter: Counter) -> str:
            return ", ".join(f"{types} x{n}" for types, n in sorted(counter.items())) or "none"

        moe = (f"; experts kept packed: {listed(experts[True])}; experts dequantized at load: "
               f"{listed(experts[False])}") if experts[True] or experts[False] else ""
        return (f"linear layers kept packed: {listed(counts[True])}; dequantized at load: {listed(counts[False])}; "
                f"embeddings and LM heads kept packed: {', '.join(q8) or 'none'}{moe}")


def _q8_embeddings(model: nn.Module) -> set[str]:
    """The checkpoint modules of the embeddings (and LM heads) that keep their int8 codes (Q8_0, Q6_K)."""
    return {module.prefix for module in model.modules() if getattr(module, "q8", False)}


class GGUFInt4Config(GGUFConfig):
    """``gguf_int4``: only Q4_0/Q4_1/Q4_K linear layers stay packed (Q8_0 ones are dequantized); experts as under
    ``gguf``."""

    name = "gguf_int4"
    q8_layers = False
