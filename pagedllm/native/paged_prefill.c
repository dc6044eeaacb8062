/* Paged attention for prefill chunks: tiles of a chunk's query tokens against their request's history, read in
 * place through its block table (the layout and dtypes in paged_attention.h), so nothing is gathered and no K/V head
 * is repeated for grouped queries; a tile's query heads share each K/V element loaded. Also the engine of cascade
 * attention's shared part (paged_cascade.c), which is these tiles over a prefix. AVX-512 or AVX2 with FMA:
 * paged_prefill_available() says whether this build has the tiles, paged_prefill_supports() which sizes they take,
 * paged_prefill_pairs() whether they multiply in bf16 pairs, paged_prefill_amx() whether those pairs go to AMX tiles.
 */
#include "paged_attention.h"
#include "amx.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))

/* ---- Prefill: tiles of query tokens against their request's cache, in place ----
 * A tile is up to VEC_LANES * vecs / group consecutive query tokens of one request with the group's heads: a query
 * vector per lane of vecs (2 or 3, tile_vecs) vector registers, so one broadcast K (or V) element multiplies all
 * of them in vecs FMAs (an FMA taking its own broadcast from memory runs well below the FMA rate; two or more per
 * broadcast run at it). Groups of 3 (SmolLM2) take 48 lanes on AVX-512, 16 tokens: 32 lanes would hold 10 tokens
 * and leave two idle.
 * Scores for a run of 16 slots are S[slot] (vecs vectors over the tile's queries) = sum_i
 * K[slot][i] * Q^T[i]; the causal limit of each lane (and under a sliding window its lower bound) masks what it
 * may not see, the online softmax works lane-wise, and O^T[i] += P[slot] * V[slot][i], the K and V elements read
 * in place from the cache. Needs a head size of 64, 128 or 256 (prefill_takes). Two bodies: AVX-512 (16 lanes a
 * vector) and AVX2 (8 lanes, the same steps on fewer registers). */
#if defined(__AVX512F__)
#define VEC_LANES 16
#else
#define VEC_LANES 8
#endif
#define MAX_VECS 3                        /* query vectors per tile: 2 or 3 */
#define LANE_STRIDE (VEC_LANES * MAX_VECS) /* floats between a tile's rows of transposed queries */
typedef struct {
    const float *q_all;
    const kv_t *k_cache, *v_cache;
    const int32_t *block_table, *query_start, *query_len, *seq_len;
    const int *tile_start; /* [num_reqs + 1]: tiles before request r */
    int64_t block_table_stride, q_row_stride;
    int num_reqs, start_pos, stop_pos, window, num_heads, num_kv_heads, block_size, tokens_per_tile, vecs;
    float scale, softcap;           /* scale: the scores'; softcap 0: scores uncapped (paged_attention.h) */
    const float *k_scale, *v_scale; /* per KV head: what its keys and values are worth per unit they widen to */
    float *out, *lse;
    int amx; /* the tiles multiply on AMX (prefill_item_amx) */
} PrefillArgs;

/* Where one tile (a work item: a tile of a request's query tokens, for one KV head) reads and writes. */
typedef struct {
    int kv_head, lanes; /* lanes holding a query (the rest idle) */
    float scale;        /* the scores', its KV head's k_scale folded in */
    float v_scale;      /* its KV head's: each output is multiplied by it */
    int begin, end;     /* the positions the tile reads */
    const int32_t *blocks;
    int64_t row_stride; /* cache elements between slots */
    /* lane n: token n / group, head n % group; the positions it sees are lower[n] .. limit[n] - 1 (idle lanes: the
     * whole tile's); its query row (NULL for idle lanes) and its output row */
    int32_t limit[LANE_STRIDE] __attribute__((aligned(64))), lower[LANE_STRIDE] __attribute__((aligned(64)));
    const float *q_lane[LANE_STRIDE];
    int64_t out_row[LANE_STRIDE];
} TileLanes;

/* Lay out item's tile over `lanes_in_tile` lanes. The tile reads from its first token's window start on; under a
 * window, a later token's lanes mask what lies below their own (window_start in paged_attention.h). A lane that has
 * seen nothing but masked slots keeps a running max of -inf and sums of 0 (its rescale is 1: rescale16). */
static inline void tile_lanes(const PrefillArgs *a, int item, int lanes_in_tile, int D, TileLanes *t) {
    const int tile = item / a->num_kv_heads;
    int lo = 0, hi = a->num_reqs - 1; /* the request whose tiles include `tile` */
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (a->tile_start[mid] <= tile) lo = mid; else hi = mid - 1;
    }
    const int r = lo, group = a->num_heads / a->num_kv_heads;
    const int first = (tile - a->tile_start[r]) * a->tokens_per_tile;
    const int ntok = a->query_len[r] - first < a->tokens_per_tile ? a->query_len[r] - first : a->tokens_per_tile;
    const int context = a->seq_len[r] - a->query_len[r];
    t->kv_head = item % a->num_kv_heads;
    t->scale = a->scale * a->k_scale[t->kv_head];
    t->v_scale = a->v_scale[t->kv_head];
    t->lanes = ntok * group;
    t->end = context + first + ntok < a->stop_pos ? context + first + ntok : a->stop_pos;
    t->blocks = a->block_table + (int64_t)r * a->block_table_stride;
    t->row_stride = (int64_t)a->num_kv_heads * KV_ROW(D);
    t->begin = window_start(a->start_pos, context + first, a->window);
    for (int n = 0; n < lanes_in_tile; n++) {
        const int tok = n / group, g = n % group;
        const int64_t token = (int64_t)a->query_start[r] + first + tok;
        const int used = n < t->lanes;
        t->limit[n] = used ? context + first + tok + 1 : t->end;
        t->lower[n] = used ? window_start(a->start_pos, context + first + tok, a->window) : t->begin;
        t->q_lane[n] = used ? a->q_all + token * a->q_row_stride + (int64_t)(t->kv_head * group + g) * D : NULL;
        t->out_row[n] = token * a->num_heads + t->kv_head * group + g;
    }
}

/* Positions [from, to) that every lane of a tile sees (idle lanes see the tile's whole range): a run within them
 * needs no lane's mask, as most of a long prompt's runs (below its diagonal, inside any window). */
