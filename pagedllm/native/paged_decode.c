/* Paged attention over the KV cache in place, float32: decode rows (one query token per request) and, further
 * down, prefill tiles.
 *
 * The torch path gathers every request's whole K/V history out of the paged cache into new tensors in
 * every layer and step; this kernel walks the request's block table instead, so each K/V row is read once
 * and nothing is written but the output. Work items are (request, KV head); an item keeps the query heads
 * of its group together, so a K/V row loaded once serves all of them, and it goes through the history in
 * runs of up to 16 consecutive slots with an online softmax (one rescale per run).
 *
 * Three bodies: with AVX-512 (groups up to 8, head sizes 16, 32, 64 or 128) the scores of a run are
 * sixteen vector dot products reduced together by one transpose-and-add tree, the softmax of the run is one
 * vector exp, and the group's output accumulators stay in registers; with AVX2 and FMA (the same sizes) the
 * same on 8-float vectors, its loops turned to fit 16 registers; otherwise portable C.
 *
 * The cache holds float32, or, built with -DKV_BF16, bf16 (the top half of a float32; a bfloat16 model whose
 * activations are float32, see ModelConfig.compute_dtype): half the bytes every decode step streams. Queries,
 * outputs and all arithmetic stay float32; bf16 elements widen as they load (the prefill tiles widen a run of
 * rows into a float32 buffer first, since they broadcast single elements).
 *
 * Threads: OpenMP, linked against the libgomp.so.1 torch has already loaded, so the parallel loop runs on
 * torch's own worker threads instead of competing with them.
 * Built at first use by native/__init__.py with the system C compiler; without one the torch path runs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define MAX_GROUP 16
#define MAX_HEAD_SIZE 256
#define RUN 16 /* slots per online-softmax step */

#if defined(KV_BF16)
typedef uint16_t kv_t;
static inline float kv_float(kv_t x) {
    const union { uint32_t bits; float value; } widened = {(uint32_t)x << 16};
    return widened.value;
}
#else
typedef float kv_t;
static inline float kv_float(kv_t x) { return x; }
#endif

typedef struct {
    const float *q_all;
    const kv_t *k_cache, *v_cache;
    const int32_t *block_table, *seq_lens;
    int64_t block_table_stride, q_row_stride;
    int start_pos, num_heads, num_kv_heads, head_size, block_size;
    float scale;
    float *out, *lse;
} DecodeArgs;

/* Length of the run of consecutive slots starting at pos (stays inside one block), and its first slot. */
static inline int next_run(int block_size, const int32_t *blocks, int pos, int seq_len, int64_t *slot) {
    const int offset = pos % block_size;
    int n = block_size - offset;
    if (n > seq_len - pos) n = seq_len - pos;
    if (n > RUN) n = RUN;
    *slot = (int64_t)blocks[pos / block_size] * block_size + offset;
    return n;
}

static void decode_item_portable(const DecodeArgs *a, int item) {
    const int req = item / a->num_kv_heads, kv_head = item % a->num_kv_heads;
    const int group = a->num_heads / a->num_kv_heads, d = a->head_size;
    const int32_t *blocks = a->block_table + (int64_t)req * a->block_table_stride;
    const float *q = a->q_all + (int64_t)req * a->q_row_stride + (int64_t)kv_head * group * d;
    const int64_t row_stride = (int64_t)a->num_kv_heads * d; /* floats between consecutive slots */
    const int seq_len = a->seq_lens[req];
    float acc[MAX_GROUP][MAX_HEAD_SIZE], running_max[MAX_GROUP], running_sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
        for (int i = 0; i < d; i++) acc[g][i] = 0.0f;
    }
    for (int pos = a->start_pos; pos < seq_len;) {
        int64_t slot;
        const int n = next_run(a->block_size, blocks, pos, seq_len, &slot);
        const kv_t *k = a->k_cache + slot * row_stride + (int64_t)kv_head * d;
        const kv_t *v = a->v_cache + slot * row_stride + (int64_t)kv_head * d;
        for (int g = 0; g < group; g++) {
            const float *qg = q + (int64_t)g * d;
            float scores[RUN], block_max = running_max[g];
            for (int t = 0; t < n; t++) {
                const kv_t *kt = k + t * row_stride;
                float score = 0.0f;
                for (int i = 0; i < d; i++) score += qg[i] * kv_float(kt[i]);
                scores[t] = score * a->scale;
                if (scores[t] > block_max) block_max = scores[t];
            }
            const float rescale = expf(running_max[g] - block_max);
            float *acc_g = acc[g];
            running_sum[g] *= rescale;
            for (int i = 0; i < d; i++) acc_g[i] *= rescale;
            running_max[g] = block_max;
            for (int t = 0; t < n; t++) {
                const kv_t *vt = v + t * row_stride;
                const float weight = expf(scores[t] - block_max);
                running_sum[g] += weight;
                for (int i = 0; i < d; i++) acc_g[i] += weight * kv_float(vt[i]);
            }
        }
        pos += n;
    }
    for (int g = 0; g < group; g++) {
        const int64_t row = (int64_t)req * a->num_heads + (int64_t)kv_head * group + g;
        const float inv = 1.0f / running_sum[g];
        for (int i = 0; i < d; i++) a->out[row * d + i] = acc[g][i] * inv;
        a->lse[row] = running_max[g] + logf(running_sum[g]);
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>

/* The vector bodies' exp(x) for x <= 0: 2^n * p(r), n = round(x / ln2), r = x - n ln2 (ln2 in two parts),
 * p(r) = 1 + r + r^2 (P5 + r (P4 + r (P3 + r (P2 + r (P1 + r P0))))), ~1e-7 relative error. */
#define EXP_MIN_X -87.0f /* below, exp is taken as exp(-87): 2^n stays a normal float */
#define EXP_LOG2E 1.44269504088896341f
#define EXP_LN2_HI 0.693359375f
#define EXP_LN2_LO -2.12194440e-4f
#define EXP_P0 1.9875691500e-4f
#define EXP_P1 1.3981999507e-3f
#define EXP_P2 8.3334519073e-3f
#define EXP_P3 4.1665795894e-2f
#define EXP_P4 1.6666665459e-1f
#define EXP_P5 5.0000001201e-1f

/* The next run of a decode item: its first K and V rows (the item's head) and its length; n is 0 after the last. */
typedef struct {
    const char *k, *v;
    int64_t row_bytes;
    int n;
} NextRun;

static inline NextRun next_run_rows(const DecodeArgs *a, int64_t slot, int n, int64_t row_stride, int64_t offset) {
    const NextRun next = {(const char *)(a->k_cache + slot * row_stride + offset),
                          (const char *)(a->v_cache + slot * row_stride + offset),
                          row_stride * (int64_t)sizeof(kv_t), n};
    return next;
}

/* Fetch slot t of the next run (the first `lines` cache lines of its K and V rows) into L1. The vector bodies call
 * it for each slot of the current run as they compute its scores, so the fetches are spread over the run: fetched
 * all at once at the run's start they left the loop waiting on memory as long as it computed (Zen 5, a W1-like
 * cache of 64 x 320 slots, 30 layers: 23.1 -> 14.0 ms, medians of 25; without any prefetch 24). */
static inline __attribute__((always_inline)) void prefetch_slot(const NextRun *next, int t, const int lines) {
    if (t >= next->n) return;
    for (int line = 0; line < lines; line++) {
        _mm_prefetch(next->k + t * next->row_bytes + 64 * line, _MM_HINT_T0);
        _mm_prefetch(next->v + t * next->row_bytes + 64 * line, _MM_HINT_T0);
    }
}

/* Cache lines of a head's row of `floats` elements. */
#define ROW_LINES(floats) (((floats) * (int)sizeof(kv_t) + 63) / 64)
#endif

#if defined(__AVX512F__)

/* 16 cache elements as float32. */
static inline __m512 kv_load16(const kv_t *p) {
#if defined(KV_BF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#else
    return _mm512_loadu_ps(p);
#endif
}

/* exp(x) for x <= 0 (scores minus their running max), with the EXP_ constants above; 2^n by scalef. */
static inline __m512 exp_nonpositive(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN_X));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(EXP_LOG2E)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_HI), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(EXP_LN2_LO), r);
    __m512 p = _mm512_set1_ps(EXP_P0);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P1));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P2));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P3));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P4));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(EXP_P5));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* Lane j of the result is the sum of the lanes of v[j]: 16 horizontal sums in 45 instructions. */
