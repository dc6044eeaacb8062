/* float32 GEMM against weights packed once into column panels: y[M, N] = x[M, K] @ W^T (+ bias).
 *
 * Why not MKL: sgemm repacks the weight matrix on every call, which at decode sizes (8-64 rows) costs about
 * as much as the multiply itself; MKL's own packed API fixes that only for the one row count it packed for.
 * Here the packing is done once at load (panels of 64 output columns, [K][64] each, zero-padded past N) and
 * serves every row count: a 6 x 64 register tile (24 accumulators) walks K with four panel loads and six
 * broadcasts per step, the panel staying in L2 while the row tiles go by. The first tile over a panel reads it
 * from memory and prefetches PREFETCH_ROWS rows (4 KB) ahead: the hardware prefetchers stop at page boundaries,
 * and with a single row (one-sequence decode) the kernel is otherwise latency-bound, streaming the weights below
 * the memory's bandwidth.
 *
 * Work items are (panel, block of rows), panel-major, split statically over torch's OpenMP threads; a thread's
 * later tiles over a panel fetch its next panel into L2 (panel_rows).
 *
 * gemm_quant_f32 does the same against GGUF weights kept quantized, in one of the formats of gemm_quant.h (its last
 * argument): Q4_0/Q4_1 (0.69 bytes per weight instead of 4: single-row decode reads weights and little else), Q4_K
 * (0.59 in its compact form, Q4KC; 0.75 with float32 scales), IQ4_NL / IQ4_XS (0.56 / 0.63: 4-bit indices of 16 fixed
 * values), Q8_0 (1.06), Q6_K (0.83 in its compact form, Q6KC, bit-packed codes; 1.25: int8 codes, a float32
 * scale per 16), Q3_K (0.45 compact, Q3KC; 1.25 as Q6_K's), Q5_K (0.72 compact; 1.25: int8 codes, a float32 scale
 * and zero per 32) and Q2_K (0.34; 1.5, the same per 16).
 * Their panels hold, per block of 32 (Q6_K: 16) along K, the 64 columns' scales (and zeros) and a row of codes per k;
 * weights are dequantized with the loader's roundings, so results equal the dense kernel's on the dequantized
 * weights bit for bit. A tile of up to MR rows dequantizes as it goes, as do tiles of 7 to 10 rows over half a
 * panel each (quant_halves); more rows dequantize the panel once into a scratch panel and run the dense tiles
 * over it.
 *
 * With AVX2 and FMA but no AVX-512 (most laptop CPUs), the dense kernel walks each panel in four strips of 16
 * columns, a 6 x 16 tile (12 accumulators of 8 floats) at a time, and fetches a thread's next panel into L2
 * while it multiplies the present one from cache. Its quantized kernels (which also need F16C, as
 * every AVX2 CPU has, for the fp16 scales) take one row against the codes with the whole panel in 8
 * accumulators, 2 to 6 rows by pairs of vectors (2 x rows accumulators, four passes a panel); items of more rows
 * dequantize their panel once and run the dense tiles over it.
 *
 * With either body, a single row (dense or quantized) is split between the threads by half panels (half_run), so
 * that an odd number of panels is shared evenly. A bfloat16 model's rows (the format flag BF16_MODEL), which need not
 * equal the dense kernel's bits, take block sums instead, up to 4 of them, where the AVX-512 body has VBMI
 * (tile_quant_sums): each block's codes summed against x before their scale, fewer vector ops a weight.
 * gemm_available() and gemm_quant_available() say what this build has; without it callers use torch.
 *
 * The files: gemm.h holds what the dense and the quantized kernels share, gemm_quant.h the quantized kernels, generic
 * in the format; each format's are instantiated in one of the gemm_quant_*.c files (a few formats each, so that
 * they compile in parallel), this file holds the dense kernels and the entry points, which call a format's by its
 * number.
 */
#include "gemm.h"
#include "gemm_quant.h"

#define PREFETCH_ROWS 16

#if defined(__AVX512F__)
/* rows x 64 tile (rows <= MR, a constant after inlining): y[r][0:cols] = x[r] . panel (+ bias), for the vectors in
 * the bit set `vectors` (a constant; vector j: columns 16j .. 16j + 15). */