typedef struct {
    int from, to;
} SeenByAll;

static inline SeenByAll seen_by_all(const TileLanes *t, int lanes) {
    SeenByAll all = {t->begin, t->end};
    for (int n = 0; n < lanes; n++) {
        all.from = t->lower[n] > all.from ? t->lower[n] : all.from;
        all.to = t->limit[n] < all.to ? t->limit[n] : all.to;
    }
    return all;
}

/* The K and V rows of the run of n slots from `slot` for the tile's KV head. */
static inline const kv_t *run_rows(const kv_t *cache, const TileLanes *t, int64_t slot, int D) {
    return cache + slot * t->row_stride + (int64_t)t->kv_head * KV_ROW(D);
}

/* Fetch the run after the one at pos (n slots) into L1 while this one is computed. */
static inline void fetch_next_run(const PrefillArgs *a, const TileLanes *t, int pos, int n, int D) {
    if (pos + n >= t->end) return;
    int64_t next_slot;
    const int next_n = next_run(a->block_size, t->blocks, pos + n, t->end, &next_slot);
    const char *nk = (const char *)run_rows(a->k_cache, t, next_slot, D);
    const char *nv = (const char *)run_rows(a->v_cache, t, next_slot, D);
    const int64_t row_bytes = t->row_stride * (int64_t)sizeof(kv_t);
    for (int j = 0; j < next_n; j++)
        for (int b = 0; b < KV_ROW(D) * (int)sizeof(kv_t); b += 64) {
            _mm_prefetch(nk + j * row_bytes + b, _MM_HINT_T0);
            _mm_prefetch(nv + j * row_bytes + b, _MM_HINT_T0);
        }
}

/* Each lane's log-sum-exp into a->lse from its running max and sum. */
static inline void store_lse(const PrefillArgs *a, const TileLanes *t, const float *maxes, const float *sums) {
    for (int n = 0; n < t->lanes; n++) a->lse[t->out_row[n]] = maxes[n] + logf(sums[n]);
}
#endif

#if defined(__AVX512F__)
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

#if (defined(KV_BF16) || defined(KV_ONE_BYTE)) && defined(__AVX512BF16__)
/* With a bf16 cache on CPUs with AVX512-BF16 the tiles multiply in bf16 pairs (vdpbf16ps: two multiply-adds per
 * float32 lane, twice an FMA's work), as a bfloat16 model's attention does: queries and the softmax weights are
 * rounded to bf16, K and V are read as they lie in the cache, sums stay float32. Scores: lane l of S[slot] +=
 * Q[l][2p] K[slot][2p] + Q[l][2p + 1] K[slot][2p + 1], the K pair one 32-bit broadcast straight from the cache
 * row. Outputs: O^T[i][l] += P[2m][l] V[2m][i] + P[2m + 1][l] V[2m + 1][i], over a run's V rows interleaved
 * into slot pairs once per run. A one-byte cache's run is widened into bf16 rows first (fp8 exactly; an int8
 * element's code x scale rounded to bf16, well inside the int8 step). */
#define PAIRED_TILES 1
#if defined(KV_BF16)
typedef kv_t tile_elem; /* the tiles read K and V rows as the cache holds them */
#else
typedef uint16_t tile_elem; /* bf16 rows: a one-byte run widened into a buffer */
#endif
#else
typedef float tile_elem; /* the tiles read float32 rows: the cache's, or any other run widened into a buffer */
#endif

/* A cache row's D elements widened and scaled (kv_row_scale) into a row of a run's buffer: bf16 for the paired
 * tiles, else float32. */
static inline void widen_row(tile_elem *to, const kv_t *row, const int D) {
    const __m512 scale = _mm512_set1_ps(kv_row_scale(row, D));
    for (int i = 0; i < D; i += 16) {
        const __m512 x = _mm512_mul_ps(kv_load16(row + i), scale);
#if defined(PAIRED_TILES)
        _mm256_store_si256((__m256i *)(to + i), (__m256i)_mm512_cvtneps_pbh(x));
#else
        _mm512_store_ps(to + i, x);
#endif
    }
}
#if defined(PAIRED_TILES)

