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
 * Three bodies, whose results are the same to the bit: AVX512-VNNI (a tile of 4 rows x 4 panels, one vector a
 * panel), with AMX tiles beside it for products of AMX_MIN_ROWS rows or more where the CPU has them and the OS
 * grants them (tdpbusd: 16 x 16 x 64 products an instruction; see there), and a 256-bit one (2 rows x 2 panels, two
 * vectors a panel) for CPUs without AVX-512, with AVX-VNNI (Alder Lake and later) or AVX2 alone (see there).
 * gemm_int8_uses_amx() says whether the AMX tiles run here.
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

#define STEP_GROUPS 16 /* groups of 4 k per AMX tile multiply (a row of codes: 64 bytes) */

static inline int64_t panel_bytes(int K4) { return (int64_t)K4 * 64 + 2 * NR * 4; }

/* The rows' codes (+ ZERO_CODE, padded with zero codes to whole groups of 4; on AMX, with zero bytes to whole
 * steps of STEP_GROUPS groups), ldq bytes apart, each row's scale, and its outliers' indices and values. */
typedef struct {
    const uint8_t *q;
    int64_t ldq;
    const float *sx, *oval;
    const int32_t *oidx;
} RowCodes;

/* The OUTLIERS + 1 entries of largest |x| seen so far, largest first (the first of equals ahead), n of them. */
typedef struct {
    int32_t at[OUTLIERS + 1];
    float mag[OUTLIERS + 1];
    int n;
} Largest;

/* Entry k of |x| a, later than every entry seen so far, into the largest. */
static inline void see(Largest *t, float a, int32_t k) {
    if (t->n == OUTLIERS + 1 && !(a > t->mag[OUTLIERS])) return;
    int i = t->n < OUTLIERS + 1 ? t->n++ : OUTLIERS;
    for (; i > 0 && a > t->mag[i - 1]; i--) {
        t->mag[i] = t->mag[i - 1];
        t->at[i] = t->at[i - 1];
    }
    t->mag[i] = a;
    t->at[i] = k;
}

/* The OUTLIERS largest into idx and val (slots past K: index 0, value 0); returns the largest |x| of the other
 * entries, which sets the row's scale. */
static float outliers_of_largest(const Largest *t, const float *row, int32_t *idx, float *val) {
    for (int o = 0; o < OUTLIERS; o++) {
        idx[o] = o < t->n ? t->at[o] : 0;
        val[o] = o < t->n ? row[t->at[o]] : 0.0f;
    }
    return t->n > OUTLIERS ? t->mag[OUTLIERS] : 0.0f;
}

/* The OUTLIERS entries of the row with the largest |x| (the first of equals), largest first, into idx and val (slots
 * past K: index 0, value 0); returns the largest |x| of the other entries, which sets the row's scale. */
static float select_outliers(const float *row, int K, int32_t *idx, float *val) {
    Largest t = {.n = 0};
    for (int k = 0; k < K; k++) see(&t, fabsf(row[k]), k);
    return outliers_of_largest(&t, row, idx, val);
}

/* Whether the row holds a NaN. No code carries one (a NaN codes as -127), so such a row's scale is made a NaN
 * instead and all its outputs are NaN, as the float product's are (and the torch path's: there topk takes a NaN
 * for the largest |x|, an outlier). */