static inline __m512 sum16(const __m512 v[16]) {
    __m512 t[8], u[4];
    for (int i = 0; i < 8; i++) /* per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3] */
        t[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++) { /* per 128-bit lane: the lane's sums of four vectors */
        const __m512d lo = _mm512_unpacklo_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]));
        const __m512d hi = _mm512_unpackhi_pd(_mm512_castps_pd(t[2 * i]), _mm512_castps_pd(t[2 * i + 1]));
        u[i] = _mm512_add_ps(_mm512_castpd_ps(lo), _mm512_castpd_ps(hi));
    }
    const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[0], u[1], _MM_SHUFFLE(3, 1, 3, 1)));
    const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(2, 0, 2, 0)),
                                     _mm512_shuffle_f32x4(u[2], u[3], _MM_SHUFFLE(3, 1, 3, 1)));
    return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(w01, w23, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* GROUP query heads per KV head, VD 16-float vectors per head; both constants after inlining, so the
 * accumulators live in registers. */
static inline __attribute__((always_inline)) void decode_item_avx512(const DecodeArgs *a, int item, const int GROUP,
                                                                     const int VD) {
    const int req = item / a->num_kv_heads, kv_head = item % a->num_kv_heads, d = a->head_size;
    const int32_t *blocks = a->block_table + (int64_t)req * a->block_table_stride;
    const float *q = a->q_all + (int64_t)req * a->q_row_stride + (int64_t)kv_head * GROUP * d;
    const int64_t row_stride = (int64_t)a->num_kv_heads * d;
    const int seq_len = a->seq_lens[req];
    __m512 acc[GROUP][VD], qv[GROUP][VD], running_max[GROUP], running_sum[GROUP];
    for (int g = 0; g < GROUP; g++) {
        running_max[g] = _mm512_set1_ps(-INFINITY);
        running_sum[g] = _mm512_setzero_ps();
        for (int j = 0; j < VD; j++) {
            acc[g][j] = _mm512_setzero_ps();
            qv[g][j] = _mm512_mul_ps(_mm512_loadu_ps(q + g * d + 16 * j), _mm512_set1_ps(a->scale));
        }
    }
    int64_t slot, next_slot;
    int next_n = a->start_pos < seq_len ? next_run(a->block_size, blocks, a->start_pos, seq_len, &next_slot) : 0;
    for (int pos = a->start_pos; pos < seq_len;) {
        const int n = next_n;
        slot = next_slot;
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        const kv_t *k = a->k_cache + slot * row_stride + (int64_t)kv_head * d;
        const kv_t *v = a->v_cache + slot * row_stride + (int64_t)kv_head * d;
        pos += n;
        next_n = pos < seq_len ? next_run(a->block_size, blocks, pos, seq_len, &next_slot) : 0;
        const NextRun next = next_run_rows(a, next_slot, next_n, row_stride, (int64_t)kv_head * d);
        float weights[GROUP][RUN];
        for (int g = 0; g < GROUP; g++) {
            __m512 partial[RUN];
            for (int t = 0; t < RUN; t++) {
                if (g == GROUP / 2) prefetch_slot(&next, t, ROW_LINES(16 * VD)); /* mid-run measured best */
                if (t >= n) {
                    partial[t] = _mm512_setzero_ps();
                    continue;
                }
                const kv_t *kt = k + t * row_stride;
                __m512 s = _mm512_mul_ps(qv[g][0], kv_load16(kt));
                for (int j = 1; j < VD; j++) s = _mm512_fmadd_ps(qv[g][j], kv_load16(kt + 16 * j), s);
                partial[t] = s;
            }
            const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, sum16(partial));
            const __m512 new_max = _mm512_max_ps(running_max[g], _mm512_set1_ps(_mm512_reduce_max_ps(scores)));
            const __m512 rescale = exp_nonpositive(_mm512_sub_ps(running_max[g], new_max));
            const __m512 w = _mm512_maskz_mov_ps(valid, exp_nonpositive(_mm512_sub_ps(scores, new_max)));
            running_sum[g] = _mm512_fmadd_ps(running_sum[g], rescale, _mm512_set1_ps(_mm512_reduce_add_ps(w)));
            running_max[g] = new_max;
            for (int j = 0; j < VD; j++) acc[g][j] = _mm512_mul_ps(acc[g][j], rescale);
            _mm512_storeu_ps(weights[g], w);
        }
        for (int t = 0; t < n; t++) {
            const kv_t *vt = v + t * row_stride;
            for (int j = 0; j < VD; j++) {
                const __m512 vv = kv_load16(vt + 16 * j);
                for (int g = 0; g < GROUP; g++)
                    acc[g][j] = _mm512_fmadd_ps(_mm512_set1_ps(weights[g][t]), vv, acc[g][j]);
            }
        }
    }
    for (int g = 0; g < GROUP; g++) {
        const int64_t row = (int64_t)req * a->num_heads + (int64_t)kv_head * GROUP + g;
        const float sum = _mm512_cvtss_f32(running_sum[g]);
        const __m512 inv = _mm512_set1_ps(1.0f / sum);
        for (int j = 0; j < VD; j++) _mm512_storeu_ps(a->out + row * d + 16 * j, _mm512_mul_ps(acc[g][j], inv));
        a->lse[row] = _mm512_cvtss_f32(running_max[g]) + logf(sum);
    }
}

