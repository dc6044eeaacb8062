/* float32 GEMM against weights packed once into column panels: y[M, N] = x[M, K] @ W^T (+ bias).
 *
 * Why not MKL: sgemm repacks the weight matrix on every call, which at decode sizes (8-64 rows) costs about
 * as much as the multiply itself; MKL's own packed API fixes that only for the one row count it packed for.
 * Here the packing is done once at load (panels of 64 output columns, [K][64] each, zero-padded past N) and
 * serves every row count: a 6 x 64 register tile (24 accumulators) walks K with four panel loads and six
 * broadcasts per step, the panel staying in L2 while the row tiles go by. The first tile over a panel reads it
 * from memory and prefetches PREFETCH_ROWS rows (4 KB) ahead: the hardware prefetchers stop at page boundaries,
 * and with a single row (one-sequence decode) the kernel is otherwise latency-bound (~16 vs ~20 GB/s).
 *
 * Work items are (panel, block of rows), panel-major, split statically over torch's OpenMP threads.
 * Needs AVX-512F: gemm_available() says whether this build has it; without it callers use torch.
 */
#include <stdint.h>

#define NR 64 /* output columns per panel */
#define MR 6  /* rows per register tile */
#define PREFETCH_ROWS 16

#if defined(__AVX512F__)
#include <immintrin.h>

/* rows x 64 tile (rows <= MR, a constant after inlining): y[r][0:cols] = x[r] . panel (+ bias). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *panel,
                                                       const float *bias, float *y, int64_t ldy, int K,
                                                       const int rows, __mmask16 masks[4], int prefetch) {
    __m512 c[MR][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        const float *wk = panel + (int64_t)k * NR;
        if (prefetch)
            for (int j = 0; j < 4; j++) _mm_prefetch((const char *)(wk + PREFETCH_ROWS * NR + 16 * j), _MM_HINT_T0);
        const __m512 w0 = _mm512_loadu_ps(wk), w1 = _mm512_loadu_ps(wk + 16), w2 = _mm512_loadu_ps(wk + 32),
                     w3 = _mm512_loadu_ps(wk + 48);
        for (int r = 0; r < rows; r++) {
            const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
            c[r][0] = _mm512_fmadd_ps(b, w0, c[r][0]);
            c[r][1] = _mm512_fmadd_ps(b, w1, c[r][1]);
            c[r][2] = _mm512_fmadd_ps(b, w2, c[r][2]);
            c[r][3] = _mm512_fmadd_ps(b, w3, c[r][3]);
        }
    }
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) {
            __m512 v = c[r][j];
            if (bias != NULL) v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(masks[j], bias + 16 * j));
            _mm512_mask_storeu_ps(y + r * ldy + 16 * j, masks[j], v);
        }
}

static void panel_rows(const float *x, int64_t ldx, const float *panel, const float *bias, float *y, int64_t ldy,
                       int K, int row_begin, int row_end, int cols) {
    __mmask16 masks[4];
    for (int j = 0; j < 4; j++) {
        const int n = cols - 16 * j;
        masks[j] = n >= 16 ? (__mmask16)0xFFFF : (n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1u));
    }
    int r = row_begin, prefetch = 1;
    for (; r + MR <= row_end; r += MR) {
        tile(x + r * ldx, ldx, panel, bias, y + r * ldy, ldy, K, MR, masks, prefetch);
        prefetch = 0;
    }
    switch (row_end - r) {
    case 5: tile(x + r * ldx, ldx, panel, bias, y + r * ldy, ldy, K, 5, masks, prefetch); break;
    case 4: tile(x + r * ldx, ldx, panel, bias, y + r * ldy, ldy, K, 4, masks, prefetch); break;
    case 3: tile(x + r * ldx, ldx, panel, bias, y + r * ldy, ldy, K, 3, masks, prefetch); break;
    case 2: tile(x + r * ldx, ldx, panel, bias, y + r * ldy, ldy, K, 2, masks, prefetch); break;
    case 1: tile(x + r * ldx, ldx, panel, bias, y + r * ldy, ldy, K, 1, masks, prefetch); break;
    }
}

int gemm_available(void) { return 1; }

/* x: [M, K] rows ldx apart; packed: [ceil(N / 64), K, 64]; bias: [N] or NULL; y: [M, N] rows ldy apart. */
int gemm_packed_f32(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                    int M, int N, int K, int num_threads) {
    const int panels = (N + NR - 1) / NR;
    /* Rows per item: whole tiles, at most 192 and x's block no larger than 256 KB (it stays in L2 next to
     * the panel), fewer when there are too few panels to give every thread several items. */
    int block = 192;
    while (block > MR && (int64_t)block * K * sizeof(float) > 256 * 1024) block -= MR;
    while (block > MR && (int64_t)panels * ((M + block - 1) / block) < 8 * num_threads) block -= 2 * MR;
    if (block < MR) block = MR;
    const int row_blocks = (M + block - 1) / block;
    const int items = panels * row_blocks;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int item = 0; item < items; item++) {
        const int p = item / row_blocks, rb = item % row_blocks;
        const int row_end = (rb + 1) * block < M ? (rb + 1) * block : M;
        const int cols = N - p * NR < NR ? N - p * NR : NR;
        panel_rows(x, ldx, packed + (int64_t)p * K * NR, bias == NULL ? NULL : bias + p * NR, y + p * NR, ldy, K,
                   rb * block, row_end, cols);
    }
    return 0;
}
#else
int gemm_available(void) { return 0; }

int gemm_packed_f32(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                    int M, int N, int K, int num_threads) {
    return -1;
}
#endif