static int has_nan(const float *row, int K) {
    int nan = 0;
#pragma omp simd reduction(| : nan)
    for (int k = 0; k < K; k++) nan |= row[k] != row[k];
    return nan;
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#include <immintrin.h>

enum { MR = 4, NP = 4 }; /* a tile is MR rows x NP panels (16 accumulators) */
_Static_assert(NP % 2 == 0, "a gated tile pairs gate and up panels");

#define ZERO_CODE 128 /* a code of 0 as vpdpbusd takes it */

#define MAX_CANDIDATES 64

/* The third largest of v's 16 lanes, repeats counted: the largest twice taken out (one lane each), then the largest. */
static inline float third_largest(__m512 v) {
    for (int i = 0; i < 2; i++) {
        const __mmask16 at = _mm512_cmp_ps_mask(v, _mm512_set1_ps(_mm512_reduce_max_ps(v)), _CMP_EQ_OQ);
        v = _mm512_mask_mov_ps(v, (__mmask16)(at & (0u - at)), _mm512_set1_ps(-1.0f));
    }
    return _mm512_reduce_max_ps(v);
}

/* select_outliers' answer (for rows of finite values) from a few candidates: the third largest of the 16 lanes'
 * largest |x| is no larger than the row's third largest (three entries reach it), so every entry of the answer is
 * among those that reach it; they are taken in order as select_outliers takes all. Rows shorter than a vector, or
 * with more candidates than MAX_CANDIDATES (many equal values), take select_outliers' pass. */
static float outliers_of(const float *row, int K, int32_t *idx, float *val) {
    if (K < 16) return select_outliers(row, K, idx, val);
    __m512 part[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps()};
    int k = 0;
    for (; k + 64 <= K; k += 64) /* four chains of max: one would wait on each one's latency */
        for (int i = 0; i < 4; i++) part[i] = _mm512_max_ps(part[i], _mm512_abs_ps(_mm512_loadu_ps(row + k + 16 * i)));
    for (; k + 16 <= K; k += 16) part[0] = _mm512_max_ps(part[0], _mm512_abs_ps(_mm512_loadu_ps(row + k)));
    const __mmask16 tail = (__mmask16)((1u << (K - k)) - 1);
    part[1] = _mm512_max_ps(part[1], _mm512_abs_ps(_mm512_maskz_loadu_ps(tail, row + k)));
    const __m512 lane_max = _mm512_max_ps(_mm512_max_ps(part[0], part[1]), _mm512_max_ps(part[2], part[3]));
    const __m512 bar = _mm512_set1_ps(third_largest(lane_max));
    int32_t candidates[MAX_CANDIDATES + 16];
    int n = 0;
    for (k = 0; k < K && n <= MAX_CANDIDATES; k += 16) {
        const __mmask16 valid = K - k >= 16 ? (__mmask16)0xFFFF : tail;
        const __m512 a = _mm512_abs_ps(_mm512_maskz_loadu_ps(valid, row + k));
        const __mmask16 hits = _mm512_mask_cmp_ps_mask(valid, a, bar, _CMP_GE_OQ);
        if (hits) {
            _mm512_mask_compressstoreu_epi32(candidates + n, hits,
                                             _mm512_add_epi32(_mm512_set1_epi32(k), _mm512_setr_epi32(
                                                 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15)));
            n += __builtin_popcount(hits);
        }
    }
    if (n > MAX_CANDIDATES) return select_outliers(row, K, idx, val);
    Largest t = {.n = 0};
    for (int c = 0; c < n; c++) see(&t, fabsf(row[candidates[c]]), candidates[c]);
    return outliers_of_largest(&t, row, idx, val);
}

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

/* The lanes of a panel's columns from col on that exist (N columns in all). */
static inline __mmask16 panel_mask(int col, int N) {
    return N - col >= NR ? 0xFFFF : (__mmask16)((1u << (N - col)) - 1);
}

/* What scaling a panel's sums takes from the panel: its columns' sw, 128 * sum w and bias (0 past N, or none). */
typedef struct {
    const uint8_t *groups;
    __m512i comp;
    __m512 sw, b;
} PanelScale;

static inline PanelScale panel_scale(const uint8_t *panel, int K4, const float *bias, int col, int N) {
    const uint8_t *tail = panel + (int64_t)K4 * 64;
    const PanelScale ps = {panel, _mm512_loadu_si512(tail + NR * 4), _mm512_loadu_ps((const float *)tail),
                           bias ? _mm512_maskz_loadu_ps(panel_mask(col, N), bias + col) : _mm512_setzero_ps()};
    return ps;
}

/* What it takes from the row: its scale, and its outliers' values and places (each column's code of outlier k is
 * byte k % 4 of its lane in group k / 4: the shift moves it to the lane's top). */
typedef struct {
    __m512 sx, val[OUTLIERS];
    int64_t group[OUTLIERS];
    __m512i shift[OUTLIERS];
} RowScale;

static inline RowScale row_scale(float sx, const int32_t *idx, const float *val) {
    RowScale rs;
    rs.sx = _mm512_set1_ps(sx);
    for (int o = 0; o < OUTLIERS; o++) {
        rs.val[o] = _mm512_set1_ps(val[o]);
        rs.group[o] = (int64_t)(idx[o] >> 2) * 64;
        rs.shift[o] = _mm512_set1_epi32(24 - 8 * (idx[o] & 3));
    }
    return rs;
}

/* A row's outputs for a panel's 16 columns from their int32 sums over codes + 128 (each column's 128 * sum w comes
 * back off): fma(sums, sx, outlier terms) * sw + b, in that order, in every body; the outlier terms summed over
 * the outliers in order, each its value times the column's code. */
static inline __attribute__((always_inline)) __m512 scaled_outputs(__m512i acc, const PanelScale *ps,
                                                                   const RowScale *rs) {
    __m512 terms = _mm512_setzero_ps();
    for (int o = 0; o < OUTLIERS; o++) {
        const __m512i group = _mm512_loadu_si512(ps->groups + rs->group[o]);
        const __m512i codes = _mm512_srai_epi32(_mm512_sllv_epi32(group, rs->shift[o]), 24);
        terms = _mm512_fmadd_ps(rs->val[o], _mm512_cvtepi32_ps(codes), terms);
    }
    const __m512 sums = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc, ps->comp));
    return _mm512_add_ps(_mm512_mul_ps(_mm512_fmadd_ps(sums, rs->sx, terms), ps->sw), ps->b);
}