#define VECTOR_FLOATS 16 /* for decode_item_vector below */
#define DECODE_ITEM decode_item_avx512

/* ---- Prefill: tiles of query tokens against their request's cache, in place ----
 * A tile is up to 16 * vecs / group consecutive query tokens of one request with the group's heads: a query
 * vector per lane of vecs (2 or 3, tile_vecs) vector registers, so one broadcast K (or V) element multiplies all
 * of them in vecs FMAs. (An FMA taking its own broadcast from memory runs at ~60% of the FMA rate here; two or
 * more per broadcast run at the full rate.) Groups of 3 (SmolLM2) take 48 lanes, 16 tokens: with 32 they got 10
 * tokens and two idle lanes, and a 32-row cascade batch four tiles with the last two-thirds idle; the W3 cascade
 * call went 26 -> 18-19 ms for 30 layers, W1's 8 x 256-token prefill 197-209 -> 166-167 ms (same outputs).
 * Scores for a run of 16 slots are S[slot] (vecs vectors over the tile's queries) = sum_i
 * K[slot][i] * Q^T[i]; the causal limit of each lane masks what it may not see, the online softmax works
 * lane-wise, and O^T[i] += P[slot] * V[slot][i], the K and V elements read in place from the cache. Needs
 * AVX-512 and a head size of 64 or 128. */
#define MAX_VECS 3                 /* query vectors of 16 lanes per tile: 2 (32 lanes) or 3 (48) */
#define LANE_STRIDE (16 * MAX_VECS) /* floats between a tile's rows of transposed queries */
typedef struct {
    const float *q_all;
    const kv_t *k_cache, *v_cache;
    const int32_t *block_table, *query_start, *query_len, *seq_len;
    const int *tile_start; /* [num_reqs + 1]: tiles before request r */
    int64_t block_table_stride, q_row_stride;
    int num_reqs, start_pos, stop_pos, num_heads, num_kv_heads, block_size, tokens_per_tile, vecs;
    float scale;
    float *out, *lse;
} PrefillArgs;

/* r[i][j] becomes r[j][i]: 64 shuffles (unpack pairs, 4 x 4 blocks inside 128-bit lanes, then the lanes). */
static inline void transpose_16x16(__m512 r[16]) {
    __m512 t[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) { /* r[i + c], lane L: column 4L + c of rows i .. i + 3 */
        r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int c = 0; c < 4; c++) {
        const __m512 u = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512 v = _mm512_shuffle_f32x4(r[c], r[4 + c], _MM_SHUFFLE(3, 1, 3, 1));
        const __m512 w = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(2, 0, 2, 0));
        const __m512 x = _mm512_shuffle_f32x4(r[8 + c], r[12 + c], _MM_SHUFFLE(3, 1, 3, 1));
        t[c] = _mm512_shuffle_f32x4(u, w, _MM_SHUFFLE(2, 0, 2, 0));
        t[8 + c] = _mm512_shuffle_f32x4(u, w, _MM_SHUFFLE(3, 1, 3, 1));
        t[4 + c] = _mm512_shuffle_f32x4(v, x, _MM_SHUFFLE(2, 0, 2, 0));
        t[12 + c] = _mm512_shuffle_f32x4(v, x, _MM_SHUFFLE(3, 1, 3, 1));
    }
    for (int i = 0; i < 16; i++) r[i] = t[i];
}

/* s[j] = sum_i K[j][i] * Q^T[i] for the eight K rows k[j]: 16 sums held in registers. */
static inline __attribute__((always_inline)) void scores_8(const float *qt, const float *const k[8], const int D,
                                                          const int VECS, __m512 s[8][MAX_VECS]) {
    __m512 acc[8][MAX_VECS];
    for (int j = 0; j < 8; j++)
        for (int h = 0; h < VECS; h++) acc[j][h] = _mm512_setzero_ps();
    for (int i = 0; i < D; i++) {
        __m512 qv[MAX_VECS];
        for (int h = 0; h < VECS; h++) qv[h] = _mm512_load_ps(qt + i * LANE_STRIDE + 16 * h);
        for (int j = 0; j < 8; j++) {
            const __m512 kb = _mm512_set1_ps(k[j][i]);
            for (int h = 0; h < VECS; h++) acc[j][h] = _mm512_fmadd_ps(kb, qv[h], acc[j][h]);
        }
    }
    for (int j = 0; j < 8; j++)
        for (int h = 0; h < VECS; h++) s[j][h] = acc[j][h];
}