/* (lo[l], hi[l]) rounded to bf16, as the 32-bit lane l. */
static inline __m512i bf16_pairs(__m512 lo, __m512 hi) {
    const __m512i order = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                           6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
    return _mm512_permutexvar_epi16(order, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
}

/* As scores_8, from qt2 (the queries as bf16 pairs along the head, [D / 2][LANE_STRIDE]) and bf16 K rows. */
static inline __attribute__((always_inline)) void scores_8_pairs(const uint32_t *qt2, const tile_elem *const k[8],
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
static inline __attribute__((always_inline)) void slot_pairs(const tile_elem *const v[RUN], const int D,
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

/* The transposed queries qt as bf16 pairs along the head: qt2[p][n] = (qt[2p][n], qt[2p + 1][n]). */
static inline __attribute__((always_inline)) void pair_queries(const float (*qt)[LANE_STRIDE], const int D,
                                                              const int VECS, uint32_t (*qt2)[LANE_STRIDE]) {
    for (int p = 0; p < D / 2; p++)
        for (int h = 0; h < VECS; h++)
            _mm512_store_si512(qt2[p] + 16 * h,
                               bf16_pairs(_mm512_load_ps(qt[2 * p] + 16 * h), _mm512_load_ps(qt[2 * p + 1] + 16 * h)));
}
#endif

#elif defined(__AVX2__) && defined(__FMA__)
/* The AVX2 body: the AVX-512 body's steps on 8-lane vectors and 16 registers. Scores go SCORE_SLOTS slots at a
 * time and outputs OUT_DIMS dims at a time; lanes are masked by vector compares; the arithmetic is float32 for every
 * cache dtype (a run of a bf16 or one-byte cache widened to float32 rows first). */

/* Slots whose scores, and dims whose outputs, a pass keeps in registers: 4 x vecs accumulators, which with the
 * vecs query (or weight) vectors and a broadcast fill AVX2's 16 registers; more spill. */
#define SCORE_SLOTS 4
#define OUT_DIMS 4
/* r[i][j] becomes r[j][i]: unpack pairs, 2 x 2 blocks of pairs inside 128-bit lanes, then the lanes. */
static inline void transpose_8x8(__m256 r[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) { /* u[i + c], lane L: column 4L + c of rows i .. i + 3 */
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
    }
    for (int c = 0; c < 4; c++) {
        r[c] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x20);
        r[c + 4] = _mm256_permute2f128_ps(u[c], u[4 + c], 0x31);
    }
}

/* s[j] = sum_i K[j][i] * Q^T[i] for the SCORE_SLOTS K rows k[j]. */
static inline __attribute__((always_inline)) void scores_slots(const float *qt, const float *const k[SCORE_SLOTS],
                                                              const int D, const int VECS,
                                                              __m256 s[SCORE_SLOTS][MAX_VECS]) {
    __m256 acc[SCORE_SLOTS][MAX_VECS];
    for (int j = 0; j < SCORE_SLOTS; j++)
        for (int h = 0; h < VECS; h++) acc[j][h] = _mm256_setzero_ps();
    for (int i = 0; i < D; i++) {
        __m256 qv[MAX_VECS];
        for (int h = 0; h < VECS; h++) qv[h] = _mm256_load_ps(qt + i * LANE_STRIDE + 8 * h);
        for (int j = 0; j < SCORE_SLOTS; j++) {
            const __m256 kb = _mm256_broadcast_ss(k[j] + i);
            for (int h = 0; h < VECS; h++) acc[j][h] = _mm256_fmadd_ps(kb, qv[h], acc[j][h]);
        }
    }
    for (int j = 0; j < SCORE_SLOTS; j++)
        for (int h = 0; h < VECS; h++) s[j][h] = acc[j][h];
}

typedef float tile_elem; /* the tiles read float32 rows: the cache's, or any other run widened into a buffer */

/* A cache row's D elements widened and scaled (kv_row_scale) into a float32 row of a run's buffer. */
static inline void widen_row(float *to, const kv_t *row, const int D) {
    const __m256 scale = _mm256_set1_ps(kv_row_scale(row, D));
    for (int i = 0; i < D; i += 8) _mm256_store_ps(to + i, _mm256_mul_ps(kv_load8(row + i), scale));
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* The run of n slots at `slot` as the tiles read it: krow[j] and vrow[j] for j < RUN, the slots past the run
 * reading its first row (masked later). A float32 cache's rows, and a bf16 cache's for the paired tiles, are read
 * in place; any other cache's are widened and scaled into kbuf and vbuf, as tile_elem rows (widen_row). */
static inline __attribute__((always_inline)) void run_tile_rows(const kv_t *k, const kv_t *v, int64_t row_stride,
                                                               int n, const int D, tile_elem (*kbuf)[D],
                                                               tile_elem (*vbuf)[D], const tile_elem *krow[RUN],
                                                               const tile_elem *vrow[RUN]) {
#if defined(KV_ONE_BYTE) || defined(KV_BF16) && !defined(PAIRED_TILES)
    for (int j = 0; j < n; j++) {
        widen_row(kbuf[j], k + j * row_stride, D);
        widen_row(vbuf[j], v + j * row_stride, D);
    }
    for (int j = 0; j < RUN; j++) {
        krow[j] = kbuf[j < n ? j : 0];
        vrow[j] = vbuf[j < n ? j : 0];
    }
#else
    (void)kbuf, (void)vbuf;
    for (int j = 0; j < RUN; j++) {
        krow[j] = k + (j < n ? j : 0) * row_stride;
        vrow[j] = v + (j < n ? j : 0) * row_stride;
    }
#endif
}
#endif

#if defined(__AVX512F__)
/* The tile's queries times the scale, transposed into qt: lane n's query down column n (idle lanes zero). */
static inline __attribute__((always_inline)) void transpose_queries(const TileLanes *t, float scale, const int D,
                                                                   const int VECS, float (*qt)[LANE_STRIDE]) {
    const __m512 scaled = _mm512_set1_ps(scale);
    for (int h = 0; h < VECS; h++)
        for (int i0 = 0; i0 < D; i0 += 16) { /* 16 lanes x 16 dims at a time */
            __m512 block[16];
            for (int m = 0; m < 16; m++) {
                const float *q = t->q_lane[16 * h + m];
                block[m] = q != NULL ? _mm512_mul_ps(_mm512_loadu_ps(q + i0), scaled) : _mm512_setzero_ps();
            }
            transpose_16x16(block);
            for (int m = 0; m < 16; m++) _mm512_store_ps(qt[i0 + m] + 16 * h, block[m]);
        }
}

/* exp(running max - new max), what a lane's sums so far are multiplied by: 1 where the lane has seen no score yet
 * (both maxes -inf: -inf - -inf would be a NaN, which the exp keeps, and its sums are 0 anyway). */
static inline __m512 rescale16(__m512 running_max, __m512 new_max) {
    const __mmask16 none = _mm512_cmp_ps_mask(new_max, _mm512_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return exp16_nonpositive(_mm512_maskz_sub_ps((__mmask16)~none, running_max, new_max));
}

/* One run's step of the online softmax, lane-wise: the scores s of slots pos .. pos + RUN - 1 are soft-capped,
 * masked to what each lane sees (the run's first n slots, lower <= slot < limit) and become the weights
 * exp(s - new max), zero where masked; each lane's running max and sum move on, and rescale is what its outputs so
 * far are to be multiplied by. Returns whether any lane's max moved (where none did, rescale is all ones). */
static inline __attribute__((always_inline)) int softmax_run(__m512 s[RUN][MAX_VECS], int pos, int n, float softcap,
                                                             const int VECS, const __m512i *limits,
                                                             const __m512i *lowers, const SeenByAll *all,
                                                             __m512 *running_max, __m512 *running_sum,
                                                             __m512 *rescale) {
    const int whole = pos >= all->from && pos + n <= all->to; /* no lane masks any of the run's slots */
    if (softcap > 0.0f)
        for (int j = 0; j < RUN; j++)
            for (int h = 0; h < VECS; h++) s[j][h] = softcap16(s[j][h], softcap);
    __mmask16 moved = 0;
    for (int h = 0; h < VECS; h++) {
        __m512 run_max = _mm512_set1_ps(-INFINITY);
        __mmask16 valid[RUN];
        for (int j = 0; j < RUN; j++) {
            const __m512i at = _mm512_set1_epi32(pos + j);
            valid[j] = j >= n  ? (__mmask16)0
                       : whole ? (__mmask16)0xFFFF
                               : _mm512_mask_cmpge_epi32_mask(_mm512_cmplt_epi32_mask(at, limits[h]), at, lowers[h]);
            s[j][h] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), valid[j], s[j][h]);
            run_max = _mm512_max_ps(run_max, s[j][h]);
        }
        const __m512 new_max = _mm512_max_ps(running_max[h], run_max);
        moved |= _mm512_cmp_ps_mask(running_max[h], new_max, _CMP_NEQ_UQ);
        rescale[h] = rescale16(running_max[h], new_max);
        running_sum[h] = _mm512_mul_ps(running_sum[h], rescale[h]);
        for (int j = 0; j < RUN; j++) {
            s[j][h] = _mm512_maskz_mov_ps(valid[j], exp16_nonpositive(_mm512_sub_ps(s[j][h], new_max)));
            running_sum[h] = _mm512_add_ps(running_sum[h], s[j][h]);
        }
        running_max[h] = new_max;
    }
    return moved != 0;
}

/* The lanes' masks, the positions every lane sees, and the online softmax's starting state. */
static inline __attribute__((always_inline)) void start_softmax(const TileLanes *t, const int VECS, __m512i *limits,
                                                               __m512i *lowers, SeenByAll *all, __m512 *running_max,
                                                               __m512 *running_sum) {
    *all = seen_by_all(t, 16 * VECS);
    for (int h = 0; h < VECS; h++) {
        limits[h] = _mm512_load_si512(t->limit + 16 * h);
        lowers[h] = _mm512_load_si512(t->lower + 16 * h);
        running_max[h] = _mm512_set1_ps(-INFINITY);
        running_sum[h] = _mm512_setzero_ps();
    }
}

/* Each lane's log-sum-exp from the final running max and sum, and its v_scale / sum into inv. */
static inline __attribute__((always_inline)) void finish_softmax(const PrefillArgs *a, const TileLanes *t,
                                                                const int VECS, const __m512 *running_max,
                                                                const __m512 *running_sum, float *inv) {
    float sums[LANE_STRIDE] __attribute__((aligned(64))), maxes[LANE_STRIDE] __attribute__((aligned(64)));
    for (int h = 0; h < VECS; h++) {
        _mm512_store_ps(sums + 16 * h, running_sum[h]);
        _mm512_store_ps(maxes + 16 * h, running_max[h]);
        _mm512_store_ps(inv + 16 * h, _mm512_div_ps(_mm512_set1_ps(t->v_scale), running_sum[h]));
    }
    store_lse(a, t, maxes, sums);
}

static inline __attribute__((always_inline)) void prefill_item_avx512(const PrefillArgs *a, int item, const int D,
                                                                      const int VECS) {
    const int LANES = 16 * VECS;
    TileLanes t;
    tile_lanes(a, item, LANES, D, &t);
    float qt[D][LANE_STRIDE] __attribute__((aligned(64))), ot[D][LANE_STRIDE] __attribute__((aligned(64)));
    transpose_queries(&t, t.scale, D, VECS, qt);
    memset(ot, 0, sizeof ot);
#if defined(PAIRED_TILES)
    uint32_t qt2[D / 2][LANE_STRIDE] __attribute__((aligned(64)));
    pair_queries(qt, D, VECS, qt2);
#endif
    __m512i limits[MAX_VECS], lowers[MAX_VECS];
    __m512 running_max[MAX_VECS], running_sum[MAX_VECS];
    SeenByAll all;
    start_softmax(&t, VECS, limits, lowers, &all, running_max, running_sum);
    for (int pos = t.begin; pos < t.end;) {
        int64_t slot;
        const int n = next_run(a->block_size, t.blocks, pos, t.end, &slot);
        const tile_elem *krow[RUN], *vrow[RUN];
        tile_elem kbuf[RUN][D] __attribute__((aligned(64))), vbuf[RUN][D] __attribute__((aligned(64)));
        run_tile_rows(run_rows(a->k_cache, &t, slot, D), run_rows(a->v_cache, &t, slot, D), t.row_stride, n, D, kbuf,
                      vbuf, krow, vrow);
        fetch_next_run(a, &t, pos, n, D);
        __m512 s[RUN][MAX_VECS];
#if defined(PAIRED_TILES)
        scores_8_pairs(qt2[0], krow, D, VECS, s);
        scores_8_pairs(qt2[0], krow + 8, D, VECS, s + 8);
#else
        scores_8(qt[0], krow, D, VECS, s);
        scores_8(qt[0], krow + 8, D, VECS, s + 8);
#endif
        __m512 rescale[MAX_VECS];
        softmax_run(s, pos, n, a->softcap, VECS, limits, lowers, &all, running_max, running_sum, rescale);
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
#pragma GCC unroll 1 /* unrolled, the weights of all slot pairs would take the registers, the sums the stack */
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
    float inv[LANE_STRIDE] __attribute__((aligned(64)));
    finish_softmax(a, &t, VECS, running_max, running_sum, inv);
    for (int h = 0; h < VECS; h++) {
        const __m512 lane_inv = _mm512_load_ps(inv + 16 * h);
        for (int i0 = 0; i0 < D; i0 += 16) { /* back from 16 dims x 16 lanes to the lanes' output rows */
            __m512 block[16];
            for (int m = 0; m < 16; m++) block[m] = _mm512_mul_ps(_mm512_load_ps(ot[i0 + m] + 16 * h), lane_inv);
            transpose_16x16(block);
            for (int m = 0; m < 16; m++)
                if (t.q_lane[16 * h + m] != NULL) _mm512_storeu_ps(a->out + t.out_row[16 * h + m] * D + i0, block[m]);
        }
    }
}

#if defined(PAIRED_TILES) && defined(__AMX_TILE__) && defined(__AMX_BF16__)
/* With AMX (and the OS's permission, amx_granted) the paired tiles' products run on the tile unit: the same bf16
 * operands and float32 sums, one tile multiply doing 16 x 16 x 32 of them. A tile's scores S^T [slots][lanes] are
 * K (the run's rows, in place from a bf16 cache: A tiles of 16 slots x 32 dims) times the paired queries qt2 (B
 * tiles of 16 pairs x 16 lanes, as the vdpbf16ps body holds them), one accumulator tile per 16 lanes; the online
 * softmax stays lane-wise on vectors as above. The outputs are kept lane-major, ol [lanes][D], so that the weights
 * go in as A tiles (P [16 lanes x 32 slots], each lane's weights: a transpose of two runs' score vectors) against
 * the two runs' slot pairs of V as B tiles (vp [16 pairs x 16 dims]); each 16 x 16 block of ol is loaded into an
 * accumulator, multiplied into and stored back, after a vector pass that rescales ol where some lane's max moved.
 * Runs go to the outputs in pairs, the first held (its weights rescaled with ol where the second moves a max), so
 * that each load and store of ol serves 32 slots and every multiply takes a whole tile's 32 along K (a lone last
 * run pairs with weights of zero). Tiles: 0-2 accumulate (a run's scores, then blocks of ol), 3 holds K, 4 the
 * queries, 5 the weights, 6 V. */
#define AMX_TILES 1

static void configure_tiles(void) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int rows[7] = {16, 16, 16, 16, 16, 16, RUN}, bytes[7] = {64, 64, 64, 64, 64, 4 * RUN, 64};
    for (int t = 0; t < 7; t++) {
        cfg.rows[t] = (uint8_t)rows[t];
        cfg.bytes_per_row[t] = (uint16_t)bytes[t];
    }
    amx_load_config(&cfg);
}

/* The tile's scores for one run: A tiles of K from rows `stride` bytes apart (16 of them: past the run, whatever
 * they hold is masked by the softmax) into s, by accumulators 0 .. VECS - 1. */
static inline __attribute__((always_inline)) void amx_scores(const tile_elem *k, int64_t stride,
                                                            const uint32_t (*qt2)[LANE_STRIDE], const int D,
                                                            const int VECS, __m512 s[RUN][MAX_VECS]) {
    _tile_zero(0);
    _tile_zero(1);
    if (VECS == 3) _tile_zero(2);
    for (int c = 0; c < D / 32; c++) {
        _tile_loadd(3, k + 32 * c, stride);
        _tile_loadd(4, qt2[16 * c], LANE_STRIDE * sizeof(uint32_t));
        _tile_dpbf16ps(0, 3, 4);
        _tile_loadd(4, qt2[16 * c] + 16, LANE_STRIDE * sizeof(uint32_t));
        _tile_dpbf16ps(1, 3, 4);
        if (VECS == 3) {
            _tile_loadd(4, qt2[16 * c] + 32, LANE_STRIDE * sizeof(uint32_t));
            _tile_dpbf16ps(2, 3, 4);
        }
    }
    float st[RUN][LANE_STRIDE] __attribute__((aligned(64)));
    _tile_stored(0, st[0], LANE_STRIDE * sizeof(float));
    _tile_stored(1, st[0] + 16, LANE_STRIDE * sizeof(float));
    if (VECS == 3) _tile_stored(2, st[0] + 32, LANE_STRIDE * sizeof(float));
    amx_memory_barrier();
    for (int j = 0; j < RUN; j++)
        for (int h = 0; h < VECS; h++) s[j][h] = _mm512_load_ps(st[j] + 16 * h);
}

/* ol[n] += sum over two runs' slots j of P[j][n] V[j]: the weights, the first run's held in memory (`first`,
 * [RUN][lanes]) and the second's in s, transposed into lane-major bf16 rows of 2 * RUN, times the runs' V rows' slot
 * pairs, block by block of 16 lanes x 16 dims (accumulator h for lanes 16h ..). */
static inline __attribute__((always_inline)) void amx_outputs(const float (*first)[LANE_STRIDE],
                                                             __m512 s[RUN][MAX_VECS], const tile_elem *const vrow[RUN],
                                                             const tile_elem *const vrow2[RUN], const int D,
                                                             const int VECS, float (*ol)[D]) {
    uint16_t pl[LANE_STRIDE][2 * RUN] __attribute__((aligned(64)));
    for (int h = 0; h < VECS; h++)
        for (int run = 0; run < 2; run++) {
            __m512 block[16];
            for (int j = 0; j < RUN; j++) block[j] = run == 0 ? _mm512_load_ps(first[j] + 16 * h) : s[j][h];
            transpose_16x16(block);
            for (int m = 0; m < 16; m++)
                _mm256_store_si256((__m256i *)(pl[16 * h + m] + RUN * run), (__m256i)_mm512_cvtneps_pbh(block[m]));
        }
    uint32_t vp[RUN][D] __attribute__((aligned(64)));
    slot_pairs(vrow, D, vp);
    slot_pairs(vrow2, D, vp + RUN / 2);
    amx_memory_barrier(); /* pl, vp and ol are written by plain stores before the tiles load them */
    for (int d = 0; d < D; d += 16) {
        _tile_loadd(6, vp[0] + d, D * sizeof(uint32_t));
        _tile_loadd(5, pl[0], 2 * RUN * sizeof(uint16_t));
        _tile_loadd(0, ol[0] + d, D * sizeof(float));
        _tile_dpbf16ps(0, 5, 6);
        _tile_stored(0, ol[0] + d, D * sizeof(float));
        _tile_loadd(5, pl[16], 2 * RUN * sizeof(uint16_t));
        _tile_loadd(1, ol[16] + d, D * sizeof(float));
        _tile_dpbf16ps(1, 5, 6);
        _tile_stored(1, ol[16] + d, D * sizeof(float));
        if (VECS == 3) {
            _tile_loadd(5, pl[32], 2 * RUN * sizeof(uint16_t));
            _tile_loadd(2, ol[32] + d, D * sizeof(float));
            _tile_dpbf16ps(2, 5, 6);
            _tile_stored(2, ol[32] + d, D * sizeof(float));
        }
    }
    amx_memory_barrier(); /* the rescaling and the final normalisation read ol with plain loads */
}

static inline __attribute__((always_inline)) void prefill_item_amx(const PrefillArgs *a, int item, const int D,
                                                                   const int VECS) {
    const int LANES = 16 * VECS;
    TileLanes t;
    tile_lanes(a, item, LANES, D, &t);
    uint32_t qt2[D / 2][LANE_STRIDE] __attribute__((aligned(64)));
    {
        float qt[D][LANE_STRIDE] __attribute__((aligned(64)));
        transpose_queries(&t, t.scale, D, VECS, qt);
        pair_queries(qt, D, VECS, qt2);
    }
    float ol[LANE_STRIDE][D] __attribute__((aligned(64)));
    memset(ol, 0, sizeof(float) * LANES * D);
    __m512i limits[MAX_VECS], lowers[MAX_VECS];
    __m512 running_max[MAX_VECS], running_sum[MAX_VECS];
    SeenByAll all;
    start_softmax(&t, VECS, limits, lowers, &all, running_max, running_sum);
    /* the run held for the next one (held: 0 none, 1 one): its weights and V rows (those widened in vbuf[its
     * parity], which the next run's do not overwrite) */
    float first[RUN][LANE_STRIDE] __attribute__((aligned(64)));
    const tile_elem *first_v[RUN];
    tile_elem vbuf[2][RUN][D] __attribute__((aligned(64)));
    int held = 0;
    for (int pos = t.begin, parity = 0; pos < t.end; parity ^= 1) {
        int64_t slot;
        const int n = next_run(a->block_size, t.blocks, pos, t.end, &slot);
        const tile_elem *krow[RUN], *vrow[RUN];
        tile_elem kbuf[RUN][D] __attribute__((aligned(64)));
        const kv_t *k = run_rows(a->k_cache, &t, slot, D);
        run_tile_rows(k, run_rows(a->v_cache, &t, slot, D), t.row_stride, n, D, kbuf, vbuf[parity], krow, vrow);
        fetch_next_run(a, &t, pos, n, D);
        /* K as an A tile: RUN rows `stride` bytes apart, none past the run (a shorter run's rows copied, the first
         * standing for the missing ones), in place from a bf16 cache where the run is whole */
        const tile_elem *ktile = kbuf[0];
        int64_t stride = D * sizeof(tile_elem);
#if defined(KV_BF16)
        if (n == RUN) {
            ktile = k;
            stride = t.row_stride * sizeof(kv_t);
        } else
#endif
            for (int j = 0; j < RUN; j++)
                if (krow[j] != kbuf[j]) memcpy(kbuf[j], krow[j], D * sizeof(tile_elem));
        __m512 s[RUN][MAX_VECS];
        amx_scores(ktile, stride, qt2, D, VECS, s);
        __m512 rescale[MAX_VECS];
        if (softmax_run(s, pos, n, a->softcap, VECS, limits, lowers, &all, running_max, running_sum, rescale)) {
            float factor[LANE_STRIDE] __attribute__((aligned(64)));
            for (int h = 0; h < VECS; h++) _mm512_store_ps(factor + 16 * h, rescale[h]);
            for (int l = 0; l < LANES; l++) {
                const __m512 f = _mm512_set1_ps(factor[l]);
                for (int i = 0; i < D; i += 16) _mm512_store_ps(ol[l] + i, _mm512_mul_ps(_mm512_load_ps(ol[l] + i), f));
            }
            for (int j = 0; j < RUN && held; j++)
                for (int h = 0; h < VECS; h++)
                    _mm512_store_ps(first[j] + 16 * h, _mm512_mul_ps(_mm512_load_ps(first[j] + 16 * h), rescale[h]));
        }
        pos += n;
        if (held) {
            amx_outputs((const float(*)[LANE_STRIDE])first, s, first_v, vrow, D, VECS, ol);
        } else {
            for (int j = 0; j < RUN; j++) {
                for (int h = 0; h < VECS; h++) _mm512_store_ps(first[j] + 16 * h, s[j][h]);
                first_v[j] = vrow[j];
            }
        }
        held ^= 1;
    }
    if (held) { /* the last run alone: beside weights of zero, on its own V rows (finite) */
        __m512 zero[RUN][MAX_VECS];
        for (int j = 0; j < RUN; j++)
            for (int h = 0; h < VECS; h++) zero[j][h] = _mm512_setzero_ps();
        amx_outputs((const float(*)[LANE_STRIDE])first, zero, first_v, first_v, D, VECS, ol);
    }
    float inv[LANE_STRIDE] __attribute__((aligned(64)));
    finish_softmax(a, &t, VECS, running_max, running_sum, inv);
    for (int l = 0; l < t.lanes; l++) {
        const __m512 f = _mm512_set1_ps(inv[l]);
        for (int i = 0; i < D; i += 16)
            _mm512_storeu_ps(a->out + t.out_row[l] * D + i, _mm512_mul_ps(_mm512_load_ps(ol[l] + i), f));
    }
}
#endif

#define prefill_item_body prefill_item_avx512
#elif defined(__AVX2__) && defined(__FMA__)
/* rescale16 on 8 lanes: exp(running max - new max), 1 where the lane has seen no score yet. */
static inline __m256 rescale8(__m256 running_max, __m256 new_max) {
    const __m256 none = _mm256_cmp_ps(new_max, _mm256_set1_ps(-INFINITY), _CMP_EQ_OQ);
    return exp8_nonpositive(_mm256_andnot_ps(none, _mm256_sub_ps(running_max, new_max)));
}

static inline __attribute__((always_inline)) void prefill_item_avx2(const PrefillArgs *a, int item, const int D,
                                                                    const int VECS) {
    const int LANES = 8 * VECS;
    TileLanes t;
    tile_lanes(a, item, LANES, D, &t);
    float qt[D][LANE_STRIDE] __attribute__((aligned(64))), ot[D][LANE_STRIDE] __attribute__((aligned(64)));
    const __m256 scale = _mm256_set1_ps(t.scale);
    for (int h = 0; h < VECS; h++)
        for (int i0 = 0; i0 < D; i0 += 8) { /* 8 lanes x 8 dims of queries, transposed into qt */
            __m256 block[8];
            for (int m = 0; m < 8; m++) {
                const float *q = t.q_lane[8 * h + m];
                block[m] = q != NULL ? _mm256_mul_ps(_mm256_loadu_ps(q + i0), scale) : _mm256_setzero_ps();
            }
            transpose_8x8(block);
            for (int m = 0; m < 8; m++) {
                _mm256_store_ps(qt[i0 + m] + 8 * h, block[m]);
                _mm256_store_ps(ot[i0 + m] + 8 * h, _mm256_setzero_ps());
            }
        }
    __m256i limits[MAX_VECS], lowers[MAX_VECS];
    __m256 running_max[MAX_VECS], running_sum[MAX_VECS];
    for (int h = 0; h < VECS; h++) {
        limits[h] = _mm256_load_si256((const __m256i *)(t.limit + 8 * h));
        lowers[h] = _mm256_load_si256((const __m256i *)(t.lower + 8 * h));
        running_max[h] = _mm256_set1_ps(-INFINITY);
        running_sum[h] = _mm256_setzero_ps();
    }
    for (int pos = t.begin; pos < t.end;) {
        int64_t slot;
        const int n = next_run(a->block_size, t.blocks, pos, t.end, &slot);
        const tile_elem *krow[RUN], *vrow[RUN];
        tile_elem kbuf[RUN][D] __attribute__((aligned(64))), vbuf[RUN][D] __attribute__((aligned(64)));
        run_tile_rows(run_rows(a->k_cache, &t, slot, D), run_rows(a->v_cache, &t, slot, D), t.row_stride, n, D, kbuf,
                      vbuf, krow, vrow);
        fetch_next_run(a, &t, pos, n, D);
        __m256 s[RUN][MAX_VECS];
        for (int j = 0; j < RUN; j += SCORE_SLOTS) scores_slots(qt[0], krow + j, D, VECS, s + j);
        if (a->softcap > 0.0f)
            for (int j = 0; j < RUN; j++)
                for (int h = 0; h < VECS; h++) s[j][h] = softcap8(s[j][h], a->softcap);
        __m256 rescale[MAX_VECS];
        for (int h = 0; h < VECS; h++) {
            __m256 run_max = _mm256_set1_ps(-INFINITY);
            __m256 valid[RUN];
            for (int j = 0; j < RUN; j++) { /* lower <= pos + j < limit */
                const __m256i at = _mm256_set1_epi32(pos + j);
                valid[j] = j < n ? _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_cmpgt_epi32(lowers[h], at),
                                                                           _mm256_cmpgt_epi32(limits[h], at)))
                                 : _mm256_setzero_ps();
                s[j][h] = _mm256_blendv_ps(_mm256_set1_ps(-INFINITY), s[j][h], valid[j]);
                run_max = _mm256_max_ps(run_max, s[j][h]);
            }
            const __m256 new_max = _mm256_max_ps(running_max[h], run_max);
            rescale[h] = rescale8(running_max[h], new_max);
            running_sum[h] = _mm256_mul_ps(running_sum[h], rescale[h]);
            for (int j = 0; j < RUN; j++) {
                s[j][h] = _mm256_and_ps(valid[j], exp8_nonpositive(_mm256_sub_ps(s[j][h], new_max)));
                running_sum[h] = _mm256_add_ps(running_sum[h], s[j][h]);
            }
            running_max[h] = new_max;
        }
        for (int i = 0; i < D; i += OUT_DIMS) { /* OUT_DIMS x vecs independent sums */
            __m256 o[OUT_DIMS][MAX_VECS];
            for (int u = 0; u < OUT_DIMS; u++)
                for (int h = 0; h < VECS; h++) o[u][h] = _mm256_mul_ps(_mm256_load_ps(ot[i + u] + 8 * h), rescale[h]);
            for (int j = 0; j < RUN; j++)
                for (int u = 0; u < OUT_DIMS; u++) {
                    const __m256 vb = _mm256_broadcast_ss(vrow[j] + i + u);
                    for (int h = 0; h < VECS; h++) o[u][h] = _mm256_fmadd_ps(s[j][h], vb, o[u][h]);
                }
            for (int u = 0; u < OUT_DIMS; u++)
                for (int h = 0; h < VECS; h++) _mm256_store_ps(ot[i + u] + 8 * h, o[u][h]);
        }
        pos += n;
    }
    float sums[LANE_STRIDE] __attribute__((aligned(64))), maxes[LANE_STRIDE] __attribute__((aligned(64)));
    for (int h = 0; h < VECS; h++) {
        _mm256_store_ps(sums + 8 * h, running_sum[h]);
        _mm256_store_ps(maxes + 8 * h, running_max[h]);
    }
    store_lse(a, &t, maxes, sums);
    for (int h = 0; h < VECS; h++) {
        const __m256 inv = _mm256_div_ps(_mm256_set1_ps(t.v_scale), running_sum[h]);
        for (int i0 = 0; i0 < D; i0 += 8) { /* back from 8 dims x 8 lanes to the lanes' output rows */
            __m256 block[8];
            for (int m = 0; m < 8; m++) block[m] = _mm256_mul_ps(_mm256_load_ps(ot[i0 + m] + 8 * h), inv);
            transpose_8x8(block);
            for (int m = 0; m < 8; m++)
                if (t.q_lane[8 * h + m] != NULL) _mm256_storeu_ps(a->out + t.out_row[8 * h + m] * D + i0, block[m]);
        }
    }
}
#define prefill_item_body prefill_item_avx2
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
/* Whether the tiles take these sizes: prefill_item below has a body for exactly these head sizes. */
static int prefill_takes(int num_heads, int num_kv_heads, int head_size) {
    return num_kv_heads > 0 && num_heads % num_kv_heads == 0 && num_heads / num_kv_heads >= 1
           && num_heads / num_kv_heads <= MAX_GROUP && (head_size == 64 || head_size == 128 || head_size == 256);
}

