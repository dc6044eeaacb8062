/* Paged attention for decode rows (one query token per request), the history read in place through each request's
 * block table (the layout and dtypes in paged_attention.h): each K/V row is read once and nothing is written but the
 * output, where the torch path gathers every history into new tensors in every layer and step. Work items are
 * (request, KV head); an item keeps the query heads of its group together, so a K/V row loaded once serves all of
 * them, and it walks the history in runs of up to RUN slots with an online softmax (one rescale per run). Where
 * there are too few items for the threads (one or two requests of a few KV heads) and the histories are long, each
 * (request, KV head) is split along its history (flash-decoding's split-K): every split's partial output and
 * log-sum-exp go to scratch and are merged by their log-sum-exps, as two cascade halves are (paged_cascade.c).
 *
 * Three bodies, one built per instruction set (paged_decode_isa() names it): with AVX-512 (groups up to 8, head
 * sizes 16, 32, 64 or 128; groups 1, 2 and 4 also 256) the scores of a run are sixteen vector dot products reduced
 * together by one transpose-and-add tree, the softmax of the run is one vector exp, and the group's output
 * accumulators stay in registers; with AVX2 and FMA (the same sizes) the same on 8-float vectors, its loops turned
 * to fit 16 registers; otherwise, and for other group and head sizes up to MAX_GROUP and MAX_HEAD_SIZE, portable C.
 * The vector bodies fetch the next run into L1 slot by slot while they compute the current one, so memory and
 * arithmetic overlap.
 */
#include <stdlib.h>

#include "paged_attention.h"

typedef struct {
    const float *q_all;
    const kv_t *k_cache, *v_cache;
    const int32_t *block_table, *seq_lens;
    int64_t block_table_stride, q_row_stride;
    int start_pos, window, num_heads, num_kv_heads, head_size, block_size;
    float scale, softcap;             /* scale: the scores'; softcap 0: scores uncapped (paged_attention.h) */
    const float *k_scale, *v_scale;   /* per KV head: what its keys and values are worth per unit they widen to */
    float *out, *lse;
    int splits;                       /* spans per (request, KV head); above 1 they write to the partials */
    float *partial_out, *partial_lse; /* [request, KV head, split, group, head_size] and [..., group] */
} DecodeArgs;

/* What one work item computes: its request's KV head over history positions begin .. end - 1, into the group's
 * output rows (head_size floats apart) and log-sum-exps. */
typedef struct {
    int req, kv_head, begin, end;
    float scale;   /* the scores', its KV head's k_scale folded in */
    float v_scale; /* its KV head's: each output is multiplied by it */
    float *out, *lse;
} DecodeSpan;

/* Item i is (request, KV head, split) in that order. A split is a run-aligned share of the history; the last ones of
 * a short history may be empty (begin == end). */
static inline DecodeSpan decode_span(const DecodeArgs *a, int item) {
    const int group = a->num_heads / a->num_kv_heads, pair = item / a->splits, split = item % a->splits;
    DecodeSpan w;
    w.req = pair / a->num_kv_heads;
    w.kv_head = pair % a->num_kv_heads;
    w.scale = a->scale * a->k_scale[w.kv_head];
    w.v_scale = a->v_scale[w.kv_head];
    const int seq_len = a->seq_lens[w.req];
    w.begin = window_start(a->start_pos, seq_len - 1, a->window);
    w.end = seq_len;
    if (a->splits == 1) {
        w.out = a->out + ((int64_t)w.req * a->num_heads + (int64_t)w.kv_head * group) * a->head_size;
        w.lse = a->lse + (int64_t)w.req * a->num_heads + (int64_t)w.kv_head * group;
        return w;
    }
    const int share = ((seq_len - w.begin + a->splits - 1) / a->splits + RUN - 1) / RUN * RUN;
    w.begin = w.begin + split * share < seq_len ? w.begin + split * share : seq_len;
    w.end = w.begin + share < seq_len ? w.begin + share : seq_len;
    w.out = a->partial_out + (int64_t)item * group * a->head_size;
    w.lse = a->partial_lse + (int64_t)item * group;
    return w;
}