static inline __attribute__((always_inline)) void tile(const float *x, int64_t ldx, const float *panel,
                                                       const float *bias, float *y, int64_t ldy, int K,
                                                       const int rows, __mmask16 masks[4], int prefetch,
                                                       const char *ahead, int ahead_lines, const unsigned vectors) {
    __m512 c[MR][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm512_setzero_ps();
    for (int k = 0; k < K; k++) {
        const float *wk = panel + (int64_t)k * NR;
        for (int j = 0; j < 4; j++)
            if (prefetch && vectors >> j & 1u)
                _mm_prefetch((const char *)(wk + PREFETCH_ROWS * NR + 16 * j), _MM_HINT_T0);
        for (int l = 0; l < ahead_lines; l++) _mm_prefetch(ahead + ((int64_t)k * ahead_lines + l) * 64, _MM_HINT_T1);
        __m512 w[4];
        for (int j = 0; j < 4; j++) w[j] = vectors >> j & 1u ? _mm512_loadu_ps(wk + 16 * j) : _mm512_setzero_ps();
        for (int r = 0; r < rows; r++) {
            const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
            for (int j = 0; j < 4; j++)
                if (vectors >> j & 1u) c[r][j] = _mm512_fmadd_ps(b, w[j], c[r][j]);
        }
    }
    for (int r = 0; r < rows; r++) store_vectors(c[r], bias, y + r * ldy, masks, vectors);
}

/* next_panel: the next panel this thread multiplies, or NULL. With three tiles or more, the tiles after
 * the first fetch it into L2, each a share of its lines spread over its steps, so that memory streams the next
 * panel while this one is multiplied from cache (without it the first tile over each panel waits on memory and
 * the later ones run from L2 with the memory idle). Smaller items leave it to the next item's first tile, which
 * reads its panel as it goes. */
void panel_rows(const float *x, int64_t ldx, const float *panel, const float *bias, float *y, int64_t ldy,
                int K, int row_begin, int row_end, int cols, const float *next_panel) {
    __mmask16 masks[4];
    column_masks(cols, masks);
    const int tiles = (row_end - row_begin + MR - 1) / MR, row_lines = NR * (int)sizeof(float) / 64;
    const int per_k = next_panel != NULL && tiles > 2 ? (row_lines + tiles - 2) / (tiles - 1) : 0;
    int r = row_begin, t = 0;
    for (; r < row_end; r += MR, t++) {
        const int64_t first_line = (int64_t)(t - 1) * K * per_k;
        const int fetch = t > 0 && first_line < (int64_t)K * row_lines ? per_k : 0;
        const char *ahead = fetch ? (const char *)next_panel + first_line * 64 : NULL;
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
#define DENSE_TILE(rows) tile(xr, ldx, panel, bias, yr, ldy, K, rows, masks, t == 0, ahead, fetch, ALL_VECTORS)
        WITH_TILE_ROWS(row_end - r, DENSE_TILE)
#undef DENSE_TILE
    }
}

/* One row against the panel's columns 32 half .. 32 half + 31 (`half` 0 or 1, a constant), as a single row's
 * threads split a panel (half_run); -1: all of them. */
static inline __attribute__((always_inline)) void row_tile(const float *x, const float *panel, const float *bias,
                                                           float *y, int K, int cols, const int half) {
    __mmask16 masks[4];
    column_masks(cols, masks);
    tile(x, 0, panel, bias, y, 0, K, 1, masks, 1, NULL, 0, half < 0 ? ALL_VECTORS : 0x3u << (2 * half));
}

#elif defined(__AVX2__) && defined(__FMA__)
/* rows x 16 strip of a panel (rows <= MR): y[r][0:cols] = x[r] . strip (+ bias), cols <= 16. */
static inline __attribute__((always_inline)) void strip_tile(const float *x, int64_t ldx, const float *strip,
                                                             const float *bias, float *y, int64_t ldy, int K,
                                                             const int rows, int cols, int prefetch,
                                                             const char *ahead, int ahead_lines) {
    __m256 c[MR][2];
    for (int r = 0; r < rows; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        const float *wk = strip + (int64_t)k * NR;
        if (prefetch) _mm_prefetch((const char *)(wk + PREFETCH_ROWS * NR), _MM_HINT_T0);
        for (int l = 0; l < ahead_lines; l++) _mm_prefetch(ahead + ((int64_t)k * ahead_lines + l) * 64, _MM_HINT_T1);
        const __m256 w0 = _mm256_loadu_ps(wk), w1 = _mm256_loadu_ps(wk + 8);
        for (int r = 0; r < rows; r++) {
            const __m256 b = _mm256_broadcast_ss(x + r * ldx + k);
            c[r][0] = _mm256_fmadd_ps(b, w0, c[r][0]);
            c[r][1] = _mm256_fmadd_ps(b, w1, c[r][1]);
        }
    }
    const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    const __m256i m0 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols), lane);
    const __m256i m1 = _mm256_cmpgt_epi32(_mm256_set1_epi32(cols - 8), lane);
    const __m256 b0 = bias != NULL ? _mm256_maskload_ps(bias, m0) : _mm256_setzero_ps();
    const __m256 b1 = bias != NULL ? _mm256_maskload_ps(bias + 8, m1) : _mm256_setzero_ps();
    for (int r = 0; r < rows; r++) {
        _mm256_maskstore_ps(y + r * ldy, m0, _mm256_add_ps(c[r][0], b0));
        _mm256_maskstore_ps(y + r * ldy + 8, m1, _mm256_add_ps(c[r][1], b1));
    }
}

