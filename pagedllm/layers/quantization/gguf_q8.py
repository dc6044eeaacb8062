"""GGUF Q8_0 weights kept 8-bit: int8 codes in blocks of 32 along the input dim with one fp16 scale each, as
llama.cpp stores them (1.06 bytes a weight instead of float32's 4), a weight being ``code * scale``; and Q6_K ones
as int8 codes ``q - 32`` with a scale ``d * sc`` per 16 (0.83 bytes a weight with the codes bit-packed and the
scales factored per super-block: gemm_q6kc_f32; 1.25 as int8 codes and float32 scales: gemm_q6k_f32), and Q5_K ones
as int8 codes ``q`` with a scale ``d * sc`` and zero ``-dmin * m`` per 32 (0.72 bytes, packed and factored:
gemm_q5kc_f32; 1.25: gemm_q5k_f32); Q3_K as Q6_K (codes ``q - 4``, scales ``d (sc - 32)`` per 16; 0.45 bytes, its
codes in a 3-bit plane: gemm_q3kc_f32) and Q2_K as Q5_K per 16 (0.34 / 1.5 bytes; gemm_q2kc_f32, gemm_q2k_f32).

native/gemm.c's ``gemm_q8_f32`` widens each row of codes and scales it in registers, one rounding as the loader's
dequantization has (exact in float32), then sums in float32 in the dense kernel's order: results equal the dense
float32 path's on the dequantized weight bit for bit. The kernel needs AVX-512 (or AVX2 with FMA and F16C) and float32
activations; where it does not apply, GGUFConfig leaves Q8_0 layers dense, dequantized at load (a torch path that rebuilt the weight on every
call would be several times slower than the dense one), so this method always holds the panels.
"""

import torch

from pagedllm.layers.gemm_layout import Q6K_BLOCK, QuantizedWeight, WeightLayout
from pagedllm.layers.quantization.gguf_linear import GGUFLinearMethod


class GGUFQ8LinearMethod(GGUFLinearMethod):
    """Loads int8 codes and per-block float32 scales, then lays them out as gemm_q8_f32's panels."""

    code_dtype = torch.int8
    block_params = ("scales",)

    @staticmethod
    def pack(parts: list[torch.Tensor], layout: WeightLayout | None) -> QuantizedWeight:
        return QuantizedWeight.q8(*parts, layout)


class GGUFQ6KLinearMethod(GGUFQ8LinearMethod):
    """The same for Q6_K: codes ``q - 32`` and a float32 scale per 16 inputs, in gemm_q6kc_f32's panels (or
    gemm_q6k_f32's where the scales do not factor per super-block)."""

    block = Q6K_BLOCK


class GGUFQ5KLinearMethod(GGUFQ8LinearMethod):
    """The same for Q5_K: codes ``q``, a float32 scale and zero per 32 inputs, as gemm_q5k_f32's panels."""

    block_params = ("scales", "zeros")

    @staticmethod
    def pack(parts: list[torch.Tensor], layout: WeightLayout | None) -> QuantizedWeight:
        codes, scales, zeros = parts
        return QuantizedWeight.q8(codes, scales, layout, zeros)


class GGUFQ2KLinearMethod(GGUFQ5KLinearMethod):
    """The same for Q2_K: codes ``q``, a float32 scale and zero per 16 inputs, as gemm_q2k_f32's panels."""

    block = Q6K_BLOCK