static void decode_item_portable(const DecodeArgs *a, const DecodeSpan *w) {
    const int req = w->req, kv_head = w->kv_head;
    const int group = a->num_heads / a->num_kv_heads, d = a->head_size;
    const int32_t *blocks = a->block_table + (int64_t)req * a->block_table_stride;
    const float *q = a->q_all + (int64_t)req * a->q_row_stride + (int64_t)kv_head * group * d;
    const int64_t row_stride = (int64_t)a->num_kv_heads * KV_ROW(d); /* elements between consecutive slots */
    const int seq_len = w->end, first = w->begin;
    float acc[MAX_GROUP][MAX_HEAD_SIZE], running_max[MAX_GROUP], running_sum[MAX_GROUP];
    for (int g = 0; g < group; g++) {
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
        for (int i = 0; i < d; i++) acc[g][i] = 0.0f;
    }
    for (int pos = first; pos < seq_len;) {
        int64_t slot;
        const int n = next_run(a->block_size, blocks, pos, seq_len, &slot);
        const kv_t *k = a->k_cache + slot * row_stride + (int64_t)kv_head * KV_ROW(d);
        const kv_t *v = a->v_cache + slot * row_stride + (int64_t)kv_head * KV_ROW(d);
        for (int g = 0; g < group; g++) {
            const float *qg = q + (int64_t)g * d;
            float scores[RUN], block_max = running_max[g];
            for (int t = 0; t < n; t++) {
                const kv_t *kt = k + t * row_stride;
                float score = 0.0f;
                for (int i = 0; i < d; i++) score += qg[i] * kv_float(kt[i]);
                scores[t] = score * kv_row_scale(kt, d) * w->scale;
            }
            if (a->softcap > 0.0f)
                for (int t = 0; t < n; t++) scores[t] = softcap1(scores[t], a->softcap);
            for (int t = 0; t < n; t++)
                if (scores[t] > block_max) block_max = scores[t];
            const float rescale = expf(running_max[g] - block_max);
            float *acc_g = acc[g];
            running_sum[g] *= rescale;
            for (int i = 0; i < d; i++) acc_g[i] *= rescale;
            running_max[g] = block_max;
            for (int t = 0; t < n; t++) {
                const kv_t *vt = v + t * row_stride;
                const float weight = expf(scores[t] - block_max), v_weight = weight * kv_row_scale(vt, d);
                running_sum[g] += weight;
                for (int i = 0; i < d; i++) acc_g[i] += v_weight * kv_float(vt[i]);
            }
        }
        pos += n;
    }
    for (int g = 0; g < group; g++) {
        const float inv = w->v_scale / running_sum[g];
        for (int i = 0; i < d; i++) w->out[(int64_t)g * d + i] = acc[g][i] * inv;
        w->lse[g] = running_max[g] + logf(running_sum[g]);
    }
}

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
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

/* Fetch bytes [begin, end) of slot t's K (or V, by row0) row of the next run into L1. The vector bodies fetch the
 * next run slot by slot as they compute the current one, so the fetches are spread over the run (fetched all at
 * once at the run's start, they would leave the loop waiting on memory about as long as it computes): the AVX-512
 * body a slot's K and V rows as it scores (prefetch_slot), the AVX2 body K rows as it scores and V rows as it
 * weights them. */
static inline __attribute__((always_inline)) void prefetch_row_bytes(const char *row0, const NextRun *next, int t,
                                                                     int begin, int end) {
    if (t >= next->n) return;
    for (int offset = begin & ~63; offset < end; offset += 64) _mm_prefetch(row0 + t * next->row_bytes + offset,
                                                                            _MM_HINT_T0);
}

/* The first `lines` cache lines of slot t's K and V rows of the next run. */
static inline __attribute__((always_inline)) void prefetch_slot(const NextRun *next, int t, const int lines) {
    prefetch_row_bytes(next->k, next, t, 0, 64 * lines);
    prefetch_row_bytes(next->v, next, t, 0, 64 * lines);
}

#if defined(KV_ROW_SCALED) && !defined(__AVX512F__) /* the AVX2 body's; the AVX-512 one gathers them */
/* scales[t] = the kv_row_scale of a run's row t (rows row_stride elements apart), 0 past its n rows (whose lanes
 * are masked anyway). */
static inline void run_scales(float scales[RUN], const kv_t *row, int n, int64_t row_stride, int d) {
    for (int t = 0; t < RUN; t++) scales[t] = t < n ? kv_row_scale(row + t * row_stride, d) : 0.0f;
}
#endif