#if defined(KV_BF16) && defined(__AVX512BF16__)
/* With a bf16 cache on CPUs with AVX512-BF16 the tiles multiply in bf16 pairs (vdpbf16ps: two multiply-adds per
 * float32 lane, twice an FMA's work), as a bfloat16 model's attention does: queries and the softmax weights are
 * rounded to bf16, K and V are read as they lie in the cache, sums stay float32. Scores: lane l of S[slot] +=
 * Q[l][2p] K[slot][2p] + Q[l][2p + 1] K[slot][2p + 1], the K pair one 32-bit broadcast straight from the cache
 * row. Outputs: O^T[i][l] += P[2m][l] V[2m][i] + P[2m + 1][l] V[2m + 1][i], over a run's V rows interleaved
 * into slot pairs once per run. */
#define PAIRED_TILES 1
typedef kv_t tile_elem; /* the tiles read K and V rows as the cache holds them */
#else
typedef float tile_elem; /* the tiles read float32 rows: the cache's, or a bf16 run widened into a buffer */
#endif
#if defined(PAIRED_TILES)

/* (lo[l], hi[l]) rounded to bf16, as the 32-bit lane l. */
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* As scores_8, from qt2 (the queries as bf16 pairs along the head, [D / 2][LANE_STRIDE]) and bf16 K rows. */
static inline __attribute__((always_inline)) void scores_8_pairs(const uint32_t *qt2, const kv_t *const k[8],
                                                                const int D, const int VECS, __m512 s[8][MAX_VECS]) {
    __m512 acc[8][MAX_VECS];
    for (int j = 0; j < 8; j++)
        for (int h = 0; h < VECS; h++) acc[j][h] = _mm512_setzero_ps();
    for (int p = 0; p < D / 2; p++) {
        __m512bh qv[MAX_VECS];
        for (int h = 0; h < VECS; h++) qv[h] = (__m512bh)_mm512_load_si512(qt2 + p * LANE_STRIDE + 16 * h);
        for (int j = 0; j < 8; j++) {
            uint32_t pair;
            memcpy(&pair, k[j] + 2 * p, sizeof pair);
            const __m512bh kb = (__m512bh)_mm512_set1_epi32((int)pair);
            for (int h = 0; h < VECS; h++) acc[j][h] = _mm512_dpbf16_ps(acc[j][h], qv[h], kb);
        }
    }
    for (int j = 0; j < 8; j++)
        for (int h = 0; h < VECS; h++) s[j][h] = acc[j][h];
}

/* vp[m][i] = (V[2m][i], V[2m + 1][i]) for a run's RUN rows v[] (bf16, D of them each). */
static inline __attribute__((always_inline)) void slot_pairs(const kv_t *const v[RUN], const int D,
                                                            uint32_t vp[RUN / 2][D]) {
    /* unpack pairs dims 8L .. 8L + 3 (lo) and 8L + 4 .. 8L + 7 (hi) in each 128-bit lane L: put them in order */
    const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
    const __m512i second = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
    for (int m = 0; m < RUN / 2; m++)
        for (int i = 0; i < D; i += 32) {
            const __m512i a = _mm512_loadu_si512(v[2 * m] + i), b = _mm512_loadu_si512(v[2 * m + 1] + i);
            const __m512i lo = _mm512_unpacklo_epi16(a, b), hi = _mm512_unpackhi_epi16(a, b);
            _mm512_store_si512(vp[m] + i, _mm512_permutex2var_epi32(lo, first, hi));
            _mm512_store_si512(vp[m] + i + 16, _mm512_permutex2var_epi32(lo, second, hi));
        }
}
#endif

