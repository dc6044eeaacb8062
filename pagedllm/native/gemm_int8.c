/* W8A8 GEMM: y[M, N] = x[M, K] @ W^T (+ bias) with W int8 per output channel and x quantized per row (token) to int8
 * as it comes in, products summed in int32 by VNNI's vpdpbusd (on AVX-512: 64 u8 x s8 products into 16 int32 lanes
 * per instruction, twice the multiply rate of bf16 pairs), the scales applied once per output in the epilogue.
 *
 * Quantization, symmetric, with outliers kept out (as LLM.int8() keeps outlier features in float): a row's OUTLIERS
 * entries of largest |x| (the first on ties) stay float32, and the others are coded with scale sx = a / 127, codes
 * rint(x * (127 / a)) in [-127, 127], a the largest |x| among them (a of 0: scale 0, codes 0); the outliers' codes
 * are 0. A few entries of the residual stream are tens of times the rest, so a scale set by them would leave the
 * rest a handful of codes; without them it spans them all (SmolLM2's teacher-forced agreement with float32: 0.89
 * with every entry coded, 0.95-0.97 with the two largest kept out). A column's codes and scale sw come packed
 * (layers/quantization/int8.py). vpdpbusd takes unsigned activations, so a code q goes in as q + 128, and each
 * column's 128 * sum_k w[n, k] (packed beside it) comes back off the sum: acc = sum_k q[k] w[n, k] exactly
 * (|acc| < 2^31 for K < 133000). The outliers' terms t[m, n] = sum_o x[m, k_o] * w[n, k_o] (the weight's codes; a
 * multiply-add an outlier, in the order select_outliers gives them) come in as the sum is scaled:
 * y[m, n] = fma((float)acc, sx[m], t[m, n]) * sw[n] + bias[n], in that order.
 *
 * Panels: ceil(N / 16) of them, each ceil(K / 4) groups of 16 columns x 4 consecutive k (64 int8: one vector, column
 * c's four in bytes 4c..4c+3), then the 16 columns' sw (float32) and 128 * sum w (int32); K's and N's padding is zero
 * weights. The row codes are padded with zero codes to whole groups of 4.
 *
 * Two bodies, whose results are the same to the bit: AVX512-VNNI (a tile of 4 rows x 4 panels, one vector a
 * panel) and a 256-bit one (2 rows x 2 panels, two vectors a panel) for CPUs without AVX-512, with AVX-VNNI (Alder
 * Lake and later) or AVX2 alone (see there).
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

#define NR 16 /* columns per panel */
#define OUTLIERS 2 /* entries of each row kept out of its codes (layers/quantization/int8.py: OUTLIERS_PER_ROW) */

static inline int64_t panel_bytes(int K4) { return (int64_t)K4 * 64 + 2 * NR * 4; }

/* The OUTLIERS entries of the row with the largest |x| (the first of equals), largest first, into idx and val (slots
 * past K: index 0, value 0); returns the largest |x| of the other entries, which sets the row's scale. */
static float select_outliers(const float *row, int K, int32_t *idx, float *val) {
    int32_t top[OUTLIERS + 1];
    float mag[OUTLIERS + 1];
    int n = 0;
    for (int k = 0; k < K; k++) {
        const float a = fabsf(row[k]);
        if (n == OUTLIERS + 1 && !(a > mag[OUTLIERS])) continue;
        int i = n < OUTLIERS + 1 ? n++ : OUTLIERS;
        for (; i > 0 && a > mag[i - 1]; i--) {
            mag[i] = mag[i - 1];
            top[i] = top[i - 1];
        }
        mag[i] = a;
        top[i] = k;
    }
    for (int o = 0; o < OUTLIERS; o++) {
        idx[o] = o < n ? top[o] : 0;
        val[o] = o < n ? row[top[o]] : 0.0f;
    }
    return n > OUTLIERS ? mag[OUTLIERS] : 0.0f;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

enum { MR = 4, NP = 4 }; /* a tile is MR rows x NP panels (16 accumulators) */
_Static_assert(NP % 2 == 0, "a gated tile pairs gate and up panels");

#define ZERO_CODE 128 /* a code of 0 as vpdpbusd takes it */

/* Row m's codes (+128, K4 * 4 bytes) into q and its scale into sx[m], for amax its largest |x| but the outliers'
 * (theirs clamp to +-127 here; the caller sets them to ZERO_CODE). */
static void quantize_row(const float *row, int K, int K4, float amax, uint8_t *q, float *sx) {
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *sx = amax / 127.0f;
    const __m512 vinv = _mm512_set1_ps(inv);
    const __m512i lo = _mm512_set1_epi32(-127), hi = _mm512_set1_epi32(127), offset = _mm512_set1_epi32(128);
    for (int k = 0; k < K4 * 4; k += 16) {
        const int left = K - k;
        const __mmask16 valid = left >= 16 ? (__mmask16)0xFFFF : (left > 0 ? (__mmask16)((1u << left) - 1) : 0);
        __m512i codes = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(valid, row + k), vinv)); /* rint */
        codes = _mm512_add_epi32(_mm512_min_epi32(_mm512_max_epi32(codes, lo), hi), offset);
        const __mmask16 store = K4 * 4 - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (K4 * 4 - k)) - 1);
        _mm512_mask_cvtepi32_storeu_epi8(q + k, store, codes);
    }
}

