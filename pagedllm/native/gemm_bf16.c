/* bf16 GEMM against weights packed once: y[M, N] (float32) = x[M, K] (float32) @ W^T (+ bias), W held in bf16,
 * x rounded to bf16 (nearest even) on the way in, products summed in float32. For a bfloat16 model on CPUs with
 * bf16 arithmetic (platforms/cpu.KernelChoice.bf16_panels): half the weight bytes a decode step streams, and bf16
 * multiplies.
 *
 * Two bodies over one layout. With AMX (Sapphire Rapids and later), one tile multiply does 16 x 16 x 32 bf16
 * multiply-adds, ~16x what AVX-512 float32 FMAs do per cycle: torch's oneDNN reaches AMX too, but at decode sizes
 * (1-64 rows) its per-call set-up dominates, and it wants bf16 activations where the rest of our kernels are
 * float32. With AVX512-BF16 but no AMX (Zen 4 and 5, Cooper Lake), vdpbf16ps does two bf16 multiply-adds per
 * float32 lane: twice the FMA's work per instruction.
 *
 * Layout (gemm_layout.pack_bf16_panels): panels of 32 output columns, K padded to whole blocks of 32; per panel
 * and block two tiles (columns 0-15, 16-31) of 16 rows x 64 bytes, row i holding for each column the pair of
 * weights at k = 2i, 2i + 1 (the "VNNI" pairing both vdpbf16ps and the tile multiply want). A panel is one
 * contiguous run.
 *
 * Work items are (panel, block of 32 rows), split into contiguous runs over torch's OpenMP threads (panel_items.h):
 * in chunks of rows whose bf16 copy fits in L2, then panel by panel, so a panel read from memory by its
 * first row block is in L2 for the next. How the first row block gets the panel out of memory differs by body,
 * each the way that was faster on a machine with that body: on AMX the panel's items fetch the next panel into L2
 * as they go, each its share (panel_items.h's fetch_ahead), so that memory streams while the row blocks multiply
 * from cache (prefetching ahead in the panel itself, into L1, does no better than no prefetch there, nor into L1
 * the next steps' rows of x); with vdpbf16ps the first tile over a panel prefetches 8 KB
 * ahead in it into L1, which keeps the stream ahead of a tile whose loads are otherwise paced by memory (fetching
 * the next panel into L2 does not help there, spread over all its tiles or not: one demand-paced tile reading
 * memory stalls on it whatever L2 holds), and the tiles take the panel 8 KB at a time in turn (item_dp), so that
 * stream is spread over all of them.
 * Each thread first rounds its share of x's rows to bf16 into a shared scratch (K padded to 32 with zeros).
 * On AMX an item keeps four 16 x 16 float32 accumulator tiles (rows 0-15 and 16-31 by columns 0-15 and 16-31;
 * the last row block's tiles are configured to the rows it has); with vdpbf16ps, tiles of up to 8 rows x 32
 * columns in 16 registers. Both add the bias on the way out (write_rows); on AMX an item's rows go out in slices
 * between the next item's tile multiplies, as gemm_int8.c's do, the vector units writing while the tile unit
 * multiplies.
 *
 * gemm_bf16_available() says whether this build has a body; gemm_bf16_uses_amx() whether it multiplies on AMX
 * (built for it, and the OS lets this process use the tiles).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <omp.h>

#include "amx.h"
#include "panel_items.h"
#include "simd.h"

#define PANEL_COLS 32
#define KBLOCK 32     /* bf16 values along K per tile row */
#define ROW_BLOCK 32  /* rows per work item: two A tiles */
#define DP_ROWS 8     /* rows per vdpbf16ps register tile */
#define DP_KBLOCKS 4  /* blocks along K a vdpbf16ps tile takes before the next tile does */
#define STREAM_AHEAD 8192 /* bytes a vdpbf16ps tile reading a panel from memory prefetches ahead of itself */

#if defined(__AVX512BF16__)
#include <immintrin.h>