static inline __attribute__((always_inline)) void prefill_item_avx512(const PrefillArgs *a, int item, const int D,
                                                                      const int VECS) {
    const int LANES = 16 * VECS;
    const int tile = item / a->num_kv_heads, kv_head = item % a->num_kv_heads;
    int lo = 0, hi = a->num_reqs - 1; /* the request whose tiles include `tile` */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (a->tile_start[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    const int r = lo, group = a->num_heads / a->num_kv_heads;
    const int first = (tile - a->tile_start[r]) * a->tokens_per_tile;
    const int ntok = a->query_len[r] - first < a->tokens_per_tile ? a->query_len[r] - first : a->tokens_per_tile;
    const int lanes = ntok * group, context = a->seq_len[r] - a->query_len[r];
    const int end = context + first + ntok < a->stop_pos ? context + first + ntok : a->stop_pos;
    const int32_t *blocks = a->block_table + (int64_t)r * a->block_table_stride;
    const int64_t row_stride = (int64_t)a->num_kv_heads * D;
    float qt[D][LANE_STRIDE] __attribute__((aligned(64))), ot[D][LANE_STRIDE] __attribute__((aligned(64)));
    int32_t limit[LANE_STRIDE] __attribute__((aligned(64)));
    /* lane n: token n / group, head n % group, its query and output rows (NULL for idle lanes, which see the
     * whole tile) */
    const float *q_lane[LANE_STRIDE];
    int64_t out_row[LANE_STRIDE];
    for (int n = 0; n < LANES; n++) {
        const int t = n / group, g = n % group;
        const int64_t token = (int64_t)a->query_start[r] + first + t;
        limit[n] = n < lanes ? context + first + t + 1 : end;
        q_lane[n] = n < lanes ? a->q_all + token * a->q_row_stride + (int64_t)(kv_head * group + g) * D : NULL;
        out_row[n] = token * a->num_heads + kv_head * group + g;
    }
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int h = 0; h < VECS; h++)
        for (int i0 = 0; i0 < D; i0 += 16) { /* 16 lanes x 16 dims of queries, transposed into qt */
            __m512 block[16];
            for (int m = 0; m < 16; m++) {
                const float *q = q_lane[16 * h + m];
                block[m] = q != NULL ? _mm512_mul_ps(_mm512_loadu_ps(q + i0), scale) : _mm512_setzero_ps();
            }
            transpose_16x16(block);
            for (int m = 0; m < 16; m++) {
                _mm512_store_ps(qt[i0 + m] + 16 * h, block[m]);
                _mm512_store_ps(ot[i0 + m] + 16 * h, _mm512_setzero_ps());
            }
        }
#if defined(PAIRED_TILES)
    uint32_t qt2[D / 2][LANE_STRIDE] __attribute__((aligned(64)));
    for (int p = 0; p < D / 2; p++)
        for (int h = 0; h < VECS; h++)
            _mm512_store_si512(qt2[p] + 16 * h,
                               bf16_pairs(_mm512_load_ps(qt[2 * p] + 16 * h), _mm512_load_ps(qt[2 * p + 1] + 16 * h)));
#endif
    __m512i limits[MAX_VECS];
    __m512 running_max[MAX_VECS], running_sum[MAX_VECS];
    for (int h = 0; h < VECS; h++) {
        limits[h] = _mm512_load_si512(limit + 16 * h);
        running_max[h] = _mm512_set1_ps(-INFINITY);
        running_sum[h] = _mm512_setzero_ps();
    }
    for (int pos = a->start_pos; pos < end;) {
        int64_t slot;
        const int n = next_run(a->block_size, blocks, pos, end, &slot);
        const kv_t *k = a->k_cache + slot * row_stride + (int64_t)kv_head * D;
        const kv_t *v = a->v_cache + slot * row_stride + (int64_t)kv_head * D;
        const tile_elem *krow[RUN], *vrow[RUN]; /* slots past the run read its first row, then are masked */
#if defined(KV_BF16) && !defined(PAIRED_TILES)
        float kbuf[RUN][D] __attribute__((aligned(64))), vbuf[RUN][D] __attribute__((aligned(64)));
        for (int j = 0; j < n; j++)
            for (int i = 0; i < D; i += 16) {
                _mm512_store_ps(kbuf[j] + i, kv_load16(k + j * row_stride + i));
                _mm512_store_ps(vbuf[j] + i, kv_load16(v + j * row_stride + i));
            }
        for (int j = 0; j < RUN; j++) {
            krow[j] = kbuf[j < n ? j : 0];
            vrow[j] = vbuf[j < n ? j : 0];
        }
#else
        for (int j = 0; j < RUN; j++) {
            krow[j] = k + (j < n ? j : 0) * row_stride;
            vrow[j] = v + (j < n ? j : 0) * row_stride;
        }
#endif
        if (pos + n < end) { /* fetch the next run as the decode rows do: W3's cascade 16.3 -> 13.8 ms (30 layers) */
            int64_t next_slot;
            const int next_n = next_run(a->block_size, blocks, pos + n, end, &next_slot);
            const char *nk = (const char *)(a->k_cache + next_slot * row_stride + (int64_t)kv_head * D);
            const char *nv = (const char *)(a->v_cache + next_slot * row_stride + (int64_t)kv_head * D);
            const int64_t row_bytes = row_stride * (int64_t)sizeof(kv_t);
            for (int t = 0; t < next_n; t++)
                for (int j = 0; j < D * (int)sizeof(kv_t); j += 64) {
                    _mm_prefetch(nk + t * row_bytes + j, _MM_HINT_T0);
                    _mm_prefetch(nv + t * row_bytes + j, _MM_HINT_T0);
                }
        }
        __m512 s[RUN][MAX_VECS];
#if defined(PAIRED_TILES)
        scores_8_pairs(qt2[0], krow, D, VECS, s);
        scores_8_pairs(qt2[0], krow + 8, D, VECS, s + 8);
#else
        scores_8(qt[0], krow, D, VECS, s);
        scores_8(qt[0], krow + 8, D, VECS, s + 8);
#endif
        __m512 rescale[MAX_VECS];
        for (int h = 0; h < VECS; h++) {
            __m512 run_max = _mm512_set1_ps(-INFINITY);
            __mmask16 valid[RUN];
            for (int j = 0; j < RUN; j++) {
                valid[j] = j < n ? _mm512_cmplt_epi32_mask(_mm512_set1_epi32(pos + j), limits[h]) : (__mmask16)0;
                s[j][h] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[j], s[j][h]);
                run_max = _mm512_max_ps(run_max, s[j][h]);
            }
            const __m512 new_max = _mm512_max_ps(running_max[h], run_max);
            rescale[h] = exp_nonpositive(_mm512_sub_ps(running_max[h], new_max));
            running_sum[h] = _mm512_mul_ps(running_sum[h], rescale[h]);
            for (int j = 0; j < RUN; j++) {
                s[j][h] = _mm512_maskz_mov_ps(valid[j], exp_nonpositive(_mm512_sub_ps(s[j][h], new_max)));
                running_sum[h] = _mm512_add_ps(running_sum[h], s[j][h]);
            }
            running_max[h] = new_max;
        }
#if defined(PAIRED_TILES)
        uint32_t vp[RUN / 2][D] __attribute__((aligned(64))), pp[RUN / 2][LANE_STRIDE] __attribute__((aligned(64)));
        slot_pairs(vrow, D, vp);
        for (int m = 0; m < RUN / 2; m++)
            for (int h = 0; h < VECS; h++) _mm512_store_si512(pp[m] + 16 * h, bf16_pairs(s[2 * m][h], s[2 * m + 1][h]));
#endif
        for (int i = 0; i < D; i += 8) { /* 16 independent sums: fewer would wait on each FMA's latency */
            __m512 o[8][MAX_VECS];
            for (int u = 0; u < 8; u++)
                for (int h = 0; h < VECS; h++)
                    o[u][h] = _mm512_mul_ps(_mm512_load_ps(ot[i + u] + 16 * h), rescale[h]);
#if defined(PAIRED_TILES)
#pragma GCC unroll 1 /* unrolled, the weights of all slot pairs took the registers and the sums went to the stack */
            for (int m = 0; m < RUN / 2; m++) {
                __m512bh w[MAX_VECS];
                for (int h = 0; h < VECS; h++) w[h] = (__m512bh)_mm512_load_si512(pp[m] + 16 * h);
                for (int u = 0; u < 8; u++) {
                    const __m512bh vb = (__m512bh)_mm512_set1_epi32((int)vp[m][i + u]);
                    for (int h = 0; h < VECS; h++) o[u][h] = _mm512_dpbf16_ps(o[u][h], w[h], vb);
                }
            }
#else
            for (int j = 0; j < RUN; j++)
                for (int u = 0; u < 8; u++) {
                    const __m512 vb = _mm512_set1_ps(vrow[j][i + u]);
                    for (int h = 0; h < VECS; h++) o[u][h] = _mm512_fmadd_ps(s[j][h], vb, o[u][h]);
                }
#endif
            for (int u = 0; u < 8; u++)
                for (int h = 0; h < VECS; h++) _mm512_store_ps(ot[i + u] + 16 * h, o[u][h]);
        }
        pos += n;
    }
    float sums[LANE_STRIDE] __attribute__((aligned(64))), maxes[LANE_STRIDE] __attribute__((aligned(64)));
    for (int h = 0; h < VECS; h++) {
        _mm512_store_ps(sums + 16 * h, running_sum[h]);
        _mm512_store_ps(maxes + 16 * h, running_max[h]);
    }
    for (int n = 0; n < lanes; n++) a->lse[out_row[n]] = maxes[n] + logf(sums[n]);
    for (int h = 0; h < VECS; h++) {
        const __m512 inv = _mm512_div_ps(_mm512_set1_ps(1.0f), running_sum[h]);
        for (int i0 = 0; i0 < D; i0 += 16) { /* back from 16 dims x 16 lanes to the lanes' output rows */
            __m512 block[16];
            for (int m = 0; m < 16; m++) block[m] = _mm512_mul_ps(_mm512_load_ps(ot[i0 + m] + 16 * h), inv);
            transpose_16x16(block);
            for (int m = 0; m < 16; m++)
                if (q_lane[16 * h + m] != NULL) _mm512_storeu_ps(a->out + out_row[16 * h + m] * D + i0, block[m]);
        }
    }
}

