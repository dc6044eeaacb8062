/* The scalar exp the element-wise kernels vectorise (fused_ops.c's SiLU, gemm_bf16.c's fused SiLU * up), one
 * definition for both; native/__init__.py keys a kernel's build on the headers beside it too. */
#ifndef PAGEDLLM_EXP_POLY_H
#define PAGEDLLM_EXP_POLY_H
#include <stdint.h>
#include <string.h>

/* exp(x), ~2 ulp, for |x| < 88: 2^n * p(r) with r = x - n ln2 (the Cephes polynomial). */
static inline float exp_poly(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    const float n = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * (r * r) + (r + 1.0f);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

/* silu(g) * u, the gated MLP's activation, with exp_poly. */
static inline float silu_mul(float g, float u) { return g / (1.0f + exp_poly(-g)) * u; }
#endif
