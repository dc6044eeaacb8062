/* gemm_quant_f32's kernels (gemm_quant.h) for GGUF Q5_K (Q5K, and its compact form Q5KC). */
#include "gemm_quant.h"

QUANT_KERNELS(Q5K)
QUANT_KERNELS(Q5KC)