static void prefill_item(const PrefillArgs *a, int item, int head_size) {
    if (a->vecs == 3) {
        if (head_size == 64) prefill_item_avx512(a, item, 64, 3);
        else prefill_item_avx512(a, item, 128, 3);
    } else {
        if (head_size == 64) prefill_item_avx512(a, item, 64, 2);
        else prefill_item_avx512(a, item, 128, 2);
    }
}

/* Query vectors per tile: 3 (48 lanes) where whole tokens fill more of them than of 2 (32 lanes), as for groups
 * of 3 (48 lanes hold 16 tokens; 32 only 10, the last two idle), else 2. */
static int tile_vecs(int group) { return (48 / group) * group * 32 > (32 / group) * group * 48 ? 3 : 2; }

int paged_prefill_available(void) { return 1; }

#if defined(PAIRED_TILES)
int paged_prefill_pairs(void) { return 1; }
#else
int paged_prefill_pairs(void) { return 0; }
#endif
#elif defined(__AVX2__) && defined(__FMA__)

/* ---- Decode rows with AVX2 (no AVX-512: e.g. most laptop CPUs) ----
 * The AVX-512 body's algorithm on 8-float vectors. Sixteen registers cannot hold a group's queries and output
 * accumulators, so the loops are turned for the few that fit: scores go slot by slot, one K row loaded once
 * for all the group's heads (queries read from L1), and the output vector by vector, its accumulators in
 * registers across the run's V rows. */

/* 8 cache elements as float32. */
static inline __m256 kv_load8(const kv_t *p) {
#if defined(KV_BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#else
    return _mm256_loadu_ps(p);
#endif
}

/* exp(x) for x <= 0, as exp_nonpositive (the EXP_ constants), 2^n put in the exponent bits (n >= -126). */
static inline __m256 exp8_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN_X));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(EXP_LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_HI), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(EXP_LN2_LO), r);
    __m256 p = _mm256_set1_ps(EXP_P0);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P1));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P2));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P3));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P4));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(EXP_P5));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
    const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* Lane j of the result is the sum of the lanes of v[j]. */
static inline __m256 sum8(const __m256 v[8]) {
    const __m256 ab = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    const __m256 cd = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(ab, cd, 0x20), _mm256_permute2f128_ps(ab, cd, 0x31));
}