/* One row against the whole panel (8 accumulators): single-row decode reads each weight once, so the panel is
 * streamed in one pass with all its lines fetched ahead, not four strip passes. `half` 0 or 1 (a constant): only
 * columns 32 half .. 32 half + 31, as a single row's threads split a panel (half_run); -1: all of them. */
static inline __attribute__((always_inline)) void row_tile(const float *x, const float *panel, const float *bias,
                                                           float *y, int K, int cols, const int half) {
    __m256 c[NR / 8];
    const int j_begin = half == 1 ? 4 : 0, j_end = half == 0 ? 4 : 8;
    for (int j = 0; j < NR / 8; j++) c[j] = _mm256_setzero_ps();
    for (int k = 0; k < K; k++) {
        const float *wk = panel + (int64_t)k * NR;
        for (int line = 8 * j_begin; line < 8 * j_end; line += 16)
            _mm_prefetch((const char *)(wk + PREFETCH_ROWS * NR + line), _MM_HINT_T0);
        const __m256 b = _mm256_broadcast_ss(x + k);
        for (int j = j_begin; j < j_end; j++) c[j] = _mm256_fmadd_ps(b, _mm256_loadu_ps(wk + 8 * j), c[j]);
    }
    store_row(c, bias, y, cols, half < 0 ? ALL_VECTORS : 0x0Fu << (4 * half));
}

/* This core's L2 in bytes (sysconf's; 256 KB where it gives none), read once as the library loads. */
static long l2_bytes = 256 * 1024;
__attribute__((constructor)) static void read_l2_bytes(void) {
    const long size = sysconf(_SC_LEVEL2_CACHE_SIZE);
    if (size > 0) l2_bytes = size;
}

/* Whether two panels of K rows fit in three quarters of L2, so that fetching the next one does not evict the one
 * being multiplied. */
static int two_panels_fit_l2(int K) { return 2 * (int64_t)K * NR * (int64_t)sizeof(float) <= l2_bytes / 4 * 3; }

/* As the AVX-512 panel_rows, strip by strip under each tile of rows (its rows of x stay in L1); the first tile
 * over the panel prefetches it. next_panel (this thread's next, or NULL) is fetched into L2 by the passes (a tile
 * over a strip) after the first tile's, a share of its lines each, spread over the pass's steps: memory streams
 * it while this panel is multiplied from cache. An item of a single tile (up to MR rows) fetches it in all its
 * passes, its own panel having been fetched by the item before. */