/* The calling thread's bf16 copy of x, grown as needed (engines on separate threads each have their own). */
static _Thread_local uint16_t *scratch;
static _Thread_local size_t scratch_len;

static uint16_t *x_scratch(size_t len) {
    if (len > scratch_len) {
        free(scratch);
        scratch = aligned_alloc(64, (len * sizeof(uint16_t) + 63) / 64 * 64);
        scratch_len = scratch == NULL ? 0 : len;
    }
    return scratch;
}

/* Rows [begin, end) of x as bf16, each row kp values (K of them, zeros after). */
static void round_rows(const float *x, int64_t ldx, int K, int kp, uint16_t *a, int begin, int end) {
    for (int r = begin; r < end; r++) {
        uint16_t *dst = a + (int64_t)r * kp;
        int k = 0;
        for (; k + 16 <= K; k += 16)
            _mm256_storeu_si256((__m256i *)(dst + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + r * ldx + k)));
        if (k < K) {
            const __mmask16 m = (__mmask16)((1u << (K - k)) - 1u);
            const __m512 tail = _mm512_maskz_loadu_ps(m, x + r * ldx + k);
            _mm256_mask_storeu_epi16(dst + k, m, (__m256i)_mm512_cvtneps_pbh(tail));
        }
        for (k = K; k < kp; k++) dst[k] = 0;
    }
}

/* Where an item's results go: y at the panel's first output column, the bias there (NULL: none), and, for the
 * gated layout (gemm_bf16_silu_mul), the bias of the up half; cols: the panel's output columns that exist. */
typedef struct {
    float *y;
    int64_t ldy;
    const float *bias, *up_bias;
    int cols, gated;
} PanelOut;

static inline __mmask16 first_lanes(int n) { return n >= 16 ? 0xFFFF : (n <= 0 ? 0 : (__mmask16)((1u << n) - 1u)); }

/* y's rows [row0, row0 + rows) from c (rows of 32 floats): c + bias, or, gated, silu(gate) * up of c's two
 * halves (gate columns 0-15, the same columns of up 16-31) plus their biases. */
static void write_rows(const float *c, const PanelOut *o, int row0, int rows) {
    const __mmask16 m0 = first_lanes(o->cols), m1 = o->gated ? m0 : first_lanes(o->cols - 16);
    const float *bias1 = o->gated ? o->up_bias : (o->bias != NULL ? o->bias + 16 : NULL);
    const __m512 b0 = o->bias != NULL ? _mm512_maskz_loadu_ps(m0, o->bias) : _mm512_setzero_ps();
    const __m512 b1 = bias1 != NULL ? _mm512_maskz_loadu_ps(m1, bias1) : _mm512_setzero_ps();
    for (int r = 0; r < rows; r++) {
        float *yr = o->y + (int64_t)(row0 + r) * o->ldy;
        const __m512 v0 = _mm512_add_ps(_mm512_loadu_ps(c + r * PANEL_COLS), b0);
        const __m512 v1 = _mm512_add_ps(_mm512_loadu_ps(c + r * PANEL_COLS + 16), b1);
        if (o->gated) {
            /* the loop writes y itself: the compiler vectorises it in halves of 8 lanes (its preference on Intel
             * cores), and one 16-lane load of two such stores just made would stall on store forwarding */
            float gate[16] __attribute__((aligned(64))), up[16] __attribute__((aligned(64)));
            _mm512_store_ps(gate, v0);
            _mm512_store_ps(up, v1);
            const int cols = o->cols < 16 ? o->cols : 16;
#pragma omp simd aligned(gate, up : 64)
            for (int i = 0; i < cols; i++) yr[i] = silu_mul(gate[i], up[i]);
        } else {
            _mm512_mask_storeu_ps(yr, m0, v0);
            _mm512_mask_storeu_ps(yr + 16, m1, v1);
        }
    }
}