static inline float reduce_max8(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

static inline float reduce_add8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* GROUP query heads per KV head, VD 8-float vectors per head: constants after inlining. */
static inline __attribute__((always_inline)) void decode_item_avx2(const DecodeArgs *a, int item, const int GROUP,
                                                                   const int VD) {
    const int req = item / a->num_kv_heads, kv_head = item % a->num_kv_heads, d = a->head_size;
    const int32_t *blocks = a->block_table + (int64_t)req * a->block_table_stride;
    const float *q = a->q_all + (int64_t)req * a->q_row_stride + (int64_t)kv_head * GROUP * d;
    const int64_t row_stride = (int64_t)a->num_kv_heads * d;
    const int seq_len = a->seq_lens[req];
    __m256 qv[GROUP][VD], acc[GROUP][VD], partial[GROUP][RUN];
    float running_max[GROUP], running_sum[GROUP], rescale[GROUP], weights[GROUP][RUN];
    for (int g = 0; g < GROUP; g++) {
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
        for (int j = 0; j < VD; j++) {
            acc[g][j] = _mm256_setzero_ps();
            qv[g][j] = _mm256_mul_ps(_mm256_loadu_ps(q + g * d + 8 * j), _mm256_set1_ps(a->scale));
        }
    }
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t slot, next_slot;
    int next_n = a->start_pos < seq_len ? next_run(a->block_size, blocks, a->start_pos, seq_len, &next_slot) : 0;
    for (int pos = a->start_pos; pos < seq_len;) {
        const int n = next_n;
        slot = next_slot;
        const kv_t *k = a->k_cache + slot * row_stride + (int64_t)kv_head * d;
        const kv_t *v = a->v_cache + slot * row_stride + (int64_t)kv_head * d;
        pos += n;
        next_n = pos < seq_len ? next_run(a->block_size, blocks, pos, seq_len, &next_slot) : 0;
        const NextRun next = next_run_rows(a, next_slot, next_n, row_stride, (int64_t)kv_head * d);
        for (int t = 0; t < RUN; t++) {
            prefetch_slot(&next, t, ROW_LINES(8 * VD));
            if (t >= n) {
                for (int g = 0; g < GROUP; g++) partial[g][t] = _mm256_setzero_ps();
                continue;
            }
            const kv_t *kt = k + t * row_stride;
            __m256 s[GROUP];
            const __m256 k0 = kv_load8(kt);
            for (int g = 0; g < GROUP; g++) s[g] = _mm256_mul_ps(qv[g][0], k0);
            for (int j = 1; j < VD; j++) {
                const __m256 kj = kv_load8(kt + 8 * j);
                for (int g = 0; g < GROUP; g++) s[g] = _mm256_fmadd_ps(qv[g][j], kj, s[g]);
            }
            for (int g = 0; g < GROUP; g++) partial[g][t] = s[g];
        }
        const __m256 valid0 = _mm256_cmp_ps(lane, _mm256_set1_ps((float)n), _CMP_LT_OQ);
        const __m256 valid1 = _mm256_cmp_ps(_mm256_add_ps(lane, _mm256_set1_ps(8.0f)), _mm256_set1_ps((float)n),
                                            _CMP_LT_OQ);
        const __m256 minus_inf = _mm256_set1_ps(-INFINITY);
        for (int g = 0; g < GROUP; g++) {
            const __m256 s0 = _mm256_blendv_ps(minus_inf, sum8(partial[g]), valid0);
            const __m256 s1 = _mm256_blendv_ps(minus_inf, sum8(partial[g] + 8), valid1);
            const float run_max = reduce_max8(_mm256_max_ps(s0, s1));
            const float new_max = run_max > running_max[g] ? run_max : running_max[g];
            const __m256 m = _mm256_set1_ps(new_max);
            const __m256 w0 = _mm256_and_ps(exp8_nonpositive(_mm256_sub_ps(s0, m)), valid0);
            const __m256 w1 = _mm256_and_ps(exp8_nonpositive(_mm256_sub_ps(s1, m)), valid1);
            rescale[g] = expf(running_max[g] - new_max);
            running_sum[g] = running_sum[g] * rescale[g] + reduce_add8(_mm256_add_ps(w0, w1));
            running_max[g] = new_max;
            _mm256_storeu_ps(weights[g], w0);
            _mm256_storeu_ps(weights[g] + 8, w1);
        }
        for (int j = 0; j < VD; j++) {
            __m256 c[GROUP], e[GROUP]; /* even and odd slots: two chains of FMAs, not one twice as long */
            for (int g = 0; g < GROUP; g++) {
                c[g] = _mm256_mul_ps(acc[g][j], _mm256_set1_ps(rescale[g]));
                e[g] = _mm256_setzero_ps();
            }
            int t = 0;
            for (; t + 1 < n; t += 2) {
                const __m256 v0 = kv_load8(v + t * row_stride + 8 * j);
                const __m256 v1 = kv_load8(v + (t + 1) * row_stride + 8 * j);
                for (int g = 0; g < GROUP; g++) {
                    c[g] = _mm256_fmadd_ps(_mm256_set1_ps(weights[g][t]), v0, c[g]);
                    e[g] = _mm256_fmadd_ps(_mm256_set1_ps(weights[g][t + 1]), v1, e[g]);
                }
            }
            if (t < n) {
                const __m256 v0 = kv_load8(v + t * row_stride + 8 * j);
                for (int g = 0; g < GROUP; g++) c[g] = _mm256_fmadd_ps(_mm256_set1_ps(weights[g][t]), v0, c[g]);
            }
            for (int g = 0; g < GROUP; g++) acc[g][j] = _mm256_add_ps(c[g], e[g]);
        }
    }
    for (int g = 0; g < GROUP; g++) {
        const int64_t row = (int64_t)req * a->num_heads + (int64_t)kv_head * GROUP + g;
        const __m256 inv = _mm256_set1_ps(1.0f / running_sum[g]);
        for (int j = 0; j < VD; j++) _mm256_storeu_ps(a->out + row * d + 8 * j, _mm256_mul_ps(acc[g][j], inv));
        a->lse[row] = running_max[g] + logf(running_sum[g]);
    }
}

#define VECTOR_FLOATS 8 /* for decode_item_vector below */
#define DECODE_ITEM decode_item_avx2
#endif

#if !defined(__AVX512F__)
int paged_prefill_available(void) { return 0; }

int paged_prefill_pairs(void) { return 0; }
#endif

#if defined(DECODE_ITEM)
#define HEAD_SIZE_CASES(G)                                                                                   \
    case 256 * (G) + 16: DECODE_ITEM(a, item, G, 16 / VECTOR_FLOATS); return 1;                              \
    case 256 * (G) + 32: DECODE_ITEM(a, item, G, 32 / VECTOR_FLOATS); return 1;                              \
    case 256 * (G) + 64: DECODE_ITEM(a, item, G, 64 / VECTOR_FLOATS); return 1;                              \
    case 256 * (G) + 128: DECODE_ITEM(a, item, G, 128 / VECTOR_FLOATS); return 1;

/* Runs the vector body (VECTOR_FLOATS floats a vector) when (group, head_size) has one: groups up to 8, head
 * sizes 16, 32, 64 and 128; returns 0 when it has not. */
static int decode_item_vector(const DecodeArgs *a, int item) {
    const int group = a->num_heads / a->num_kv_heads;
    switch (256 * group + a->head_size) {
        HEAD_SIZE_CASES(1) HEAD_SIZE_CASES(2) HEAD_SIZE_CASES(3) HEAD_SIZE_CASES(4) HEAD_SIZE_CASES(5)
        HEAD_SIZE_CASES(6) HEAD_SIZE_CASES(7) HEAD_SIZE_CASES(8)
    }
    return 0;
}
#else
static int decode_item_vector(const DecodeArgs *a, int item) { return 0; }
#endif

/* q: [num_reqs, num_heads, head_size], rows q_row_stride floats apart (they may be a view of the fused QKV
 * output); caches: [num_slots, num_kv_heads, head_size]; block_table: [num_reqs, block_table_stride] int32;
 * request r reads positions start_pos .. seq_lens[r]-1 (each seq_lens[r] > start_pos). Writes out
 * [num_reqs, num_heads, head_size] and lse [num_reqs, num_heads]. Returns 0, or -1 for sizes the kernel does
 * not handle. */
int paged_decode_f32(const float *q, int64_t q_row_stride, const kv_t *k_cache, const kv_t *v_cache,
                     const int32_t *block_table, int64_t block_table_stride, const int32_t *seq_lens, int start_pos,
                     float *out, float *lse, int num_reqs, int num_heads, int num_kv_heads, int head_size,
                     int block_size, float scale, int num_threads) {
    if (num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP || head_size > MAX_HEAD_SIZE)
        return -1;
    const DecodeArgs a = {q, k_cache, v_cache, block_table, seq_lens, block_table_stride, q_row_stride, start_pos,
                          num_heads, num_kv_heads, head_size, block_size, scale, out, lse};
    const int items = num_reqs * num_kv_heads;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int item = 0; item < items; item++)
        if (!decode_item_vector(&a, item)) decode_item_portable(&a, item);
    return 0;
}