void panel_rows(const float *x, int64_t ldx, const float *panel, const float *bias, float *y, int64_t ldy,
                int K, int row_begin, int row_end, int cols, const float *next_panel) {
    if (row_end - row_begin == 1) {
        row_tile(x + row_begin * ldx, panel, bias, y + row_begin * ldy, K, cols, -1);
        return;
    }
    const int strips = (cols + 15) / 16, tiles = (row_end - row_begin + MR - 1) / MR;
    const int fetching_from = tiles == 1 ? 0 : strips, row_lines = NR * (int)sizeof(float) / 64;
    const int fetching = tiles * strips - fetching_from; /* passes that fetch */
    const int per_k = next_panel != NULL && fetching > 0 && two_panels_fit_l2(K)
                          ? (row_lines + fetching - 1) / fetching : 0;
    int pass = 0;
    for (int r = row_begin; r < row_end; r += MR) {
        const float *xr = x + r * ldx;
        for (int s = 0; s < strips; s++, pass++) {
            const float *strip = panel + 16 * s, *b = bias == NULL ? NULL : bias + 16 * s;
            float *yr = y + r * ldy + 16 * s;
            const int strip_cols = cols - 16 * s < 16 ? cols - 16 * s : 16, first = r == row_begin;
            const int64_t first_line = (int64_t)(pass - fetching_from) * K * per_k;
            const int fetch = pass >= fetching_from && first_line < (int64_t)K * row_lines ? per_k : 0;
            const char *ahead = fetch ? (const char *)next_panel + first_line * 64 : NULL;
            /* two instances: a literal 0 lines drops the fetch loop from the steps of the passes without one */
#define STRIP_TILE(rows) strip_tile(xr, ldx, strip, b, yr, ldy, K, rows, strip_cols, first, NULL, 0)
#define STRIP_TILE_FETCHING(rows) strip_tile(xr, ldx, strip, b, yr, ldy, K, rows, strip_cols, first, ahead, fetch)
            if (fetch) {
                WITH_TILE_ROWS(row_end - r, STRIP_TILE_FETCHING)
            } else {
                WITH_TILE_ROWS(row_end - r, STRIP_TILE)
            }
#undef STRIP_TILE_FETCHING
#undef STRIP_TILE
        }
    }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
int gemm_available(void) { return 1; }

/* A single row's share of the panels for one of `threads` threads: a contiguous run of half panels, so that an odd
 * number of panels (SmolLM2's 576 and 960 columns: 9 and 15) is split evenly, where by whole panels one thread would
 * have one more than the other and the other would wait for it at the end. half_run_next gives the run's panels in
 * turn: whole ones (half -1), and a half (0 or 1) where the run starts or ends mid-panel. */
typedef struct {
    int h, last;
} HalfRun;

static inline HalfRun half_run(int panels, int thread, int threads) {
    const HalfRun run = {(int)((int64_t)2 * panels * thread / threads),
                         (int)((int64_t)2 * panels * (thread + 1) / threads)};
    return run;
}

static inline int half_run_next(HalfRun *run, int *panel, int *half) {
    if (run->h >= run->last) return 0;
    *panel = run->h / 2;
    *half = run->h % 2 == 0 && run->h + 2 <= run->last ? -1 : run->h % 2;
    run->h += *half < 0 ? 2 : 1;
    return 1;
}

/* y[0:N] = x . W (+ bias) for one row, the threads splitting the panels by halves (half_run). */
static void dense_row_halves(const float *x, const float *packed, const float *bias, float *y, int N, int K,
                             int num_threads) {
#pragma omp parallel num_threads(num_threads)
    {
        HalfRun run = half_run((N + NR - 1) / NR, omp_get_thread_num(), omp_get_num_threads());
        int p, half;
        while (half_run_next(&run, &p, &half)) {
            const float *panel = packed + (int64_t)p * K * NR, *b = bias == NULL ? NULL : bias + p * NR;
            const int cols = N - p * NR < NR ? N - p * NR : NR;
            if (half < 0) row_tile(x, panel, b, y + p * NR, K, cols, -1);
            else if (half == 0) row_tile(x, panel, b, y + p * NR, K, cols, 0);
            else row_tile(x, panel, b, y + p * NR, K, cols, 1);
        }
    }
}

/* Rows per work item: whole tiles, at most 192 and x's block no larger than 256 KB (it stays in L2 next to
 * the panel), fewer when there are too few panels to give every thread several items. */
static int row_block(int M, int K, int panels, int num_threads) {
    int block = 192;
    while (block > MR && (int64_t)block * K * sizeof(float) > 256 * 1024) block -= MR;
    while (block > MR && (int64_t)panels * ((M + block - 1) / block) < 8 * num_threads) block -= 2 * MR;
    return block < MR ? MR : block;
}

/* x: [M, K] rows ldx apart; packed: [ceil(N / 64), K, 64]; bias: [N] or NULL; y: [M, N] rows ldy apart. */
int gemm_packed_f32(const float *x, int64_t ldx, const float *packed, const float *bias, float *y, int64_t ldy,
                    int M, int N, int K, int num_threads) {
    if (M == 1) {
        dense_row_halves(x, packed, bias, y, N, K, num_threads);
        return 0;
    }
    const int panels = (N + NR - 1) / NR;
    const int block = row_block(M, K, panels, num_threads);
    const int row_blocks = (M + block - 1) / block;
    const int items = panels * row_blocks;
#pragma omp parallel num_threads(num_threads)
    { /* each thread a contiguous run of items, as schedule(static) would give, so it knows its next panel */
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int first = (int)((int64_t)items * thread / threads);
        const int last = (int)((int64_t)items * (thread + 1) / threads);
        for (int item = first; item < last; item++) {
            const int p = item / row_blocks, rb = item % row_blocks;
            const int row_end = (rb + 1) * block < M ? (rb + 1) * block : M;
            const int cols = N - p * NR < NR ? N - p * NR : NR;
            panel_rows(x, ldx, packed + (int64_t)p * K * NR, bias == NULL ? NULL : bias + p * NR, y + p * NR, ldy,
                       K, rb * block, row_end, cols,
                       (p + 1) * row_blocks < last ? packed + (int64_t)(p + 1) * K * NR : NULL);
        }
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

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
#if defined(BLOCK_SUMS)
/* Each block's sum of x's K values (blocks of `block`, 16 or 32). */
static void block_sums_of(const float *x, int K, int block, float *sums) {
    for (int blk = 0; blk < K / block; blk++) {
        __m512 v = _mm512_loadu_ps(x + block * blk);
        if (block == 32) v = _mm512_add_ps(v, _mm512_loadu_ps(x + block * blk + 16));
        sums[blk] = _mm512_reduce_add_ps(v);
    }
}
#endif

/* One row (single-sequence decode) over every panel, the threads splitting the panels by halves (half_run); whole
 * panels go by row_quant's blocks as ever. With the tall tiles (AVX-512), more rows than a tile of all 64 columns
 * holds (QUANT_TILE_ROWS), up to QUANT_TALL_ROWS, go the same way, each half panel's weights dequantized once for all
 * the rows, where tiles of 6 rows would dequantize them again for the rest (7 rows cost 6 and 1); from 11 rows the
 * FMAs bound both ways, and tiles of 6 do as well. Those rows are copied into QUANT_TALL_ROWS rows, zeros past M.
 * A bfloat16 model's rows that take block sums (block_sum_rows) go the same way too, each row's sums taken once for
 * all threads. Returns -1 where that copy or those sums cannot be had. */
static int quant_halves(const float *x, int64_t ldx, const uint8_t *packed, const float *bias, float *y, int64_t ldy,
                        int M, int N, int K, int num_threads, int format, int bf16_model) {
    float *sums = NULL;   /* each row's block sums, where its rows take them (block_sum_rows) */
    float *padded = NULL; /* the rows for the tall tiles */
#if defined(BLOCK_SUMS)
    const int blocks = K / qblock(format);
    if (block_sum_rows(M, format, bf16_model)) {
        sums = malloc((size_t)M * blocks * sizeof(float));
        if (sums == NULL) return -1;
        for (int r = 0; r < M; r++) block_sums_of(x + r * ldx, K, qblock(format), sums + r * blocks);
    }
#endif
#if defined(QUANT_TALL_ROWS)
    if (M > QUANT_TILE_ROWS) {
        padded = calloc((size_t)QUANT_TALL_ROWS * K, sizeof(float));
        if (padded == NULL) return -1;
        for (int r = 0; r < M; r++) memcpy(padded + (int64_t)r * K, x + r * ldx, (size_t)K * sizeof(float));
    }
#endif
    const int64_t panel_bytes = quant_panel_bytes(K, format);
#pragma omp parallel num_threads(num_threads)
    {
        HalfRun run = half_run((N + NR - 1) / NR, omp_get_thread_num(), omp_get_num_threads());
        int p, half;
        while (half_run_next(&run, &p, &half)) {
            const int cols = N - p * NR < NR ? N - p * NR : NR;
            const float *b = bias == NULL ? NULL : bias + p * NR;
            const uint8_t *panel = packed + p * panel_bytes;
#define QUANT_HALF(fmt)                                                                                        \
    case fmt:                                                                                                   \
        quant_half_##fmt(x, ldx, padded, sums, panel, b, y + p * NR, ldy, K, cols, half, M);                    \
        break;
            switch (format) { FOR_EACH_FORMAT(QUANT_HALF) }
#undef QUANT_HALF
        }
    }
    free(padded);
    free(sums);
    return 0;
}

int gemm_quant_available(void) { return 1; }

/* Whether rows of `format` flagged BF16_MODEL take block sums in this build (up to SUM_TILE_ROWS of them). */
int gemm_quant_block_sums(int format) { return block_sum_rows(1, format, 1); }

/* packed: [ceil(N / 64), quant_panel_bytes(K, format)] bytes of panels of one format (gemm_quant.h's enum,
 * which native/gemms.py's QUANT_FORMATS numbers alike, or'd with BF16_MODEL for a bfloat16 model's layer); K a
 * multiple of the format's block. The rest as gemm_packed_f32. Returns -1 for a K or a format it cannot take. */
int gemm_quant_f32(const float *x, int64_t ldx, const uint8_t *packed, const float *bias, float *y, int64_t ldy,
                   int M, int N, int K, int num_threads, int format) {
    const int bf16_model = format & BF16_MODEL;
    format &= ~BF16_MODEL;
    if (!takes_format(format, K)) return -1;
#if defined(QUANT_TALL_ROWS)
    if (M == 1 || (M > QUANT_TILE_ROWS && M <= QUANT_TALL_ROWS) || block_sum_rows(M, format, bf16_model))
#else
    if (M == 1)
#endif
        return quant_halves(x, ldx, packed, bias, y, ldy, M, N, K, num_threads, format, bf16_model);
    const int panels = (N + NR - 1) / NR;
    const int block = row_block(M, K, panels, num_threads);
    const int row_blocks = (M + block - 1) / block;
    const int items = panels * row_blocks;
    const int64_t panel_bytes = quant_panel_bytes(K, format);
#pragma omp parallel num_threads(num_threads)
    {
        /* Items of more than one tile dequantize their panel once, into this; without it they dequantize
         * per tile. */
        float *scratch = M > QUANT_TILE_ROWS ? aligned_alloc(64, (size_t)K * NR * sizeof(float)) : NULL;
        int held = -1; /* the panel in scratch */
#pragma omp for schedule(static)
        for (int item = 0; item < items; item++) {
            const int p = item / row_blocks, rb = item % row_blocks;
            const int row_begin = rb * block, row_end = (rb + 1) * block < M ? (rb + 1) * block : M;
            const int cols = N - p * NR < NR ? N - p * NR : NR;
            const uint8_t *panel = packed + p * panel_bytes;
            const float *b = bias == NULL ? NULL : bias + p * NR;
#define QUANT_ITEM(fmt)                                                                                       \
    case fmt:                                                                                                   \
        quant_item_##fmt(x, ldx, panel, b, y + p * NR, ldy, K, row_begin, row_end, cols, scratch, p, &held);    \
        break;
            switch (format) { FOR_EACH_FORMAT(QUANT_ITEM) }
#undef QUANT_ITEM
        }
        free(scratch);
    }
    return 0;
}

#if defined(__AVX512BF16__)
/* Panel p's 64 columns (dequantized, `dense` [K][64]) as gemm_bf16's panels 2p and 2p + 1 (as many of them as
 * there are, `out_panels`): per block of 32 along K two tiles (columns 0-15, 16-31) whose row i holds each column's
 * weights at k = 2i, 2i + 1, rounded to bf16 (nearest even), as gemm_layout.pack_bf16_panels lays them out. */
static void bf16_panels_of(const float *dense, int K, int p, int out_panels, uint16_t *out) {
    static const uint16_t pairs[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                       8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i interleave = _mm512_loadu_si512(pairs);
    for (int half = 0; half < 2 && 2 * p + half < out_panels; half++) {
        uint16_t *panel = out + (int64_t)(2 * p + half) * (K / 32) * 2 * 16 * 32;
        for (int b = 0; b < K / 32; b++)
            for (int t = 0; t < 2; t++)
                for (int i = 0; i < 16; i++) { /* row i: columns 32 half + 16 t .., at k = 32 b + 2 i, + 1 */
                    const float *even = dense + (int64_t)(32 * b + 2 * i) * NR + 32 * half + 16 * t;
                    /* k's 16 values in the low half, k + 1's in the high one, then paired column by column */
                    const __m512i both =
                        (__m512i)_mm512_cvtne2ps_pbh(_mm512_load_ps(even + NR), _mm512_load_ps(even));
                    _mm512_storeu_si512(panel + ((b * 2 + t) * 16 + i) * 32,
                                        _mm512_permutexvar_epi16(interleave, both));
                }
    }
}

/* A quantized weight as gemm_bf16's panels (out: [ceil(N / 32), K / 32, 2, 16, 16, 2] bf16), each weight as the
 * quantized kernels dequantize it, then rounded to bf16: for a bfloat16 model's rows that multiply faster on bf16
 * panels (AMX tiles) than by dequantizing as they go. Returns -1 for a K or a format it cannot take, -2 where a
 * thread's scratch could not be had. */
int dequant_bf16_panels(const uint8_t *packed, uint16_t *out, int N, int K, int num_threads, int format) {
    format &= ~BF16_MODEL; /* gemm_quant_f32's format numbers, flag and all, as a layer's kernel holds them */
    if (!takes_format(format, K) || K % 32 != 0) return -1;
    const int panels = (N + NR - 1) / NR, out_panels = (N + 31) / 32;
    const int64_t panel_bytes = quant_panel_bytes(K, format);
    int failed = 0;
#pragma omp parallel num_threads(num_threads)
    {
        float *dense = aligned_alloc(64, (size_t)K * NR * sizeof(float));
        if (dense == NULL) failed = 1;
#pragma omp for schedule(static)
        for (int p = 0; p < panels; p++) {
            if (dense == NULL) continue;
            const uint8_t *panel = packed + p * panel_bytes;
#define DEQUANT_PANEL(fmt)                                                                                     \
    case fmt:                                                                                                   \
        dequant_panel_##fmt(panel, K, dense);                                                                   \
        break;
            switch (format) { FOR_EACH_FORMAT(DEQUANT_PANEL) }
#undef DEQUANT_PANEL
            bf16_panels_of(dense, K, p, out_panels, out);
        }
        free(dense);
    }
    return failed ? -2 : 0;
}
#else
int dequant_bf16_panels(const uint8_t *packed, uint16_t *out, int N, int K, int num_threads, int format) {
    return -1;
}
#endif
#else
int gemm_quant_available(void) { return 0; }

int gemm_quant_block_sums(int format) { return 0; }

int gemm_quant_f32(const float *x, int64_t ldx, const uint8_t *packed, const float *bias, float *y, int64_t ldy,
                   int M, int N, int K, int num_threads, int format) {
    return -1;
}

int dequant_bf16_panels(const uint8_t *packed, uint16_t *out, int N, int K, int num_threads, int format) {
    return -1;
}
#endif
