"""GGUF Q4_0/Q4_1 weights kept 4-bit.

Decode on CPU is bound by reading weights, and a 4-bit weight is an eighth of a
float32 one. A GGUF Q4 block is 32 weights along the input dim with one fp16
scale ``d`` (and, for Q4_1, one min ``m``): ``w = (q - 8) * scale + zero``, Q4_0
``w = d (q - 8)`` giving zero 0 and Q4_1 ``w = d q + m`` zero ``m + 8 d``.
In float32 on CPU with AVX-512 the native kernel (native/gemm.c, ``gemm_q4_f32``)
multiplies by these exactly as the dense path multiplies by the dequantized
weights; elsewhere torch's CPU int4 kernel does, its scales and zeros rounded to
bf16 and its activations run in bf16.
"""

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.layers.gemm_layout import QuantizedWeight, WeightLayout, native_applies
from pagedllm.layers.linear import LinearBase
from pagedllm.layers.quantization.base import QuantizationConfig, QuantizeMethodBase, checkpoint_modules

GROUP_SIZE = 32  # weights per GGUF Q4 block, and per scale/zero group of the kernels
Q4_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1})


class GGUFInt4LinearMethod(QuantizeMethodBase):
    """Loads 4-bit codes and per-group scales/zeros row-major, like a dense weight, then packs them.

    While loading, ``qweight`` is ``[out, in]`` uint8 codes in ``[0, 16)`` and
    ``scales``/``zeros`` are ``[out, in / 32]`` float32, so the layers'
    tensor-parallel weight loaders slice them as they slice a dense weight.
    On the torch kernel, activations go through in bfloat16 (its only fast input
    dtype on CPU) and come back in the caller's dtype.
    """

    def __init__(self):
        self.packed: QuantizedWeight | None = None  # the weight in the native kernel's panels, when it applies

    def create_weights(self, layer, input_size_per_partition, output_size_per_partition, params_dtype,
                       weight_loader):
        if input_size_per_partition % GROUP_SIZE or output_size_per_partition % 16:
            raise ValueError(f"gguf_int4 needs in % {GROUP_SIZE} == 0 and out % 16 == 0 per rank, got "
                             f"in={input_size_per_partition}, out={output_size_per_partition}")
        groups = input_size_per_partition // GROUP_SIZE
        self.params_dtype = params_dtype
        for name, cols, dtype in (("qweight", input_size_per_partition, torch.uint8),
                                  ("scales", groups, torch.float32), ("zeros", groups, torch.float32)):
            param = nn.Parameter(torch.empty(output_size_per_partition, cols, dtype=dtype), requires_grad=False)
            param.weight_loader = weight_loader
            layer.register_parameter(name, param)

    def process_weights_after_loading(self, layer, layout: WeightLayout | None = None):
        if native_applies("gemm_q4", self.params_dtype, layer.qweight.device):
            self.packed = QuantizedWeight.q4(layer.qweight, layer.scales, layer.zeros, layout)
            del layer.qweight, layer.scales, layer.zeros
            layer.qweight = nn.Parameter(self.packed.panels, requires_grad=False)
            return
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(layer.qweight.to(torch.int32), 1)
        # The kernel wants [in / 32, out, (scale, zero)] in bfloat16.
        scales_and_zeros = torch.stack([layer.scales, layer.zeros], dim=-1).transpose(0, 1).to(torch.bfloat16)
        del layer.qweight, layer.scales, layer.zeros
        layer.qweight = nn.Parameter(packed, requires_grad=False)
        layer.scales_and_zeros = nn.Parameter(scales_and_zeros.contiguous(), requires_grad=False)

    def apply(self, layer, x, bias=None):
        if self.packed is not None:
            return self.packed.linear(x, bias)
        x_2d = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x_2d, layer.qweight, GROUP_SIZE, layer.scales_and_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias


class GGUFInt4Config(QuantizationConfig):
    """Quantizes each linear layer whose checkpoint tensors are all Q4_0/Q4_1.

    ``tensor_types`` maps HF weight names to their GGUF types; a fused layer
    (``qkv_proj``) is looked up through the checkpoint names it stacks
    (``q_proj``, ``k_proj``, ``v_proj``), given as the model's
    ``stacked_params_mapping``, or by its own name where the checkpoint holds
    it fused too (phi3's ``attn_qkv``). Other layers (and tensors such as Q8_0
    embeddings) stay dense and dequantized.
    """

    def __init__(self, tensor_types: dict[str, GGMLQuantizationType],
                 stacked_params_mapping: list[tuple[str, str, object]]):
        self.tensor_types = tensor_types
        self.stacked_params_mapping = stacked_params_mapping

    def _checkpoint_modules(self, prefix: str) -> list[str]:
        """The checkpoint modules behind ``prefix``: itself where the file holds it fused too (phi3's attn_qkv)."""
        if f"{prefix}.weight" in self.tensor_types:
            return [prefix]
        return checkpoint_modules(prefix, self.stacked_params_mapping)

    def get_quant_method(self, layer, prefix):
        if not isinstance(layer, LinearBase):
            return None
        types = [self.tensor_types.get(f"{name}.weight")
                 for name in self._checkpoint_modules(prefix)]
        return GGUFInt4LinearMethod() if all(t in Q4_TYPES for t in types) else None

    def keeps_q8(self, prefix: str) -> bool:
        """Whether the embedding (or LM head) ``prefix`` keeps its checkpoint's Q8_0 codes."""
        return self.tensor_types.get(f"{prefix}.weight") == GGMLQuantizationType.Q8_0

    def packed_modules(self, model: nn.Module) -> set[str]:
        """Checkpoint modules whose weights must load as codes and scales: the layers quantized here and the
        embeddings kept in Q8_0."""
        linear = {name for prefix, module in model.named_modules()
                  if isinstance(getattr(module, "quant_method", None), GGUFInt4LinearMethod)
                  for name in self._checkpoint_modules(prefix)}
        return linear | {module.prefix for module in model.modules() if getattr(module, "q8", False)}