/* The gated MLP's 16 outputs o = silu(gate) * up. */
static inline void store_gated(float *o, __m512 gate, __m512 up) {
    float g[NR], u[NR];
    _mm512_storeu_ps(g, gate);
    _mm512_storeu_ps(u, up);
#pragma omp simd
    for (int i = 0; i < NR; i++) o[i] = silu_mul(g[i], u[i]);
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
    for (int j = 0; j < np; j++) {
        const int col = (p0 + j) * NR;
        const PanelScale ps = panel_scale(panel0 + j * pb, K4, bias, col, N);
        for (int r = 0; r < rows; r++) {
            const RowScale rs = row_scale(sx[r], oidx + r * OUTLIERS, oval + r * OUTLIERS);
            const __m512 out = scaled_outputs(acc[r][j], &ps, &rs);
            if (!gated)
                _mm512_mask_storeu_ps(y + r * ldy + col, panel_mask(col, N), out);
            else if (j % 2 == 0) /* a gate panel's outputs wait in acc's place for its up panel's */
                acc[r][j] = _mm512_castps_si512(out);
            else
                store_gated(y + r * ldy + (p0 + j - 1) / 2 * NR, _mm512_castsi512_ps(acc[r][j - 1]), out);
        }
    }
}

#if defined(__AMX_TILE__) && defined(__AMX_INT8__)
/* On AMX (Sapphire Rapids and later) one tdpbusd multiplies 16 rows x 64 codes by 64 codes x 16 columns: the
 * panels' groups are already the B tile's layout (16 groups of 64 bytes = 64 k x 16 columns), and the sums are
 * vpdpbusd's, so the results are the other bodies' to the bit. An item is up to 32 rows x two panels (a gate and
 * its up panel, for the gated layout), in amx.h's configuration, walked in panel_items.h's order; the codes' rows
 * are ldq = a multiple of 64 bytes apart, zero past the row's groups, and the last K step of a K that is no
 * multiple of 64 takes its panel groups from a zero-padded copy (the panel's tail, or past the last panel, is no
 * weight). */
#include "amx.h"
#include "panel_items.h"

#define AMX_ROWS 32    /* rows per item: two tiles of codes */

/* Step s's groups of each of the np panels from panel0 (pb bytes apart) into tiles 6 and 7, from the panel or, for
 * a partial last step, from copies zero-padded to whole steps. */
