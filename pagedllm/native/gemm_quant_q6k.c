/* gemm_quant_f32's kernels (gemm_quant.h) for GGUF Q6_K and the float32-scaled Q3_K (Q6K), and Q6_K's compact form
 * (Q6KC). */
#include "gemm_quant.h"

QUANT_KERNELS(Q6K)
QUANT_KERNELS(Q6KC)