/* One tile, by the body for its width and head size (both constants in the body): 64, 128 or 256, the sizes
 * prefill_takes admits. */
static void prefill_item(const PrefillArgs *a, int item, int head_size) {
#if defined(AMX_TILES)
#define item_body(a, item, D, VECS)                                                                           \
    ((a)->amx ? prefill_item_amx(a, item, D, VECS) : prefill_item_body(a, item, D, VECS))
#else
#define item_body prefill_item_body
#endif
    if (a->vecs == 3) {
        if (head_size == 64) item_body(a, item, 64, 3);
        else if (head_size == 128) item_body(a, item, 128, 3);
        else item_body(a, item, 256, 3);
    } else {
        if (head_size == 64) item_body(a, item, 64, 2);
        else if (head_size == 128) item_body(a, item, 128, 2);
        else item_body(a, item, 256, 2);
    }
#undef item_body
}

/* Query vectors per tile: 3 where whole tokens fill more of their lanes than of 2's, as for groups of 3 (on
 * AVX-512, 48 lanes hold 16 tokens; 32 only 10, the last two idle), else 2. */
static int tile_vecs(int group) {
    const int three = 3 * VEC_LANES, two = 2 * VEC_LANES;
    return (three / group) * group * two > (two / group) * group * three ? 3 : 2;
}