static inline void load_weights(const uint8_t *panel0, int64_t pb, int np, int s, int K4) {
    const int groups = K4 - s * STEP_GROUPS;
    if (groups >= STEP_GROUPS) {
        _tile_loadd(6, panel0 + (int64_t)s * STEP_GROUPS * 64, 64);
        if (np > 1) _tile_loadd(7, panel0 + pb + (int64_t)s * STEP_GROUPS * 64, 64);
        return;
    }
    uint8_t last[2][STEP_GROUPS * 64] __attribute__((aligned(64)));
    for (int j = 0; j < np; j++) {
        memcpy(last[j], panel0 + j * pb + (int64_t)s * STEP_GROUPS * 64, (size_t)groups * 64);
        memset(last[j] + groups * 64, 0, (size_t)(STEP_GROUPS - groups) * 64);
    }
    amx_memory_barrier();
    _tile_loadd(6, last[0], 64);
    if (np > 1) _tile_loadd(7, last[1], 64);
}

/* What every item of one product shares. */
typedef struct {
    const RowCodes *rc;
    const uint8_t *packed; /* the panels, pb bytes each */
    int64_t pb, ldy;
    int K4, N, gated;
    const float *bias;
    float *y;
} Product;

/* An item: rows [row0, row0 + rows) (<= 32) against np (1 or 2) panels from p0. */
typedef struct {
    int p0, np, row0, rows;
} Item;

/* Rows [r0, r1) of item `done`, from its int32 sums in c, into y, as the tile body's epilogue (np and gated
 * constants after inlining). */
static inline __attribute__((always_inline)) void finish(const Product *pr, const Item *done,
                                                         const int32_t (*c)[2 * NR], int r0, int r1, const int np,
                                                         const int gated) {
    const RowCodes *rc = pr->rc;
    PanelScale ps[2];
    for (int j = 0; j < np; j++)
        ps[j] = panel_scale(pr->packed + (done->p0 + j) * pr->pb, pr->K4, pr->bias, (done->p0 + j) * NR, pr->N);
    for (int r = r0; r < r1; r++) {
        const int64_t m = done->row0 + r;
        const RowScale rs = row_scale(rc->sx[m], rc->oidx + m * OUTLIERS, rc->oval + m * OUTLIERS);
        __m512 out[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
        for (int j = 0; j < np; j++) out[j] = scaled_outputs(_mm512_load_si512(c[r] + j * NR), &ps[j], &rs);
        float *yr = pr->y + m * pr->ldy;
        if (gated) {
            store_gated(yr + done->p0 / 2 * NR, out[0], out[1]);
        } else {
            for (int j = 0; j < np; j++) {
                const int col = (done->p0 + j) * NR;
                _mm512_mask_storeu_ps(yr + col, panel_mask(col, pr->N), out[j]);
            }
        }
    }
}

static void finish_rows(const Product *pr, const Item *done, const int32_t (*c)[2 * NR], int r0, int r1) {
    if (pr->gated) finish(pr, done, c, r0, r1, 2, 1);
    else if (done->np == 2) finish(pr, done, c, r0, r1, 2, 0);
    else finish(pr, done, c, r0, r1, 1, 0);
}

/* Item `it` on the tiles (configured for its rows already), its sums left in c; meanwhile, a slice of rows per K
 * step, the epilogue of the item before it (`done`, NULL: none) from c: the vector units scale and write one item
 * while the tile unit multiplies the next (at small K, as SmolLM2's 576, the epilogue's vector work is as long as
 * the multiply; the two overlap only in part, the tile unit holding one of the vector ports while it multiplies).
 * `ahead`: this item's share of the next panels to fetch into L2, step by step. The codes load as usual, not with
 * the non-temporal hint gemm_bf16.c gives its rows where a chunk has several row blocks: an item's two panels of
 * int8 codes are half the bytes of the bf16 kernel's panel, and the codes' rows, read again by every panel pair of
 * the chunk, are what the hint would evict. */
static void item_amx(const Product *pr, const Item *it, const Item *done, int32_t (*c)[2 * NR], const Ahead *ahead) {
    const int64_t pb = pr->pb, ldq = pr->rc->ldq;
    const int np = it->np, lower = it->rows > 16, steps = (pr->K4 + STEP_GROUPS - 1) / STEP_GROUPS;
    const uint8_t *a0 = pr->rc->q + (int64_t)it->row0 * ldq, *a1 = a0 + 16 * ldq;
    const uint8_t *panel0 = pr->packed + it->p0 * pb;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int s = 0; s < steps; s++, a0 += 64, a1 += 64) {
        fetch_ahead(ahead, s, steps);
        _tile_loadd(4, a0, ldq);
        load_weights(panel0, pb, np, s, pr->K4);
        _tile_dpbusd(0, 4, 6);
        if (np > 1) _tile_dpbusd(1, 4, 7);
        if (lower) {
            _tile_loadd(5, a1, ldq);
            _tile_dpbusd(2, 5, 6);
            if (np > 1) _tile_dpbusd(3, 5, 7);
        }
        if (done != NULL) finish_rows(pr, done, c, done->rows * s / steps, done->rows * (s + 1) / steps);
    }
    amx_memory_barrier(); /* the epilogue's plain loads of c before the tile stores over them */
    _tile_stored(0, c[0], 2 * NR * sizeof(int32_t));
    if (np > 1) _tile_stored(1, c[0] + NR, 2 * NR * sizeof(int32_t));
    if (lower) {
        _tile_stored(2, c[16], 2 * NR * sizeof(int32_t));
        if (np > 1) _tile_stored(3, c[16] + NR, 2 * NR * sizeof(int32_t));
    }
    amx_memory_barrier();
}

