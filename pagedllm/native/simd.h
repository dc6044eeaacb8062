/* The exp every kernel uses, defined once: exp(x) = 2^n * p(r) with n = round(x / ln2), r = x - n ln2 (ln2 in two
 * parts so r stays exact), p(r) = 1 + r + r^2 (P5 + r (P4 + r (P3 + r (P2 + r (P1 + r P0))))) (the Cephes
 * polynomial, ~1e-7 relative error). One set of constants, one polynomial (EXP_POLY, written over the operations
 * of each width), in three widths: scalar (exp_poly, which the element-wise loops of fused_ops.c and gemm_bf16.c
 * vectorise), 16 lanes (exp16_nonpositive, AVX-512) and 8 lanes (exp8_nonpositive, AVX2 + FMA) for the attention
 * kernels' softmax. native/build.py keys every kernel's build on the headers beside it too.
 */
#ifndef PAGEDLLM_SIMD_H
#define PAGEDLLM_SIMD_H
#include <stdint.h>
#include <string.h>

#define EXP_MIN_X -87.0f /* below, exp is taken as exp(-87): 2^n stays a normal float */
#define EXP_MAX_X 88.0f  /* above, +inf (the scalar exp only; the vector ones take x <= 0) */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* p(r) into p, in the width whose multiply-add FMA(a, b, c) = a * b + c, MUL, ADD and broadcast SET1 are given. */
#define EXP_POLY(p, r, FMA, MUL, ADD, SET1)                                                                  \
    do {                                                                                                     \
        p = SET1(EXP_P0);                                                                                    \
        p = FMA(p, r, SET1(EXP_P1));                                                                         \
        p = FMA(p, r, SET1(EXP_P2));                                                                         \
        p = FMA(p, r, SET1(EXP_P3));                                                                         \
        p = FMA(p, r, SET1(EXP_P4));                                                                         \
        p = FMA(p, r, SET1(EXP_P5));                                                                         \
        p = FMA(p, MUL(r, r), ADD(r, SET1(1.0f)));                                                           \
    } while (0)

#define SCALAR_FMA(a, b, c) ((a) * (b) + (c))
#define SCALAR_MUL(a, b) ((a) * (b))
#define SCALAR_ADD(a, b) ((a) + (b))
#define SCALAR_SET1(x) (x)

/* exp(x), ~2 ulp, for |x| < 88 (computed on x clamped to [EXP_MIN_X, EXP_MAX_X]); +inf above EXP_MAX_X, where
 * float32's exp overflows (from 88.72) or nearly: so silu and GeGLU of a gate below -88 are -0 (and of -inf, or
 * times an infinite up, NaN), as torch's, not the gate times exp(-88). */
static inline float exp_poly(float x) {
    const float c = x < EXP_MIN_X ? EXP_MIN_X : (x > EXP_MAX_X ? EXP_MAX_X : x);
    const float n = __builtin_rintf(c * EXP_LOG2E);
    float r = c - n * EXP_LN2_HI;
    r = r - n * EXP_LN2_LO;
    float p;
    EXP_POLY(p, r, SCALAR_FMA, SCALAR_MUL, SCALAR_ADD, SCALAR_SET1);
    const int32_t bits = ((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return x > EXP_MAX_X ? __builtin_inff() : p * scale;
}

/* silu(g) * u, the gated MLP's activation, with exp_poly. */
static inline float silu_mul(float g, float u) { return g / (1.0f + exp_poly(-g)) * u; }

/* gelu_tanh(g) * u (GeGLU, torch's gelu(approximate="tanh")): 0.5 g (1 + tanh(y)) = g / (1 + exp(-2y)) with
 * y = sqrt(2 / pi) (g + 0.044715 g^3). */
static inline float gelu_tanh_mul(float g, float u) {
    const float y2 = 1.5957691216057308f * (g + 0.044715f * g * g * g); /* 2y */
    return g / (1.0f + exp_poly(-y2)) * u;
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

#if defined(__AVX512F__)
/* exp(x) for x <= 0 (scores minus their running max); 2^n by scalef. A NaN x gives a NaN, as torch's exp: max_ps
 * returns its second operand where either is a NaN, so the clamp keeps it (and a score that is no number reaches the
 * attention's output, not a weight of exp(-87)). */
static inline __m512 exp16_nonpositive(__m512 x) {
    x = _mm512_max_ps(_mm512_set1_ps(EXP_MIN_X), x);
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p;
    EXP_POLY(p, r, _mm512_fmadd_ps, _mm512_mul_ps, _mm512_add_ps, _mm512_set1_ps);
    return _mm512_scalef_ps(p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
/* exp(x) for x <= 0, as exp16_nonpositive (a NaN x gives a NaN); 2^n put in the exponent bits (n >= -126 after the
 * clamp). */
static inline __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(EXP_MIN_X), x);
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p;
    EXP_POLY(p, r, _mm256_fmadd_ps, _mm256_mul_ps, _mm256_add_ps, _mm256_set1_ps);
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
#endif
#endif
