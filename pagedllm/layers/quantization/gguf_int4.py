"""GGUF Q4_0/Q4_1/Q4_K weights kept 4-bit.

Decode on CPU is bound by reading weights, and a 4-bit weight is an eighth of a
float32 one. A GGUF Q4 block is 32 weights along the input dim with a scale and
a zero (models/gguf_loader.unpack_q4): ``w = q * scale + zero``, Q4_0
``w = d (q - 8)`` giving zero ``-8 d``, Q4_1 ``w = d q + m`` zero ``m``, Q4_K
(32 of a 256 super-block) ``w = (d sc) q - dmin m``.
In float32 on CPU with AVX-512 or AVX2 the native kernel (native/gemm.c, ``gemm_q4_f32``; for Q4_K
``gemm_q4kc_f32``, its scales and zeros factored per super-block, or ``gemm_q4k_f32`` with them
float32) multiplies by these exactly as the
dense path multiplies by the dequantized weights; elsewhere torch's CPU int4
kernel does, its scales and zeros rounded to bf16 and its activations run in bf16.
"""

import torch
from gguf import GGMLQuantizationType
from torch import nn

from pagedllm.layers.gemm_layout import QBLOCK, QuantizedWeight, WeightLayout, native_applies
from pagedllm.layers.quantization.gguf_linear import GGUFLinearMethod

Q4_TYPES = frozenset({GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K})


class GGUFInt4LinearMethod(GGUFLinearMethod):
    """Loads 4-bit codes (uint8 in ``[0, 16)``) and per-block scales/zeros, then packs them for gemm_q4_f32, or
    for torch's int4 kernel, where activations go through in bfloat16 (its only fast input dtype on CPU) and come
    back in the caller's dtype."""

    code_dtype = torch.uint8
    block_params = ("scales", "zeros")
    out_multiple = 16

    @staticmethod
    def pack(parts: list[torch.Tensor], layout: WeightLayout | None) -> QuantizedWeight:
        return QuantizedWeight.q4(*parts, layout)

    def process_weights_after_loading(self, layer, layout: WeightLayout | None = None):
        if native_applies("gemm_q4", self.params_dtype, layer.qweight.device):
            super().process_weights_after_loading(layer, layout)
            return
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(layer.qweight.to(torch.int32), 1)
        # The kernel wants [in / 32, out, (scale, zero)] in bfloat16, a weight being (q - 8) * scale + zero.
        zeros = layer.zeros + 8 * layer.scales
        scales_and_zeros = torch.stack([layer.scales, zeros], dim=-1).transpose(0, 1).to(torch.bfloat16)
        del layer.qweight, layer.scales, layer.zeros
        layer.qweight = nn.Parameter(packed, requires_grad=False)
        layer.scales_and_zeros = nn.Parameter(scales_and_zeros.contiguous(), requires_grad=False)

    def apply(self, layer, x, bias=None):
        if self.packed is not None:
            return super().apply(layer, x, bias)
        x_2d = x.reshape(-1, x.shape[-1]).to(torch.bfloat16).contiguous()
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x_2d, layer.qweight, QBLOCK, layer.scales_and_zeros)
        y = y.to(x.dtype).reshape(*x.shape[:-1], -1)
        return y if bias is None else y + bias