/* The whole product on AMX tiles: items of 32 rows x 2 panels over the threads in panel_items.h's order. */
static void gemm_amx(const RowCodes *rc, int M, const uint8_t *packed, int K4, int panels, const float *bias,
                     float *y, int64_t ldy, int N, int gated, int num_threads) {
    const int pairs = (panels + 1) / 2, row_blocks = (M + AMX_ROWS - 1) / AMX_ROWS, items = pairs * row_blocks;
    const int chunk_blocks = chunk_row_blocks((int64_t)AMX_ROWS * rc->ldq, row_blocks);
    const Product pr = {rc, packed, panel_bytes(K4), ldy, K4, N, gated, bias, y};
#pragma omp parallel num_threads(num_threads)
    {
        const int threads = omp_get_num_threads(), thread = omp_get_thread_num();
        const int first = (int)((int64_t)items * thread / threads);
        const int last = (int)((int64_t)items * (thread + 1) / threads);
        int32_t c[AMX_ROWS][2 * NR] __attribute__((aligned(64)));
        Item done = {0, 0, 0, 0}; /* the item whose sums are in c (rows 0: none) */
        for (int i = first; i < last; i++) {
            const PanelItem order = panel_item(i, pairs, row_blocks, chunk_blocks);
            const int p0 = 2 * order.panel, row0 = order.row_block * AMX_ROWS;
            const Item it = {p0, panels - p0 < 2 ? 1 : 2, row0, M - row0 < AMX_ROWS ? M - row0 : AMX_ROWS};
            if (it.rows != done.rows) amx_configure_gemm(it.rows < 16 ? it.rows : 16, it.rows - 16);
            const Ahead ahead = ahead_share(&order, p0 + 2 < panels ? packed + (p0 + 2) * pr.pb : NULL,
                                            (panels - p0 - 2 < 2 ? panels - p0 - 2 : 2) * pr.pb);
            item_amx(&pr, &it, done.rows ? &done : NULL, c, &ahead);
            done = it;
        }
        if (done.rows) {
            finish_rows(&pr, &done, (const int32_t(*)[2 * NR])c, 0, done.rows);
            _tile_release();
        }
    }
}
#define AMX_BODY 1
#endif

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

static inline float outliers_of(const float *row, int K, int32_t *idx, float *val) {
    return select_outliers(row, K, idx, val);
}

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