/* Cache lines of a head's row of `elements`. */
#define ROW_LINES(elements) (((elements) * (int)sizeof(kv_t) + 63) / 64)
#endif

#if defined(__AVX512F__)

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
static inline __attribute__((always_inline)) void decode_item_avx512(const DecodeArgs *a, const DecodeSpan *w,
                                                                     const int GROUP, const int VD) {
    const int req = w->req, kv_head = w->kv_head, d = a->head_size;
    const int32_t *blocks = a->block_table + (int64_t)req * a->block_table_stride;
    const float *q = a->q_all + (int64_t)req * a->q_row_stride + (int64_t)kv_head * GROUP * d;
    const int64_t row_stride = (int64_t)a->num_kv_heads * KV_ROW(d);
    const int seq_len = w->end, first = w->begin;
    __m512 acc[GROUP][VD], qv[GROUP][VD], running_max[GROUP], running_sum[GROUP];
    for (int g = 0; g < GROUP; g++) {
        running_max[g] = _mm512_set1_ps(-INFINITY);
        running_sum[g] = _mm512_setzero_ps();
        for (int j = 0; j < VD; j++) {
            acc[g][j] = _mm512_setzero_ps();
            qv[g][j] = _mm512_mul_ps(_mm512_loadu_ps(q + g * d + 16 * j), _mm512_set1_ps(w->scale * KV_WIDEN_SCALE));
        }
    }
#if defined(KV_ROW_SCALED) /* byte offsets of a run's rows' scales from its first row */
    const __m512i scale_at = _mm512_add_epi32(
        _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                           _mm512_set1_epi32((int)(row_stride * (int64_t)sizeof(kv_t)))),
        _mm512_set1_epi32(d * (int)sizeof(kv_t)));
#endif
    int64_t slot, next_slot;
    int next_n = first < seq_len ? next_run(a->block_size, blocks, first, seq_len, &next_slot) : 0;
    for (int pos = first; pos < seq_len;) {
        const int n = next_n;
        slot = next_slot;
        const __mmask16 valid = (__mmask16)((1u << n) - 1u);
        const kv_t *k = a->k_cache + slot * row_stride + (int64_t)kv_head * KV_ROW(d);
        const kv_t *v = a->v_cache + slot * row_stride + (int64_t)kv_head * KV_ROW(d);
        pos += n;
        next_n = pos < seq_len ? next_run(a->block_size, blocks, pos, seq_len, &next_slot) : 0;
        const NextRun next = next_run_rows(a, next_slot, next_n, row_stride, (int64_t)kv_head * KV_ROW(d));
#if defined(KV_ROW_SCALED) /* the run's rows' scales, 0 past its n rows (whose lanes are masked anyway) */
        const __m512 k_scale = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, scale_at, k, 1);
        const __m512 v_scale = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), valid, scale_at, v, 1);
#endif
        float weights[GROUP][RUN];
        for (int g = 0; g < GROUP; g++) {
            __m512 partial[RUN];
            for (int t = 0; t < RUN; t++) {
                /* from the middle head, where the fetches hide best */
                if (g == GROUP / 2) prefetch_slot(&next, t, ROW_LINES(KV_ROW(16 * VD)));
                if (t >= n) {
                    partial[t] = _mm512_setzero_ps();
                    continue;
                }
                const kv_t *kt = k + t * row_stride;
                __m512 s = _mm512_mul_ps(qv[g][0], kv_load16(kt));
                for (int j = 1; j < VD; j++) s = _mm512_fmadd_ps(qv[g][j], kv_load16(kt + 16 * j), s);
                partial[t] = s;
            }
#if defined(KV_ROW_SCALED)
            __m512 raw = _mm512_mul_ps(sum16(partial), k_scale);
#else
            __m512 raw = sum16(partial);
#endif
            if (a->softcap > 0.0f) raw = softcap16(raw, a->softcap);
            const __m512 scores = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid, raw);
            const __m512 new_max = _mm512_max_ps(running_max[g], _mm512_set1_ps(_mm512_reduce_max_ps(scores)));
            const __m512 rescale = exp16_nonpositive(_mm512_sub_ps(running_max[g], new_max));
            const __m512 w = _mm512_maskz_mov_ps(valid, exp16_nonpositive(_mm512_sub_ps(scores, new_max)));
            running_sum[g] = _mm512_fmadd_ps(running_sum[g], rescale, _mm512_set1_ps(_mm512_reduce_add_ps(w)));
            running_max[g] = new_max;
            for (int j = 0; j < VD; j++) acc[g][j] = _mm512_mul_ps(acc[g][j], rescale);
