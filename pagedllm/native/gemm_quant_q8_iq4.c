/* gemm_quant_f32's kernels (gemm_quant.h) for GGUF Q8_0 (Q8), IQ4_NL (IQ4NL) and IQ4_XS (IQ4XS). */
#include "gemm_quant.h"

QUANT_KERNELS(Q8)
QUANT_KERNELS(IQ4NL)
QUANT_KERNELS(IQ4XS)
