/* gemm_quant_f32's kernels (gemm_quant.h) for GGUF Q2_K (Q2K, and its compact form Q2KC) and Q3_K's compact form
 * (Q3KC). */
#include "gemm_quant.h"

QUANT_KERNELS(Q2K)
QUANT_KERNELS(Q2KC)
QUANT_KERNELS(Q3KC)
