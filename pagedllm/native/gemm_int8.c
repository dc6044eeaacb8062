/* W8A8 GEMM: y[M, N] = x[M, K] @ W^T (+ bias) with W int8 per output channel and x quantized per row (token) to int8
 * as it comes in, products summed in int32 by AVX512-VNNI (vpdpbusd: 64 u8 x s8 products into 16 int32 lanes per
 * instruction, twice the multiply rate of bf16 pairs), the scales applied once per output in the epilogue.
 *
 * Quantization, symmetric: a row's scale is sx = max|x| / 127 and its codes rint(x * (127 / max|x|)) in [-127, 127]
 * (a row of zeros: scale 0, codes 0); a column's codes and scale sw come packed (layers/quantization/int8.py). vpdpbusd
 * takes unsigned activations, so a code q goes in as q + 128, and each column's 128 * sum_k w[n, k] (packed beside it)
 * comes back off the sum: acc = sum_k q[k] w[n, k] exactly (|acc| < 2^31 for K < 133000). Then
 * y[m, n] = (float)acc * sx[m] * sw[n] + bias[n], in that order.
 *
 * Panels: ceil(N / 16) of them, each ceil(K / 4) groups of 16 columns x 4 consecutive k (64 int8: one vector, column
 * c's four in bytes 4c..4c+3), then the 16 columns' sw (float32) and 128 * sum w (int32); K's and N's padding is zero
 * weights. The row codes are padded with zero codes to whole groups of 4.
 *
 * gemm_w8a8_silu_mul_f32 is the gated MLP's gate_up projection with its activation fused in: its panels alternate
 * gate and up 16 columns at a time (gate columns 16q.., then up columns 16q..), N = 2 * d with d a multiple of 16, no
 * bias, and y [M, d] = silu(gate) * up, so the projection's full output is never written.
 */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "simd.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

enum { NR = 16, MR = 4, NP = 4 }; /* columns per panel; a tile is MR rows x NP panels (16 accumulators) */

int gemm_int8_available(void) { return 1; }

static inline int64_t panel_bytes(int K4) { return (int64_t)K4 * 64 + 2 * NR * 4; }

/* Row m's codes (+128, K4 * 4 bytes) into q and its scale into sx[m]. */
static void quantize_row(const float *row, int K, int K4, uint8_t *q, float *sx) {
    __m512 vmax = _mm512_setzero_ps();
    int k = 0;
    for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(row + k)));
    if (k < K) {
        const __mmask16 tail = (__mmask16)((1u << (K - k)) - 1);
        vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_maskz_loadu_ps(tail, row + k)));
    }
    const float amax = _mm512_reduce_max_ps(vmax);
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *sx = amax / 127.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), offset = _mm512_set1_epi32(128);
    for (k = 0; k < K4 * 4; k += 16) {
        const int left = K - k;
        const __mmask16 valid = left >= 16 ? (__mmask16)0xFFFF : (left > 0 ? (__mmask16)((1u << left) - 1) : 0);
        __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(valid, row + k), vinv)); /* rint */
        codes = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(codes, lo), hi), offset);
        const __mmask16 store = K4 * 4 - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K4 * 4 - k)) - 1);
        _mm512_mask_cvtepi32_storeu_epi8(q + k, store, codes);
    }
}

/* rows (<= MR) x np (<= NP) panels from panel p0: the int32 sums, then the epilogue into y (gated: silu of each
 * even panel's outputs times the next one's, into column 16 * p0 / 2 on). */
