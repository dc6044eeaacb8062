/* What the float32 GEMM (gemm.c) and the quantized kernels (gemm_quant.h) share: the panels' sizes, the dispatch of a
 * tile's rows, the tiles' epilogues, and panel_rows, the dense tiles over one panel (gemm.c), which the quantized
 * items of many rows run over their panel dequantized. */
#ifndef GEMM_H
#define GEMM_H

#include <stdint.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define NR 64 /* output columns per panel */
#define MR 6  /* rows per register tile */

/* CALL(rows) for a tile of min(left, MR) rows, rows a constant, so that the tile's loops unroll for it. */
#define WITH_TILE_ROWS(left, CALL)                                                                          \
    switch ((left) < MR ? (left) : MR) {                                                                    \
    case 6: CALL(6); break;                                                                                 \
    case 5: CALL(5); break;                                                                                 \
    case 4: CALL(4); break;                                                                                 \
    case 3: CALL(3); break;                                                                                 \
    case 2: CALL(2); break;                                                                                 \
    case 1: CALL(1); break;                                                                                 \
    }

/* A function one of the library's files defines for another: hidden, so that the library exports only its API. */
#define INTERNAL __attribute__((visibility("hidden")))

#if defined(__AVX512F__)
#include <immintrin.h>

#define ALL_VECTORS 0xFu /* a panel's four vectors of 16 columns */

/* y[0:64] = one row's 4 accumulators (+ bias), those of the vectors in the bit set `vectors` (a constant; vector j:
 * columns 16j .. 16j + 15) under the panel's column masks (column_masks); the tiles' epilogue. */
static inline __attribute__((always_inline)) void store_vectors(const __m512 c[4], const float *bias, float *y,
                                                                const __mmask16 masks[4], const unsigned vectors) {
    for (int j = 0; j < 4; j++) {
        if (!(vectors >> j & 1u)) continue;
        __m512 v = c[j];
        if (bias != NULL) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(masks[j], bias + 16 * j));
        _mm512_mask_storeu_ps(y + 16 * j, masks[j], v);
    }
}

/* Store masks for a panel's last `cols` columns (64 for a full panel). */
static inline void column_masks(int cols, __mmask16 masks[4]) {
    for (int j = 0; j < 4; j++) {
        const int n = cols - 16 * j;
        masks[j] = n >= 16 ? (__mmask16)0xFFFF : (n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u));
    }
}

#elif defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

/* y[0:cols] = one row's 8 accumulators (64 columns) + bias, those of the vectors in the bit set `vectors` (vector j:
 * columns 8j .. 8j + 7); the row kernels' (dense and quantized) epilogue. */
#define ALL_VECTORS 0xFFu
static inline void store_row(const __m256 c[NR / 8], const float *bias, float *y, int cols, unsigned vectors) {
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int j = 0; j < NR / 8; j++) {
        if (!(vectors >> j & 1u)) continue;
        const __m256i m = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8 * j), lane);
        const __m256 b = bias != NULL ? _mm256_maskload_ps(bias + 8 * j, m) : _mm256_setzero_ps();
        _mm256_maskstore_ps(y + 8 * j, m, _mm256_add_ps(c[j], b));
    }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* rows row_begin .. row_end of x (ldx apart) times one dense panel ([K][64], its first `cols` columns stored: y rows
 * ldy apart, + bias where not NULL); next_panel, this thread's next panel or NULL, is fetched into L2 meanwhile. */
INTERNAL void panel_rows(const float *x, int64_t ldx, const float *panel, const float *bias, float *y, int64_t ldy,
                         int K, int row_begin, int row_end, int cols, const float *next_panel);
#endif

#endif