/* ROWS (a constant after inlining, <= DP_ROWS) rows of bf16 x from row r0 against blocks [kb0, kb1) of a panel,
 * with vdpbf16ps: c[r][0:32] (+)= x[r] . panel, starting from zero when kb0 is 0. The tile that reads the panel
 * from memory (`stream`) prefetches STREAM_AHEAD bytes ahead of itself. */
static inline __attribute__((always_inline)) void dp_tile(const uint16_t *a, int kp, const uint16_t *panel, int r0,
                                                          const int ROWS, float *c, int kb0, int kb1, int stream) {
    __m512 acc[DP_ROWS][2];
    for (int r = 0; r < ROWS; r++)
        for (int h = 0; h < 2; h++)
            acc[r][h] = kb0 == 0 ? _mm512_setzero_ps() : _mm512_load_ps(c + r * PANEL_COLS + 16 * h);
    const char *b = (const char *)panel + (int64_t)kb0 * 2048;
    for (int kb = kb0; kb < kb1; kb++, b += 2048) {
        for (int i = 0; i < 16; i++) {
            if (stream) {
                _mm_prefetch(b + STREAM_AHEAD + 64 * i, _MM_HINT_T0);
                _mm_prefetch(b + STREAM_AHEAD + 1024 + 64 * i, _MM_HINT_T0);
            }
            const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b + 64 * i);
            const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b + 1024 + 64 * i);
            for (int r = 0; r < ROWS; r++) {
                uint32_t pair;
                memcpy(&pair, a + (int64_t)(r0 + r) * kp + kb * KBLOCK + 2 * i, sizeof pair);
                const __m512bh xb = (__m512bh)_mm512_set1_epi32((int)pair);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xb, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xb, w1);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        _mm512_store_ps(c + r * PANEL_COLS, acc[r][0]);
        _mm512_store_ps(c + r * PANEL_COLS + 16, acc[r][1]);
    }
}

/* The lines of y that rows [r, r + n) of an item will write, fetched for writing as the item starts: written at its
 * end, they would otherwise all miss at once and stall the stores. */
static inline void prefetch_rows_for_write(const PanelOut *out, int r, int n) {
    for (int q = 0; q < n; q++) {
        const char *yr = (const char *)(out->y + (int64_t)(r + q) * out->ldy);
        _mm_prefetch(yr, _MM_HINT_ET0);
        if (!out->gated) _mm_prefetch(yr + 64, _MM_HINT_ET0);
    }
}

/* One item with vdpbf16ps: rows [row0, row0 + rows) of y against one panel, in tiles of DP_ROWS rows that take
 * the panel DP_KBLOCKS blocks (8 KB) at a time, so the first tile's reading of a block from memory (`stream`: the
 * panel's first row block) is spread over the item instead of being one tile's whole pass, and the others find
 * the block in L1. */