static inline __attribute__((always_inline)) void tile(const uint8_t *q, int64_t ldq, const float *sx,
                                                       const uint8_t *packed, int K4, int p0, const float *bias,
                                                       float *y, int64_t ldy, int N, const int rows, const int np,
                                                       const int gated) {
    const int64_t pb = panel_bytes(K4);
    __m512i acc[MR][NP];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < np; j++) acc[r][j] = _mm512_setzero_si512();
    const uint8_t *panel0 = packed + (int64_t)p0 * pb;
    for (int k4 = 0; k4 < K4; k4++) {
        __m512i w[NP];
        for (int j = 0; j < np; j++) w[j] = _mm512_loadu_si512(panel0 + j * pb + (int64_t)k4 * 64);
        for (int r = 0; r < rows; r++) {
            int32_t four; /* the row's 4 codes of this group, broadcast to every column */
            memcpy(&four, q + r * ldq + (int64_t)k4 * 4, sizeof four);
            const __m512i xb = _mm512_set1_epi32(four);
            for (int j = 0; j < np; j++) acc[r][j] = _mm512_dpbusd_epi32(acc[r][j], xb, w[j]);
        }
    }
    float gate[NR];
    for (int j = 0; j < np; j++) {
        const uint8_t *tail = panel0 + j * pb + (int64_t)K4 * 64;
        const __m512 sw = _mm512_loadu_ps((const float *)tail);
        const __m512i comp = _mm512_loadu_si512(tail + NR * 4);
        const int col = (p0 + j) * NR, cols = N - col < NR ? N - col : NR;
        const __mmask16 mask = (__mmask16)((1u << cols) - 1);
        const __m512 b = bias ? _mm512_maskz_loadu_ps(mask, bias + col) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], comp));
            const __m512 out = _mm512_add_ps(_mm512_mul_ps(_mm512_mul_ps(sums, _mm512_set1_ps(sx[r])), sw), b);
            if (!gated) {
                _mm512_mask_storeu_ps(y + r * ldy + col, mask, out);
            } else if (j % 2 == 0) { /* a gate panel: kept in acc's place until its up panel comes */
                acc[r][j] = _mm512_castps_si512(out);
            } else {
                float up[NR], *o = y + r * ldy + (p0 + j - 1) / 2 * NR;
                _mm512_storeu_ps(gate, _mm512_castsi512_ps(acc[r][j - 1]));
                _mm512_storeu_ps(up, out);
#pragma omp simd
                for (int i = 0; i < NR; i++) o[i] = silu_mul(gate[i], up[i]);
            }
        }
    }
}

static inline __attribute__((always_inline)) int gemm_w8a8(const float *x, int64_t ldx, const uint8_t *packed,
                                                           const float *bias, float *y, int64_t ldy, int M, int N,
                                                           int K, int num_threads, const int gated) {
    if (M < 0 || N <= 0 || K <= 0 || (gated && (N % (2 * NR) || bias))) return -1;
    const int K4 = (K + 3) / 4, panels = (N + NR - 1) / NR;
    const int64_t ldq = (int64_t)K4 * 4;
    uint8_t *q = malloc((size_t)M * ldq + 1);
    float *sx = malloc((size_t)M * sizeof(float) + 1);
    if (!q || !sx) {
        free(q);
        free(sx);
        return -2;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int m = 0; m < M; m++) quantize_row(x + (int64_t)m * ldx, K, K4, q + m * ldq, sx + m);
    const int row_tiles = (M + MR - 1) / MR, panel_tiles = (panels + NP - 1) / NP;
#pragma omp parallel for collapse(2) num_threads(num_threads) schedule(static)
    for (int pt = 0; pt < panel_tiles; pt++) {
        for (int rt = 0; rt < row_tiles; rt++) {
            const int m0 = rt * MR, p0 = pt * NP;
            const int rows = M - m0 < MR ? M - m0 : MR, np = panels - p0 < NP ? panels - p0 : NP;
            const uint8_t *qt = q + m0 * ldq;
            float *yt = y + m0 * ldy;
            if (rows == MR && np == NP)
                tile(qt, ldq, sx + m0, packed, K4, p0, bias, yt, ldy, N, MR, NP, gated);
            else if (rows == 1 && np == NP)
                tile(qt, ldq, sx + m0, packed, K4, p0, bias, yt, ldy, N, 1, NP, gated);
            else
                tile(qt, ldq, sx + m0, packed, K4, p0, bias, yt, ldy, N, rows, np, gated);
        }
    }
    free(q);
    free(sx);
    return 0;
}

int gemm_w8a8_f32(const float *x, int64_t ldx, const uint8_t *packed, const float *bias, float *y, int64_t ldy,
                  int M, int N, int K, int num_threads) {
    return gemm_w8a8(x, ldx, packed, bias, y, ldy, M, N, K, num_threads, 0);
}

int gemm_w8a8_silu_mul_f32(const float *x, int64_t ldx, const uint8_t *packed, const float *bias, float *y,
                           int64_t ldy, int M, int N, int K, int num_threads) {
    return gemm_w8a8(x, ldx, packed, bias, y, ldy, M, N, K, num_threads, 1);
}
#else
int gemm_int8_available(void) { return 0; }

int gemm_w8a8_f32(const float *x, int64_t ldx, const uint8_t *packed, const float *bias, float *y, int64_t ldy,
                  int M, int N, int K, int num_threads) {
    return -3;
}

int gemm_w8a8_silu_mul_f32(const float *x, int64_t ldx, const uint8_t *packed, const float *bias, float *y,
                           int64_t ldy, int M, int N, int K, int num_threads) {
    return -3;
}
#endif