#if defined(KV_ROW_SCALED)
            _mm512_storeu_ps(weights[g], _mm512_mul_ps(w, v_scale)); /* V rows' weights: the softmax's times scale */
#else
            _mm512_storeu_ps(weights[g], w);
#endif
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
        const float sum = _mm512_cvtss_f32(running_sum[g]);
        const __m512 inv = _mm512_set1_ps(KV_WIDEN_SCALE * w->v_scale / sum);
        for (int j = 0; j < VD; j++) _mm512_storeu_ps(w->out + g * d + 16 * j, _mm512_mul_ps(acc[g][j], inv));
        w->lse[g] = _mm512_cvtss_f32(running_max[g]) + logf(sum);
    }
}

#define VECTOR_FLOATS 16 /* for decode_item_vector below */
#define DECODE_ITEM decode_item_avx512
#elif defined(__AVX2__) && defined(__FMA__)

/* ---- Decode rows with AVX2 (no AVX-512: e.g. most laptop CPUs) ----
 * The AVX-512 body's algorithm on 8-float vectors. Sixteen registers cannot hold a group's queries and output
 * accumulators, so the loops are turned for the few that fit: scores go slot by slot, one K row loaded once
 * for all the group's heads (queries read from L1), and the output a few vectors at a time for all the group's
 * heads, those accumulators in registers across the run's V rows. The next run's K rows are fetched while this
 * one is scored and its V rows while this one's are weighted, so the fetches spread over the whole run. Arrays
 * the loops keep in registers have fixed sizes: GCC leaves a variable-length one (GROUP is a variable until the
 * body is inlined) in memory, each accumulator then loaded and stored around its FMA. */

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

#define OUT_CHUNK 4 /* the most output vectors a head's accumulators take at a time (GROUP x chunk in registers) */

