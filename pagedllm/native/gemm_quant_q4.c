/* gemm_quant_f32's kernels (gemm_quant.h) for GGUF Q4_0 and Q4_1 (format Q4) and Q4_K (Q4K, and its compact form
 * Q4KC). */
#include "gemm_quant.h"

QUANT_KERNELS(Q4)
QUANT_KERNELS(Q4K)
QUANT_KERNELS(Q4KC)