/* The product in register tiles of MR rows x NP panels, over the threads. */
static void gemm_tiles(const RowCodes *rc, int M, const uint8_t *packed, int K4, int panels, const float *bias,
                       float *y, int64_t ldy, int N, int gated, int num_threads) {
    const int row_tiles = (M + MR - 1) / MR, panel_tiles = (panels + NP - 1) / NP;
#pragma omp parallel for collapse(2) num_threads(num_threads) schedule(static)
    for (int pt = 0; pt < panel_tiles; pt++) {
        for (int rt = 0; rt < row_tiles; rt++) {
            const int m0 = rt * MR, p0 = pt * NP;
            const int rows = M - m0 < MR ? M - m0 : MR, np = panels - p0 < NP ? panels - p0 : NP;
            const uint8_t *qt = rc->q + m0 * rc->ldq;
            const int32_t *it = rc->oidx + (int64_t)m0 * OUTLIERS;
            const float *vt = rc->oval + (int64_t)m0 * OUTLIERS, *st = rc->sx + m0;
            float *yt = y + m0 * ldy;
            if (rows == MR && np == NP)
                tile(qt, rc->ldq, st, it, vt, packed, K4, p0, bias, yt, ldy, N, MR, NP, gated);
            else if (rows == 1 && np == NP)
                tile(qt, rc->ldq, st, it, vt, packed, K4, p0, bias, yt, ldy, N, 1, NP, gated);
            else
                tile(qt, rc->ldq, st, it, vt, packed, K4, p0, bias, yt, ldy, N, rows, np, gated);
        }
    }
}

#if defined(AMX_BODY)
#define AMX_MIN_ROWS 8 /* below, the vector tiles are as fast: the weights' bytes bound the product */

int gemm_int8_uses_amx(void) { return amx_granted(); }
#else
int gemm_int8_uses_amx(void) { return 0; }
#endif

static inline __attribute__((always_inline)) int gemm_w8a8(const float *x, int64_t ldx, const uint8_t *packed,
                                                           const float *bias, float *y, int64_t ldy, int M, int N,
                                                           int K, int num_threads, const int gated) {
    if (M < 0 || N <= 0 || K <= 0 || (gated && (N % (2 * NR) || bias))) return -1;
#if defined(AMX_BODY)
    const int amx = M >= AMX_MIN_ROWS && gemm_int8_uses_amx();
#else
    const int amx = 0;
#endif
    const int K4 = (K + 3) / 4, panels = (N + NR - 1) / NR;
    const int64_t ldq = amx ? (int64_t)(K4 + STEP_GROUPS - 1) / STEP_GROUPS * 64 : (int64_t)K4 * 4;
    uint8_t *q = malloc((size_t)M * ldq + 1);
    float *sx = malloc((size_t)M * sizeof(float) + 1), *oval = malloc((size_t)M * OUTLIERS * sizeof(float) + 1);
    int32_t *oidx = malloc((size_t)M * OUTLIERS * sizeof(int32_t) + 1);
    if (q && sx && oval && oidx) {
#pragma omp parallel for num_threads(num_threads) schedule(static)
        for (int m = 0; m < M; m++) {
            const float *row = x + (int64_t)m * ldx;
            int32_t *idx = oidx + (int64_t)m * OUTLIERS;
            quantize_row(row, K, K4, outliers_of(row, K, idx, oval + (int64_t)m * OUTLIERS), q + m * ldq, sx + m);
            if (has_nan(row, K)) sx[m] = NAN;
            for (int o = 0; o < OUTLIERS && o < K; o++) q[m * ldq + idx[o]] = ZERO_CODE;
            memset(q + m * ldq + K4 * 4, 0, (size_t)(ldq - K4 * 4)); /* AMX's padding: no weight, multiplied by 0 */
        }
        const RowCodes rc = {q, ldq, sx, oval, oidx};
#if defined(AMX_BODY)
        if (amx) gemm_amx(&rc, M, packed, K4, panels, bias, y, ldy, N, gated, num_threads);
        else
#endif
            gemm_tiles(&rc, M, packed, K4, panels, bias, y, ldy, N, gated, num_threads);
    }
    const int failed = !q || !sx || !oval || !oidx;
    free(q);
    free(sx);
    free(oval);
    free(oidx);
    return failed ? -2 : 0;
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

int gemm_int8_uses_amx(void) { return 0; }

int gemm_w8a8_f32(const float *x, int64_t ldx, const uint8_t *packed, const float *bias, float *y, int64_t ldy,
                  int M, int N, int K, int num_threads) {
    return -3;
}

int gemm_w8a8_silu_mul_f32(const float *x, int64_t ldx, const uint8_t *packed, const float *bias, float *y,
                           int64_t ldy, int M, int N, int K, int num_threads) {
    return -3;
}
#endif