/* GROUP query heads per KV head, VD 8-float vectors per head: constants after inlining. */
static inline __attribute__((always_inline)) void decode_item_avx2(const DecodeArgs *a, const DecodeSpan *w,
                                                                   const int GROUP, const int VD) {
    const int req = w->req, kv_head = w->kv_head, d = a->head_size;
    const int32_t *blocks = a->block_table + (int64_t)req * a->block_table_stride;
    const float *q = a->q_all + (int64_t)req * a->q_row_stride + (int64_t)kv_head * GROUP * d;
    const int64_t row_stride = (int64_t)a->num_kv_heads * KV_ROW(d);
    const int seq_len = w->end, first = w->begin;
    __m256 qv[GROUP][VD], acc[GROUP][VD], partial[GROUP][RUN];
    float running_max[GROUP], running_sum[GROUP], rescale[GROUP], weights[GROUP][RUN];
    for (int g = 0; g < GROUP; g++) {
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
        for (int j = 0; j < VD; j++) {
            acc[g][j] = _mm256_setzero_ps();
            qv[g][j] = _mm256_mul_ps(_mm256_loadu_ps(q + g * d + 8 * j), _mm256_set1_ps(w->scale * KV_WIDEN_SCALE));
        }
    }
    const __m256 lane = _mm256_setr_ps(0, 1, 2, 3, 4, 5, 6, 7);
    int64_t slot, next_slot;
    int next_n = first < seq_len ? next_run(a->block_size, blocks, first, seq_len, &next_slot) : 0;
    for (int pos = first; pos < seq_len;) {
        const int n = next_n;
        slot = next_slot;
        const kv_t *k = a->k_cache + slot * row_stride + (int64_t)kv_head * KV_ROW(d);
        const kv_t *v = a->v_cache + slot * row_stride + (int64_t)kv_head * KV_ROW(d);
        pos += n;
        next_n = pos < seq_len ? next_run(a->block_size, blocks, pos, seq_len, &next_slot) : 0;
        const NextRun next = next_run_rows(a, next_slot, next_n, row_stride, (int64_t)kv_head * KV_ROW(d));
#if defined(KV_ROW_SCALED)
        float k_scale[RUN], v_scale[RUN];
        run_scales(k_scale, k, n, row_stride, d);
        run_scales(v_scale, v, n, row_stride, d);
#endif
        for (int t = 0; t < RUN; t++) {
            prefetch_row_bytes(next.k, &next, t, 0, KV_ROW(8 * VD) * (int)sizeof(kv_t));
            if (t >= n) {
                for (int g = 0; g < GROUP; g++) partial[g][t] = _mm256_setzero_ps();
                continue;
            }
            const kv_t *kt = k + t * row_stride;
            __m256 s[MAX_GROUP];
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
#if defined(KV_ROW_SCALED)
            __m256 raw0 = _mm256_mul_ps(sum8(partial[g]), _mm256_loadu_ps(k_scale));
            __m256 raw1 = _mm256_mul_ps(sum8(partial[g] + 8), _mm256_loadu_ps(k_scale + 8));
#else
            __m256 raw0 = sum8(partial[g]), raw1 = sum8(partial[g] + 8);
#endif
            if (a->softcap > 0.0f) {
                raw0 = softcap8(raw0, a->softcap);
                raw1 = softcap8(raw1, a->softcap);
            }
            const __m256 s0 = _mm256_blendv_ps(minus_inf, raw0, valid0);
            const __m256 s1 = _mm256_blendv_ps(minus_inf, raw1, valid1);
            const float run_max = reduce_max8(_mm256_max_ps(s0, s1));
            const float new_max = run_max > running_max[g] ? run_max : running_max[g];
            const __m256 m = _mm256_set1_ps(new_max);
            const __m256 w0 = _mm256_and_ps(exp8_nonpositive(_mm256_sub_ps(s0, m)), valid0);
            const __m256 w1 = _mm256_and_ps(exp8_nonpositive(_mm256_sub_ps(s1, m)), valid1);
            rescale[g] = expf(running_max[g] - new_max);
            running_sum[g] = running_sum[g] * rescale[g] + reduce_add8(_mm256_add_ps(w0, w1));
            running_max[g] = new_max;
#if defined(KV_ROW_SCALED) /* V rows' weights: the softmax's times their scales */
            _mm256_storeu_ps(weights[g], _mm256_mul_ps(w0, _mm256_loadu_ps(v_scale)));
            _mm256_storeu_ps(weights[g] + 8, _mm256_mul_ps(w1, _mm256_loadu_ps(v_scale + 8)));
#else
            _mm256_storeu_ps(weights[g], w0);
            _mm256_storeu_ps(weights[g] + 8, w1);
#endif
        }
        /* The output CH vectors at a time for all the group's heads: GROUP x CH accumulator chains in registers
         * across the run's V rows, each slot's weights broadcast once per chunk rather than once per vector. */
        const int CH = GROUP == 1 ? (VD < OUT_CHUNK ? VD : OUT_CHUNK) : GROUP <= 6 ? 2 : 1;
        for (int j0 = 0; j0 < VD; j0 += CH) {
            __m256 c[MAX_GROUP][OUT_CHUNK]; /* fixed sizes, not VLAs: kept in registers once the loops unroll */
            for (int g = 0; g < GROUP; g++) {
                const __m256 r = _mm256_set1_ps(rescale[g]);
                for (int j = 0; j < CH; j++) c[g][j] = _mm256_mul_ps(acc[g][j0 + j], r);
            }
            const int fetch_begin = 8 * j0 * (int)sizeof(kv_t);
            const int fetch_end = (j0 + CH < VD ? 8 * (j0 + CH) : KV_ROW(8 * VD)) * (int)sizeof(kv_t);
            for (int t = n; t < next.n; t++) prefetch_row_bytes(next.v, &next, t, fetch_begin, fetch_end);
            for (int t = 0; t < n; t++) {
                prefetch_row_bytes(next.v, &next, t, fetch_begin, fetch_end);
                const kv_t *vt = v + t * row_stride + 8 * j0;
                __m256 wt[MAX_GROUP];
                for (int g = 0; g < GROUP; g++) wt[g] = _mm256_set1_ps(weights[g][t]);
                for (int j = 0; j < CH; j++) {
                    const __m256 vj = kv_load8(vt + 8 * j);
                    for (int g = 0; g < GROUP; g++) c[g][j] = _mm256_fmadd_ps(wt[g], vj, c[g][j]);
                }
            }
            for (int g = 0; g < GROUP; g++)
                for (int j = 0; j < CH; j++) acc[g][j0 + j] = c[g][j];
        }
    }
    for (int g = 0; g < GROUP; g++) {
        const __m256 inv = _mm256_set1_ps(KV_WIDEN_SCALE * w->v_scale / running_sum[g]);
        for (int j = 0; j < VD; j++) _mm256_storeu_ps(w->out + g * d + 8 * j, _mm256_mul_ps(acc[g][j], inv));
        w->lse[g] = running_max[g] + logf(running_sum[g]);
    }
}

