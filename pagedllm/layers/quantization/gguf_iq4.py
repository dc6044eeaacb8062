"""GGUF IQ4_NL and IQ4_XS weights kept 4-bit: per 32 inputs a scale (IQ4_NL's fp16 ``d``, IQ4_XS's ``d (ls - 32)``)
and 4-bit indices into 16 fixed, non-linearly spaced values (models/gguf_loader.IQ4_NL_VALUES), a weight being
``value * scale``. native/gemm.c's ``gemm_iq4nl_f32`` / ``gemm_iq4xs_f32`` look the values up in registers on the Q4
panels' nibbles (0.56 / 0.63 bytes a weight) and scale them with the loader's one rounding, so results equal the
dense float32 path's on the dequantized weight bit for bit. Where that kernel does not apply GGUFConfig leaves the
layers dense, dequantized at load.
"""

import torch

from pagedllm.layers.gemm_layout import QuantizedWeight, WeightLayout
from pagedllm.layers.quantization.gguf_linear import GGUFLinearMethod


class GGUFIQ4LinearMethod(GGUFLinearMethod):
    """Loads 4-bit indices (uint8 in ``[0, 16)``) and per-32 float32 scales, then lays them out as IQ4 panels."""

    code_dtype = torch.uint8
    block_params = ("scales",)

    @staticmethod
    def pack(parts: list[torch.Tensor], layout: WeightLayout | None) -> QuantizedWeight:
        return QuantizedWeight.iq4(*parts, layout)