/* A row's outlier terms for a panel's 16 columns: over its outliers (idx, val), val * the column's code, summed. */
static inline __m512 outlier_terms(const uint8_t *panel, const int32_t *idx, const float *val) {
    __m512 terms = _mm512_setzero_ps();
    for (int o = 0; o < OUTLIERS; o++) { /* each column's code is byte idx % 4 of its lane in group idx / 4 */
        const __m512i group = _mm512_loadu_si512(panel + (int64_t)(idx[o] >> 2) * 64);
        const __m512i codes = _mm512_srai_epi32(
            _mm512_sll_epi32(group, _mm_cvtsi32_si128(24 - 8 * (idx[o] & 3))), 24);
        terms = _mm512_fmadd_ps(_mm512_set1_ps(val[o]), _mm512_cvtepi32_ps(codes), terms);
    }
    return terms;
}

/* rows (<= MR) x np (<= NP) panels from panel p0: the int32 sums, then the epilogue into y (gated: silu of each
 * even panel's outputs times the next one's, into column 16 * p0 / 2 on). oidx / oval: the rows' outliers. */
static inline __attribute__((always_inline)) void tile(const uint8_t *q, int64_t ldq, const float *sx,
                                                       const int32_t *oidx, const float *oval,
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
            const __m512 terms = outlier_terms(panel0 + j * pb, oidx + r * OUTLIERS, oval + r * OUTLIERS);
            const __m512 out = _mm512_add_ps(_mm512_mul_ps(_mm512_fmadd_ps(sums, _mm512_set1_ps(sx[r]), terms), sw), b);
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

#define GEMM_INT8_BODY
#elif defined(__AVX2__) && defined(__FMA__)
/* The same panels and arithmetic on 256-bit vectors: a group of 4 k for 16 columns is two vectors (columns 0-7,
 * 8-15); a tile is MR rows x NP panels, 8 accumulators, within AVX2's 16 registers. With AVX-VNNI (Intel's client
 * cores from Alder Lake on, Sierra Forest) vpdpbusd sums each group as the AVX-512 body's does. With AVX2 alone
 * (AMD Zen 1-3, Intel before Alder Lake) a group's sum takes three steps, as llama.cpp's AVX2 dot products do:
 * vpmaddubsw multiplies |q| (unsigned) by w carrying q's sign (vpsignb) and adds pairs into int16 lanes (at most
 * 2 * 127 * 127 in magnitude: never saturated, so exact), vpmaddwd adds those pairs into int32. There the codes
 * go in signed: no 128 is added, and nothing is taken back off. The int32 sums are the same either way. */
#include <immintrin.h>

enum { MR = 2, NP = 2 };
_Static_assert(NP % 2 == 0, "a gated tile pairs gate and up panels");

#if defined(__AVXVNNI__)
#define CODE_OFFSET 128 /* vpdpbusd's operand is unsigned: q + 128, each column's 128 * sum w taken back off */
#else
#define CODE_OFFSET 0
#endif
#define ZERO_CODE CODE_OFFSET

/* A mask of the first n of 8 lanes (all of them for n >= 8, none for n <= 0), for maskload. */
static inline __m256i first_lanes(int n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* 8 lanes of x * inv rounded (rint) and clamped to [-127, 127], plus CODE_OFFSET. */
static inline __m256i codes8(__m256 x, __m256 inv) {
    const __m256i c = _mm256_cvtps_epi32(_mm256_mul_ps(x, inv));
    return _mm256_add_epi32(_mm256_min_epi32(_mm256_max_epi32(c, _mm256_set1_epi32(-127)), _mm256_set1_epi32(127)),
                            _mm256_set1_epi32(CODE_OFFSET));
}

/* Row m's codes (+ CODE_OFFSET, K4 * 4 bytes) into q and its scale into sx[m], as the AVX-512 body's. */
static void quantize_row(const float *row, int K, int K4, float amax, uint8_t *q, float *sx) {
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    *sx = amax / 127.0f;
    const __m256 vinv = _mm256_set1_ps(inv);
    /* 32 codes a pass: two packs interleave the four vectors by 128-bit lane, the permute puts them in order
     * (packs with unsigned saturation for codes + 128, in [1, 255]; signed for codes in [-127, 127]) */
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    for (int k = 0; k < K4 * 4; k += 32) { /* the last pass from a copy zero-padded to 32: zero codes past K */
        float padded[32];
        const float *src = row + k;
        if (K - k < 32) {
            memset(padded, 0, sizeof padded);
            if (K > k) memcpy(padded, row + k, (size_t)(K - k) * sizeof(float));
            src = padded;
        }
        const __m256i c0 = codes8(_mm256_loadu_ps(src), vinv), c1 = codes8(_mm256_loadu_ps(src + 8), vinv);
        const __m256i c2 = codes8(_mm256_loadu_ps(src + 16), vinv), c3 = codes8(_mm256_loadu_ps(src + 24), vinv);
        const __m256i packed = CODE_OFFSET
                                   ? _mm256_packus_epi16(_mm256_packus_epi32(c0, c1), _mm256_packus_epi32(c2, c3))
                                   : _mm256_packs_epi16(_mm256_packs_epi32(c0, c1), _mm256_packs_epi32(c2, c3));
        uint8_t bytes[32];
        _mm256_storeu_si256((__m256i *)bytes, _mm256_permutevar8x32_epi32(packed, order));
        memcpy(q + k, bytes, (size_t)(K4 * 4 - k < 32 ? K4 * 4 - k : 32));
    }
}

/* acc + each lane's sum of its 4 codes times the row's 4 codes (xb: those in every lane; abs_xb: their absolute
 * values, which only the AVX2 steps read). */
static inline __attribute__((always_inline)) __m256i dot4(__m256i acc, __m256i xb, __m256i abs_xb, __m256i w) {
#if defined(__AVXVNNI__)
    (void)abs_xb;
    return _mm256_dpbusd_avx_epi32(acc, xb, w);
#else
    const __m256i pairs = _mm256_maddubs_epi16(abs_xb, _mm256_sign_epi8(w, xb));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

/* A row's outlier terms for 8 columns of a panel (half: the panel's start + 32 bytes for columns 8-15), as the
 * AVX-512 body's. */
static inline __m256 outlier_terms(const uint8_t *half, const int32_t *idx, const float *val) {
    __m256 terms = _mm256_setzero_ps();
    for (int o = 0; o < OUTLIERS; o++) {
        const __m256i group = _mm256_loadu_si256((const __m256i *)(half + (int64_t)(idx[o] >> 2) * 64));
        const __m256i codes = _mm256_srai_epi32(
            _mm256_sll_epi32(group, _mm_cvtsi32_si128(24 - 8 * (idx[o] & 3))), 24);
        terms = _mm256_fmadd_ps(_mm256_set1_ps(val[o]), _mm256_cvtepi32_ps(codes), terms);
    }
    return terms;
}

/* rows (<= MR) x np (<= NP) panels from panel p0, as the AVX-512 body's tile. */
static inline __attribute__((always_inline)) void tile(const uint8_t *q, int64_t ldq, const float *sx,
                                                       const int32_t *oidx, const float *oval,
                                                       const uint8_t *packed, int K4, int p0, const float *bias,
                                                       float *y, int64_t ldy, int N, const int rows, const int np,
                                                       const int gated) {
    const int64_t pb = panel_bytes(K4);
    __m256i acc[MR][NP][2];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < np; j++) acc[r][j][0] = acc[r][j][1] = _mm256_setzero_si256();
    const uint8_t *panel0 = packed + (int64_t)p0 * pb;
    for (int k4 = 0; k4 < K4; k4++) {
        __m256i w[NP][2];
        for (int j = 0; j < np; j++)
            for (int h = 0; h < 2; h++)
                w[j][h] = _mm256_loadu_si256((const __m256i *)(panel0 + j * pb + (int64_t)k4 * 64 + 32 * h));
        for (int r = 0; r < rows; r++) {
            int32_t four;
            memcpy(&four, q + r * ldq + (int64_t)k4 * 4, sizeof four);
            const __m256i xb = _mm256_set1_epi32(four), abs_xb = _mm256_abs_epi8(xb);
            for (int j = 0; j < np; j++)
                for (int h = 0; h < 2; h++) acc[r][j][h] = dot4(acc[r][j][h], xb, abs_xb, w[j][h]);
        }
    }
    float gate[MR][NR];
    for (int j = 0; j < np; j++) {
        const uint8_t *tail = panel0 + j * pb + (int64_t)K4 * 64;
        const int col = (p0 + j) * NR, cols = N - col < NR ? N - col : NR;
        __m256 b[2];
        for (int h = 0; h < 2; h++) /* the bias of the columns that exist (lanes past them: 0) */
            b[h] = bias ? _mm256_maskload_ps(bias + col + 8 * h, first_lanes(cols - 8 * h)) : _mm256_setzero_ps();
        for (int r = 0; r < rows; r++) {
            float out[NR];
            for (int h = 0; h < 2; h++) { /* the AVX-512 body's arithmetic, in its order */
                const __m256 sw = _mm256_loadu_ps((const float *)tail + 8 * h);
                const __m256i sums = CODE_OFFSET ? _mm256_sub_epi32(acc[r][j][h], _mm256_loadu_si256(
                                                       (const __m256i *)(tail + NR * 4 + 32 * h)))
                                                 : acc[r][j][h];
                const __m256 terms = outlier_terms(panel0 + j * pb + 32 * h, oidx + r * OUTLIERS,
                                                   oval + r * OUTLIERS);
                _mm256_storeu_ps(out + 8 * h, _mm256_add_ps(
                    _mm256_mul_ps(_mm256_fmadd_ps(_mm256_cvtepi32_ps(sums), _mm256_set1_ps(sx[r]), terms), sw),
                    b[h]));
            }
            if (!gated) {
                memcpy(y + r * ldy + col, out, (size_t)cols * sizeof(float));
            } else if (j % 2 == 0) { /* a gate panel: kept until its up panel comes */
                memcpy(gate[r], out, sizeof out);
            } else {
                float *o = y + r * ldy + (p0 + j - 1) / 2 * NR;
#pragma omp simd
                for (int i = 0; i < NR; i++) o[i] = silu_mul(gate[r][i], out[i]);
            }
        }
    }
}

#define GEMM_INT8_BODY
#endif

#if defined(GEMM_INT8_BODY)
int gemm_int8_available(void) { return 1; }

static inline __attribute__((always_inline)) int gemm_w8a8(const float *x, int64_t ldx, const uint8_t *packed,
                                                           const float *bias, float *y, int64_t ldy, int M, int N,
                                                           int K, int num_threads, const int gated) {
    if (M < 0 || N <= 0 || K <= 0 || (gated && (N % (2 * NR) || bias))) return -1;
    const int K4 = (K + 3) / 4, panels = (N + NR - 1) / NR;
    const int64_t ldq = (int64_t)K4 * 4;
    uint8_t *q = malloc((size_t)M * ldq + 1);
    float *sx = malloc((size_t)M * sizeof(float) + 1), *oval = malloc((size_t)M * OUTLIERS * sizeof(float) + 1);
    int32_t *oidx = malloc((size_t)M * OUTLIERS * sizeof(int32_t) + 1);
    if (!q || !sx || !oval || !oidx) {
        free(q);
        free(sx);
        free(oval);
        free(oidx);
        return -2;
    }
#pragma omp parallel for num_threads(num_threads) schedule(static)
    for (int m = 0; m < M; m++) {
        const float *row = x + (int64_t)m * ldx;
        int32_t *idx = oidx + (int64_t)m * OUTLIERS;
        quantize_row(row, K, K4, select_outliers(row, K, idx, oval + (int64_t)m * OUTLIERS), q + m * ldq, sx + m);
        for (int o = 0; o < OUTLIERS && o < K; o++) q[m * ldq + idx[o]] = ZERO_CODE;
    }
    const int row_tiles = (M + MR - 1) / MR, panel_tiles = (panels + NP - 1) / NP;
#pragma omp parallel for collapse(2) num_threads(num_threads) schedule(static)
    for (int pt = 0; pt < panel_tiles; pt++) {
        for (int rt = 0; rt < row_tiles; rt++) {
            const int m0 = rt * MR, p0 = pt * NP;
            const int rows = M - m0 < MR ? M - m0 : MR, np = panels - p0 < NP ? panels - p0 : NP;
            const uint8_t *qt = q + m0 * ldq;
            const int32_t *it = oidx + (int64_t)m0 * OUTLIERS;
            const float *vt = oval + (int64_t)m0 * OUTLIERS;
            float *yt = y + m0 * ldy;
            if (rows == MR && np == NP)
                tile(qt, ldq, sx + m0, it, vt, packed, K4, p0, bias, yt, ldy, N, MR, NP, gated);
            else if (rows == 1 && np == NP)
                tile(qt, ldq, sx + m0, it, vt, packed, K4, p0, bias, yt, ldy, N, 1, NP, gated);
            else
                tile(qt, ldq, sx + m0, it, vt, packed, K4, p0, bias, yt, ldy, N, rows, np, gated);
        }
    }
    free(q);
    free(sx);
    free(oval);
    free(oidx);
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