#define VECTOR_FLOATS 8 /* for decode_item_vector below */
#define DECODE_ITEM decode_item_avx2
#endif

#if defined(DECODE_ITEM)
#define HEAD_SIZE_CASES(G)                                                                                   \
    case 512 * (G) + 16: DECODE_ITEM(a, w, G, 16 / VECTOR_FLOATS); return 1;                                 \
    case 512 * (G) + 32: DECODE_ITEM(a, w, G, 32 / VECTOR_FLOATS); return 1;                                 \
    case 512 * (G) + 64: DECODE_ITEM(a, w, G, 64 / VECTOR_FLOATS); return 1;                                 \
    case 512 * (G) + 128: DECODE_ITEM(a, w, G, 128 / VECTOR_FLOATS); return 1;
/* Head size 256 (the Gemmas') for the groups their checkpoints have: the accumulators spill, still far ahead of the
 * portable body. */
#define HEAD_SIZE_256_CASE(G) case 512 * (G) + 256: DECODE_ITEM(a, w, G, 256 / VECTOR_FLOATS); return 1;

/* Runs the vector body (VECTOR_FLOATS floats a vector) when (group, head_size) has one: groups up to 8 with head
 * sizes 16, 32, 64 and 128, groups 1, 2 and 4 with 256; returns 0 when it has not. */
static int decode_item_vector(const DecodeArgs *a, const DecodeSpan *w) {
    const int group = a->num_heads / a->num_kv_heads;
    switch (512 * group + a->head_size) {
        HEAD_SIZE_CASES(1) HEAD_SIZE_CASES(2) HEAD_SIZE_CASES(3) HEAD_SIZE_CASES(4) HEAD_SIZE_CASES(5)
        HEAD_SIZE_CASES(6) HEAD_SIZE_CASES(7) HEAD_SIZE_CASES(8)
        HEAD_SIZE_256_CASE(1) HEAD_SIZE_256_CASE(2) HEAD_SIZE_256_CASE(4)
    }
    return 0;
}
#else
static int decode_item_vector(const DecodeArgs *a, const DecodeSpan *w) {
    (void)a, (void)w;
    return 0; /* no vector body in this build */
}
#endif

/* Spans per (request, KV head): 1 where the pairs give every thread a few items or the histories are short;
 * otherwise enough for about MIN_ITEMS_PER_THREAD items a thread, each at least MIN_SPLIT positions. */
#define MIN_ITEMS_PER_THREAD 4
#define MIN_SPLIT 128
#define MAX_SPLITS 64
static int decode_splits(const int32_t *seq_lens, int num_reqs, int start_pos, int pairs, int num_threads) {
    if (num_threads <= 1 || pairs >= MIN_ITEMS_PER_THREAD * num_threads) return 1;
    int longest = 0;
    for (int r = 0; r < num_reqs; r++) longest = seq_lens[r] - start_pos > longest ? seq_lens[r] - start_pos : longest;
    int splits = (MIN_ITEMS_PER_THREAD * num_threads + pairs - 1) / pairs;
    if (splits > longest / MIN_SPLIT) splits = longest / MIN_SPLIT;
    return splits < 1 ? 1 : splits > MAX_SPLITS ? MAX_SPLITS : splits;
}

/* Output row `row` (request row / num_heads, head row % num_heads) from its splits: each split's output weighted by
 * exp(its lse - the largest), over their sum; the lse of the whole. */