int paged_prefill_available(void) { return 1; }

int paged_prefill_supports(int num_heads, int num_kv_heads, int head_size) {
    return prefill_takes(num_heads, num_kv_heads, head_size);
}

#if defined(PAIRED_TILES)
int paged_prefill_pairs(void) { return 1; }
#else
int paged_prefill_pairs(void) { return 0; }
#endif

#if defined(AMX_TILES)
int paged_prefill_amx(void) { return amx_granted(); }
#else
int paged_prefill_amx(void) { return 0; }
#endif

int run_prefill(const float *q, int64_t q_row_stride, const kv_t *k_cache, const kv_t *v_cache,
                const int32_t *block_table, int64_t block_table_stride, const int32_t *query_start,
                const int32_t *query_len, const int32_t *seq_len, int start_pos, int stop_pos, int window, float *out,
                float *lse, int num_reqs, int num_heads, int num_kv_heads, int head_size, int block_size, float scale,
                float softcap, const float *k_scale, const float *v_scale, int num_threads) {
    if (!prefill_takes(num_heads, num_kv_heads, head_size) || num_reqs < 0) return -1; /* 0 chunks: no tiles */
    const int group = num_heads / num_kv_heads;
    const int vecs = tile_vecs(group), tokens_per_tile = VEC_LANES * vecs / group;
    int tile_start[num_reqs + 1];
    tile_start[0] = 0;
    for (int r = 0; r < num_reqs; r++)
        tile_start[r + 1] = tile_start[r] + (query_len[r] + tokens_per_tile - 1) / tokens_per_tile;
    const PrefillArgs a = {q, k_cache, v_cache, block_table, query_start, query_len, seq_len, tile_start,
                           block_table_stride, q_row_stride, num_reqs, start_pos, stop_pos, window, num_heads,
                           num_kv_heads, block_size, tokens_per_tile, vecs, scale, softcap, k_scale, v_scale, out, lse,
                           paged_prefill_amx()};
    const int items = tile_start[num_reqs] * num_kv_heads;
#pragma omp parallel num_threads(num_threads)
    {
#if defined(AMX_TILES)
        if (a.amx) configure_tiles(); /* per thread */
#endif
        /* Dynamic: a tile's cost grows with its position in the prompt. */
#pragma omp for schedule(dynamic, 1)
        for (int item = 0; item < items; item++) prefill_item(&a, item, head_size);
#if defined(AMX_TILES)
        if (a.amx) _tile_release();
#endif
    }
    return 0;
}
#else
/* Without AVX-512 or AVX2 there are no tiles: the stubs say so, and the callers take the torch path. */
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-parameter"
int paged_prefill_available(void) { return 0; }