static int run_prefill(const float *q, int64_t q_row_stride, const kv_t *k_cache, const kv_t *v_cache,
                       const int32_t *block_table, int64_t block_table_stride, const int32_t *query_start,
                       const int32_t *query_len, const int32_t *seq_len, int start_pos, int stop_pos, float *out,
                       float *lse, int num_reqs, int num_heads, int num_kv_heads, int head_size, int block_size,
                       float scale, int num_threads) {
#if defined(__AVX512F__)
    const int group = num_heads % num_kv_heads == 0 ? num_heads / num_kv_heads : 0;
    if (group < 1 || group > 16 || (head_size != 64 && head_size != 128) || num_reqs < 1) return -1;
    const int vecs = tile_vecs(group), tokens_per_tile = 16 * vecs / group;
    int tile_start[num_reqs + 1];
    tile_start[0] = 0;
    for (int r = 0; r < num_reqs; r++)
        tile_start[r + 1] = tile_start[r] + (query_len[r] + tokens_per_tile - 1) / tokens_per_tile;
    const PrefillArgs a = {q, k_cache, v_cache, block_table, query_start, query_len, seq_len, tile_start,
                           block_table_stride, q_row_stride, num_reqs, start_pos, stop_pos, num_heads,
                           num_kv_heads, block_size, tokens_per_tile, vecs, scale, out, lse};
    const int items = tile_start[num_reqs] * num_kv_heads;
    /* Dynamic: a tile's cost grows with its position in the prompt. */
#pragma omp parallel for schedule(dynamic, 1) num_threads(num_threads)
    for (int item = 0; item < items; item++) prefill_item(&a, item, head_size);
    return 0;
#else
    return -1;
#endif
}

/* Query rows of num_reqs prefill chunks: request r's are rows query_start[r] .. + query_len[r] - 1 of q
 * [rows, num_heads, head_size], the last query_len[r] of its seq_len[r] positions; each sees the positions
 * start_pos .. its own. Writes those rows of out [rows, num_heads, head_size] and lse [rows, num_heads].
 * Returns -1 for what it does not handle (no AVX-512, head size not 64 or 128, group > 16). */
int paged_prefill_f32(const float *q, const kv_t *k_cache, const kv_t *v_cache, const int32_t *block_table,
                      int64_t block_table_stride, const int32_t *query_start, const int32_t *query_len,
                      const int32_t *seq_len, int start_pos, float *out, float *lse, int num_reqs, int num_heads,
                      int num_kv_heads, int head_size, int block_size, float scale, int num_threads) {
    return run_prefill(q, (int64_t)num_heads * head_size, k_cache, v_cache, block_table, block_table_stride,
                       query_start, query_len, seq_len, start_pos, INT32_MAX, out, lse, num_reqs, num_heads,
                       num_kv_heads, head_size, block_size, scale, num_threads);
}

/* Cascade attention's shared part: num_rows query rows (q_row_stride floats apart), all after a prefix of
 * prefix_tokens positions that every row's request holds in the blocks block_table starts with, attend to that
 * prefix alone: the prefill tiles over one "request" whose keys stop at the prefix. Writes out
 * [num_rows, num_heads, head_size] and lse [num_rows, num_heads]; -1 as paged_prefill_f32. */
int paged_prefix_f32(const float *q, int64_t q_row_stride, const kv_t *k_cache, const kv_t *v_cache,
                     const int32_t *block_table, int prefix_tokens, int num_rows, float *out, float *lse,
                     int num_heads, int num_kv_heads, int head_size, int block_size, float scale, int num_threads) {
    const int32_t query_start = 0, query_len = num_rows, seq_len = prefix_tokens + num_rows;
    return run_prefill(q, q_row_stride, k_cache, v_cache, block_table, 0, &query_start, &query_len, &seq_len, 0,
                       prefix_tokens, out, lse, 1, num_heads, num_kv_heads, head_size, block_size, scale,
                       num_threads);
}

/* out = the two partial attentions (a and b, each normalised, with their log-sum-exps) merged into the
 * attention over both key sets: weights exp(lse - max), per [row, head] of head_size floats. */
void merge_attn_states_f32(float *out, const float *out_a, const float *lse_a, const float *out_b,
                           const float *lse_b, int64_t rows_heads, int head_size) {
#pragma omp parallel for schedule(static) if (rows_heads * head_size >= 65536)
    for (int64_t i = 0; i < rows_heads; i++) {
        const float m = lse_a[i] > lse_b[i] ? lse_a[i] : lse_b[i];
        const float wa = expf(lse_a[i] - m), wb = expf(lse_b[i] - m), total = wa + wb;
        const float ca = wa / total, cb = wb / total;
        const float *xa = out_a + i * head_size, *xb = out_b + i * head_size;
        float *o = out + i * head_size;
#pragma omp simd
        for (int j = 0; j < head_size; j++) o[j] = xa[j] * ca + xb[j] * cb;
    }
}