static void merge_splits(const DecodeArgs *a, int row) {
    const int group = a->num_heads / a->num_kv_heads, d = a->head_size;
    const int req = row / a->num_heads, head = row % a->num_heads, kv_head = head / group, g = head % group;
    const int64_t first = ((int64_t)req * a->num_kv_heads + kv_head) * a->splits; /* the pair's first item */
    float top = -INFINITY;
    for (int s = 0; s < a->splits; s++) {
        const float l = a->partial_lse[(first + s) * group + g];
        top = l > top ? l : top;
    }
    float *o = a->out + (int64_t)row * d, total = 0.0f;
    memset(o, 0, (size_t)d * sizeof(float));
    for (int s = 0; s < a->splits; s++) {
        const float l = a->partial_lse[(first + s) * group + g];
        if (l == -INFINITY) continue;
        const float weight = expf(l - top);
        const float *p = a->partial_out + ((first + s) * group + g) * d;
        total += weight;
#pragma omp simd
        for (int i = 0; i < d; i++) o[i] += weight * p[i];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int i = 0; i < d; i++) o[i] *= inv;
    a->lse[row] = top + logf(total);
}

/* q: [num_reqs, num_heads, head_size], rows q_row_stride floats apart (they may be a view of the fused QKV
 * output); caches: [num_slots, num_kv_heads, head_size]; block_table: [num_reqs, block_table_stride] int32;
 * request r reads positions window_start(start_pos, seq_lens[r] - 1, window) .. seq_lens[r]-1 (each seq_lens[r] >
 * start_pos; window 0: no window, see paged_attention.h), its scores soft-capped at softcap (0: not), KV head h's keys
 * and values worth k_scale[h] and v_scale[h] times what they widen to (paged_attention.h). Writes out
 * [num_reqs, num_heads, head_size] and lse [num_reqs, num_heads]. Returns 0, or -1 for sizes the kernel does
 * not handle. */
int paged_decode_f32(const float *q, int64_t q_row_stride, const kv_t *k_cache, const kv_t *v_cache,
                     const int32_t *block_table, int64_t block_table_stride, const int32_t *seq_lens, int start_pos,
                     int window, float *out, float *lse, int num_reqs, int num_heads, int num_kv_heads, int head_size,
                     int block_size, float scale, float softcap, const float *k_scale, const float *v_scale,
                     int num_threads) {
    if (num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP || head_size > MAX_HEAD_SIZE)
        return -1;
    if (num_reqs == 0) return 0; /* an empty batch: nothing to write (decode_splits divides by the items) */
    DecodeArgs a = {q, k_cache, v_cache, block_table, seq_lens, block_table_stride, q_row_stride, start_pos,
                    window, num_heads, num_kv_heads, head_size, block_size, scale, softcap, k_scale, v_scale, out,
                    lse, 1, NULL, NULL};
    const int pairs = num_reqs * num_kv_heads, group = num_heads / num_kv_heads;
    a.splits = decode_splits(seq_lens, num_reqs, start_pos, pairs, num_threads);
    if (a.splits > 1) {
        a.partial_out = malloc((size_t)pairs * a.splits * group * head_size * sizeof(float));
        a.partial_lse = malloc((size_t)pairs * a.splits * group * sizeof(float));
        if (a.partial_out == NULL || a.partial_lse == NULL) { /* unsplit, then */
            free(a.partial_out);
            free(a.partial_lse);
            a.splits = 1;
        }
    }
    const int items = pairs * a.splits;
#pragma omp parallel num_threads(num_threads)
    {
#pragma omp for schedule(static)
        for (int item = 0; item < items; item++) {
            const DecodeSpan w = decode_span(&a, item);
            if (w.begin == w.end) { /* an empty split: no weight in the merge */
                for (int g = 0; g < group; g++) w.lse[g] = -INFINITY;
                memset(w.out, 0, (size_t)group * head_size * sizeof(float));
            } else if (!decode_item_vector(&a, &w)) {
                decode_item_portable(&a, &w);
            }
        }
        if (a.splits > 1) {
#pragma omp for schedule(static)
            for (int row = 0; row < num_reqs * num_heads; row++) merge_splits(&a, row);
        }
    }
    free(a.partial_out);
    free(a.partial_lse);
    return 0;
}

/* The body this build runs for the group and head sizes the vector bodies take. */
const char *paged_decode_isa(void) {
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX2__) && defined(__FMA__)
    return "avx2";
#else
    return "portable";
#endif
}