int paged_prefill_supports(int num_heads, int num_kv_heads, int head_size) { return 0; }

int paged_prefill_pairs(void) { return 0; }

int paged_prefill_amx(void) { return 0; }

int run_prefill(const float *q, int64_t q_row_stride, const kv_t *k_cache, const kv_t *v_cache,
                const int32_t *block_table, int64_t block_table_stride, const int32_t *query_start,
                const int32_t *query_len, const int32_t *seq_len, int start_pos, int stop_pos, int window, float *out,
                float *lse, int num_reqs, int num_heads, int num_kv_heads, int head_size, int block_size, float scale,
                float softcap, const float *k_scale, const float *v_scale, int num_threads) {
    return -1;
}
#pragma GCC diagnostic pop
#endif

/* Query rows of num_reqs prefill chunks: request r's are rows query_start[r] .. + query_len[r] - 1 of q
 * [rows, num_heads, head_size] (rows q_row_stride floats apart: a view of the QKV projection's output is read in
 * place), the last query_len[r] of its seq_len[r] positions; each sees the positions start_pos .. its own, under a
 * sliding window (window > 0; 0: none) only the last window of them (window_start in paged_attention.h), the scores
 * soft-capped at softcap (0: not), KV head h's keys and values worth k_scale[h] and v_scale[h] times what they
 * widen to (paged_attention.h). Writes those rows of out [rows, num_heads, head_size] and lse [rows, num_heads].
 * The chunks' arrays are read when the kernel runs, so a CPU graph replays it over new chunks of the same total
 * rows. Returns -1 for what it does not handle (neither AVX-512 nor AVX2, head size not 64, 128 or 256, group > 16).
 */
int paged_prefill_f32(const float *q, int64_t q_row_stride, const kv_t *k_cache, const kv_t *v_cache,
                      const int32_t *block_table, int64_t block_table_stride, const int32_t *query_start,
                      const int32_t *query_len, const int32_t *seq_len, int start_pos, int window, float *out,
                      float *lse, int num_reqs, int num_heads, int num_kv_heads, int head_size, int block_size,
                      float scale, float softcap, const float *k_scale, const float *v_scale, int num_threads) {
    return run_prefill(q, q_row_stride, k_cache, v_cache, block_table, block_table_stride,
                       query_start, query_len, seq_len, start_pos, INT32_MAX, window, out, lse, num_reqs, num_heads,
                       num_kv_heads, head_size, block_size, scale, softcap, k_scale, v_scale, num_threads);
}