static void item_dp(const uint16_t *a, int kp, const uint16_t *panel, const PanelOut *out, int row0, int rows,
                    int stream) {
    float c[ROW_BLOCK * PANEL_COLS] __attribute__((aligned(64)));
    const int kbs = kp / KBLOCK;
    for (int kb0 = 0; kb0 < kbs; kb0 += DP_KBLOCKS) {
        const int kb1 = kb0 + DP_KBLOCKS < kbs ? kb0 + DP_KBLOCKS : kbs;
        for (int r = row0; r < row0 + rows; r += DP_ROWS) {
            float *ct = c + (r - row0) * PANEL_COLS;
            const int first = stream && r == row0; /* the later tiles find the blocks in cache */
            const int n = row0 + rows - r < DP_ROWS ? row0 + rows - r : DP_ROWS;
            if (kb0 == 0) prefetch_rows_for_write(out, r, n);
            switch (n) {
            case 8: dp_tile(a, kp, panel, r, 8, ct, kb0, kb1, first); break;
            case 7: dp_tile(a, kp, panel, r, 7, ct, kb0, kb1, first); break;
            case 6: dp_tile(a, kp, panel, r, 6, ct, kb0, kb1, first); break;
            case 5: dp_tile(a, kp, panel, r, 5, ct, kb0, kb1, first); break;
            case 4: dp_tile(a, kp, panel, r, 4, ct, kb0, kb1, first); break;
            case 3: dp_tile(a, kp, panel, r, 3, ct, kb0, kb1, first); break;
            case 2: dp_tile(a, kp, panel, r, 2, ct, kb0, kb1, first); break;
            default: dp_tile(a, kp, panel, r, 1, ct, kb0, kb1, first); break;
            }
        }
    }
    write_rows(c, out, row0, rows);
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
int gemm_bf16_uses_amx(void) { return amx_granted(); }


/* An item whose sums wait in c for their epilogue: where they go, from which row, how many (0: none). */
typedef struct {
    PanelOut out;
    int row0, rows;
} Pending;

/* One item on AMX tiles: rows [row0, row0 + rows) of y (rows <= 32) against one panel, the tiles configured for
 * `rows` already, its sums left in c; meanwhile, a slice of rows per K step, the epilogue of the item before it
 * (`done`) from c, so that the vector units write one item while the tile unit multiplies the next. With
 * `stream_rows` x's rows are loaded with the non-temporal hint: where a chunk has several row blocks, the panel is
 * what the next item reads again, and x's rows, read once per panel, would otherwise evict it from L1; a single row
 * block is read again by every panel and loads as usual. */
static void item_amx(const uint16_t *a, int kp, const uint16_t *panel, const Pending *done, float *c, int row0,
                     int rows, const Ahead *ahead, int stream_rows) {
    const int lower = rows > 16, steps = kp / KBLOCK;
    const int64_t lda = (int64_t)kp * sizeof(uint16_t);
    const char *a0 = (const char *)(a + (int64_t)row0 * kp), *a1 = a0 + 16 * lda;
    const char *b = (const char *)panel;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int kb = 0; kb < steps; kb++, a0 += 64, a1 += 64, b += 2048) {
        fetch_ahead(ahead, kb, steps);
        if (stream_rows) _tile_stream_loadd(4, a0, lda);
        else _tile_loadd(4, a0, lda);
        _tile_loadd(6, b, 64);
        _tile_loadd(7, b + 1024, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (lower) {
            if (stream_rows) _tile_stream_loadd(5, a1, lda);
            else _tile_loadd(5, a1, lda);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (done->rows) {
            const int r0 = done->rows * kb / steps, r1 = done->rows * (kb + 1) / steps;
            write_rows(c + r0 * PANEL_COLS, &done->out, done->row0 + r0, r1 - r0);
        }
    }
    amx_memory_barrier(); /* the epilogue's plain loads of c before the tile stores over them */
    _tile_stored(0, c, PANEL_COLS * sizeof(float));
    _tile_stored(1, c + 16, PANEL_COLS * sizeof(float));
    if (lower) {
        _tile_stored(2, c + 16 * PANEL_COLS, PANEL_COLS * sizeof(float));
        _tile_stored(3, c + 16 * PANEL_COLS + 16, PANEL_COLS * sizeof(float));
    }
    amx_memory_barrier();
}
#else
int gemm_bf16_uses_amx(void) { return 0; }
#endif

int gemm_bf16_available(void) { return 1; }

/* x: [M, K] float32 rows ldx apart; packed: [ceil(N / 32), ceil(K / 32), 2, 16, 32] bf16; bias: [N] or NULL;
 * y: [M, N] float32 rows ldy apart, or, gated, [M, N / 2]: the packed columns are the gate and up projections
 * interleaved 16 by 16 (pack_bf16_panels(gated=True)) and y = silu(gate) * up. Returns -1 where scratch cannot be
 * had. */
static int run_gemm(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y, int64_t ldy,
                    int M, int N, int K, int num_threads, int gated) {
    if (M == 0) return 0;
    const int kp = (K + KBLOCK - 1) / KBLOCK * KBLOCK, mp = (M + ROW_BLOCK - 1) / ROW_BLOCK * ROW_BLOCK;
    uint16_t *a = x_scratch((size_t)mp * kp);
    if (a == NULL) return -1;
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
    const int amx = gemm_bf16_uses_amx();
#endif
    const int panels = (N + PANEL_COLS - 1) / PANEL_COLS, row_blocks = mp / ROW_BLOCK;
    const int out_cols = gated ? PANEL_COLS / 2 : PANEL_COLS, out_n = gated ? N / 2 : N; /* per panel, in all */
    const int chunk_blocks = chunk_row_blocks((int64_t)ROW_BLOCK * kp * sizeof(uint16_t), row_blocks);
    const int items = panels * row_blocks;
    const int64_t panel_len = (int64_t)kp * PANEL_COLS;
#pragma omp parallel num_threads(num_threads)
    {
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        round_rows(x, ldx, K, kp, a, (int)((int64_t)M * thread / threads), (int)((int64_t)M * (thread + 1) / threads));
#pragma omp barrier
        const int first = (int)((int64_t)items * thread / threads);
        const int last = (int)((int64_t)items * (thread + 1) / threads);
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        int shape = -1; /* the rows the tiles are configured for */
        float c[ROW_BLOCK * PANEL_COLS] __attribute__((aligned(64)));
        Pending done = {{NULL, 0, NULL, NULL, 0, 0}, 0, 0}; /* the item whose sums are in c */
#endif
        for (int it = first; it < last; it++) {
            const PanelItem item = panel_item(it, panels, row_blocks, chunk_blocks);
            const int p = item.panel, row0 = item.row_block * ROW_BLOCK;
            const int rows = M - row0 < ROW_BLOCK ? M - row0 : ROW_BLOCK;
            const int col0 = p * out_cols;
            const PanelOut out = {y + col0, ldy, bias == NULL ? NULL : bias + col0,
                                  bias == NULL || !gated ? NULL : bias + out_n + col0,
                                  out_n - col0 < out_cols ? out_n - col0 : out_cols, gated};
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
            if (amx) {
                if (rows != shape) {
                    amx_configure_gemm(rows < 16 ? rows : 16, rows - 16);
                    shape = rows;
                }
                const Ahead ahead = ahead_share(&item, p + 1 < panels ? packed + (p + 1) * panel_len : NULL,
                                                panel_len * (int64_t)sizeof(uint16_t));
                item_amx(a, kp, packed + p * panel_len, &done, c, row0, rows, &ahead, item.blocks > 1);
                done.out = out, done.row0 = row0, done.rows = rows;
                continue;
            }
#endif
            item_dp(a, kp, packed + p * panel_len, &out, row0, rows, item.block == 0);
        }
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
        if (done.rows) write_rows(c, &done.out, done.row0, done.rows);
        if (shape >= 0) _tile_release();
#endif
    }
    return 0;
}

int gemm_bf16(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y, int64_t ldy, int M,
              int N, int K, int num_threads) {
    return run_gemm(x, ldx, packed, bias, y, ldy, M, N, K, num_threads, 0);
}

/* The gate_up projection with the MLP's activation fused in: y [M, N / 2] = silu(gate) * up, where the panels hold
 * the [gate | up] weight (N rows) interleaved 16 columns at a time and bias (or NULL) is the plain [gate | up]
 * bias. The [M, N] projection is never written: at 2048 rows it is 25 MB for SmolLM2, past the L3 cache, and
 * its writes and re-reading cost more than the multiply's last third. */
int gemm_bf16_silu_mul(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                       int64_t ldy, int M, int N, int K, int num_threads) {
    if (N % 2 != 0) return -1;
    return run_gemm(x, ldx, packed, bias, y, ldy, M, N, K, num_threads, 1);
}
#else
int gemm_bf16_available(void) { return 0; }

int gemm_bf16_uses_amx(void) { return 0; }

int gemm_bf16(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y, int64_t ldy, int M,
              int N, int K, int num_threads) {
    return -1;
}

int gemm_bf16_silu_mul(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                       int64_t ldy, int M, int N, int K, int num_threads) {
    return -1;
}
#endif
