/* What the paged-attention kernels share (paged_decode.c: decode rows; paged_prefill.c: prefill tiles;
 * paged_cascade.c: cascade attention's shared prefix and the merge), built together into one library per KV cache
 * dtype by native/build.py.
 *
 * The cache is [num_slots, num_kv_heads, KV_ROW(head_size)] per layer for K and for V, slot = block * block_size +
 * offset, and holds float32, or, built with
 * - -DKV_BF16: bf16 (the top half of a float32: a bfloat16 model whose activations are float32, see
 *   platforms/cpu.KernelChoice);
 * - -DKV_FP8_E4M3 / -DKV_FP8_E5M2: one byte an element, fp8 (vLLM's kv_cache_dtype fp8_e4m3 / fp8_e5m2), holding
 *   k / k_scale and v / v_scale (vLLM's scales, a layer's constants, one per KV head: the kernels take them as
 *   arrays of num_kv_heads floats, all equal for a per-tensor scale, all 1 for the other caches, and fold a head's
 *   k_scale into its scores' scale and its v_scale into its outputs' normalisation);
 * - -DKV_INT8: one signed byte an element, each head's row of head_size followed by its float32 scale (4 bytes:
 *   max |x| / 127 over the row, written by fused_ops.c's write_kv_int8).
 * Queries, outputs and all arithmetic stay float32. An element widens as it loads (kv_float, kv_load16, kv_load8)
 * and is worth that times its row's kv_row_scale: the int8 row's own scale; for e4m3 2^8, as its bits widen
 * through float16's (whose exponent bias is 8 more); otherwise 1. The kernels apply a row's scale once per row (to
 * its score, or to its softmax weight), not per element. A request's history is read through its block table in
 * runs of up to RUN consecutive slots (never crossing a block), each one step of an online softmax.
 *
 * Threads: OpenMP, linked against the libgomp.so.1 torch has already loaded, so the parallel loops run on torch's
 * own worker threads instead of competing with them.
 */
#ifndef PAGEDLLM_PAGED_ATTENTION_H
#define PAGEDLLM_PAGED_ATTENTION_H
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define MAX_GROUP 16       /* query heads per KV head */
#define MAX_HEAD_SIZE 256  /* the decode rows' limit; the prefill tiles take 64, 128 and 256 (paged_prefill.c) */
#define RUN 16             /* slots per online-softmax step */

#if defined(KV_BF16)
typedef uint16_t kv_t;
static inline float kv_float(kv_t x) {
    const union { uint32_t bits; float value; } widened = {(uint32_t)x << 16};
    return widened.value;
}
#elif defined(KV_FP8_E4M3) || defined(KV_FP8_E5M2)
typedef uint8_t kv_t;
#define KV_ONE_BYTE 1
/* The float16 whose top bits the fp8 element's are (e5m2 is float16's top byte; e4m3's exponent and mantissa sit
 * one bit lower, so its float16 is the element's value / 2^8), exactly. */
static inline uint16_t kv_half_bits(kv_t x) {
#if defined(KV_FP8_E4M3)
    return (uint16_t)(((x & 0x80u) << 8) | ((x & 0x7Fu) << 7));
#else
    return (uint16_t)(x << 8);
#endif
}
static inline float kv_float(kv_t x) {
    const uint16_t h = kv_half_bits(x);
    const int exponent = (h >> 10) & 31, mantissa = h & 1023;
    const float magnitude = exponent ? ldexpf((float)(1024 + mantissa), exponent - 25) : ldexpf((float)mantissa, -24);
    return h & 0x8000u ? -magnitude : magnitude;
}
#elif defined(KV_INT8)
typedef int8_t kv_t;
#define KV_ONE_BYTE 1
#define KV_ROW_SCALED 1 /* each row has its own scale */
#define KV_ROW_EXTRA 4 /* bytes after each head's row: its float32 scale */
static inline float kv_float(kv_t x) { return (float)x; }
#else
#define KV_F32 1
typedef float kv_t;
static inline float kv_float(kv_t x) { return x; }
#endif
#if !defined(KV_ROW_EXTRA)
#define KV_ROW_EXTRA 0
#endif
/* Cache elements between one head's row and the next. */
#define KV_ROW(head_size) ((head_size) + KV_ROW_EXTRA)

/* What every element is worth per unit kv_float where rows have no scales of their own (KV_ROW_SCALED): the decode
 * bodies fold it into the queries' scale and the outputs (a power of two: exactly). */
#if defined(KV_FP8_E4M3)
#define KV_WIDEN_SCALE 256.0f
#else
#define KV_WIDEN_SCALE 1.0f
#endif

/* What the elements of the head's row at `row` (head_size of them) are worth per unit kv_float (see above). */
static inline float kv_row_scale(const kv_t *row, int head_size) {
#if defined(KV_ROW_SCALED)
    float scale;
    memcpy(&scale, row + head_size, sizeof scale);
    return scale;
#else
    (void)row, (void)head_size;
    return KV_WIDEN_SCALE;
#endif
}

/* Length of the run of consecutive slots starting at pos (stays inside one block, at most RUN, not past seq_len),
 * and its first slot. */
static inline int next_run(int block_size, const int32_t *blocks, int pos, int seq_len, int64_t *slot) {
    const int offset = pos % block_size;
    int n = block_size - offset;
    if (n > seq_len - pos) n = seq_len - pos;
    if (n > RUN) n = RUN;
    *slot = (int64_t)blocks[pos / block_size] * block_size + offset;
    return n;
}

/* Sliding-window attention (vLLM's sliding_window, transformers' sliding_window_overlay): the query at position p
 * sees only the keys at positions > p - window, the window keys up to and including its own; window 0 means no
 * window. The first position a query at `pos` reads, given the caller's own first position start_pos: a lower
 * bound per query, so the kernels skip what lies below it instead of masking it. */
static inline int window_start(int start_pos, int pos, int window) {
    return window > 0 && pos + 1 - window > start_pos ? pos + 1 - window : start_pos;
}

/* Attention logit soft-capping (Gemma 2's attn_logit_softcapping, vLLM's logits_soft_cap): a scaled score s becomes
 * cap * tanh(s / cap) before the softmax; cap 0 means none. The kernels test the cap once per run of scores, not per
 * score, so a layer without one pays a predictable branch a run. The vector forms take tanh(|x|) = (1 - e) / (1 + e)
 * with e = exp(-2|x|) <= 1, the softmax's own exp for nonpositive arguments, and give it x's sign back. */
static inline float softcap1(float s, float cap) { return cap * tanhf(s / cap); }

#if defined(__AVX512F__)
static inline __m512 softcap16(__m512 s, float cap) {
    const __m512 x = _mm512_mul_ps(s, _mm512_set1_ps(1.0f / cap));
    const __m512 e = exp16_nonpositive(_mm512_mul_ps(_mm512_abs_ps(x), _mm512_set1_ps(-2.0f)));
    const __m512 one = _mm512_set1_ps(1.0f);
    const __m512i t = _mm512_castps_si512(_mm512_div_ps(_mm512_sub_ps(one, e), _mm512_add_ps(one, e)));
    const __m512i sign = _mm512_and_si512(_mm512_castps_si512(x), _mm512_set1_epi32((int)0x80000000u));
    return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(t, sign)), _mm512_set1_ps(cap));
}

/* 16 cache elements as float32. */
static inline __m512 kv_load16(const kv_t *p) {
#if defined(KV_BF16)
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
#elif defined(KV_FP8_E4M3)
    /* each byte shifted to where float16 has its exponent and mantissa, its sign landing on bit 14: adding that bit
     * to itself carries it to bit 15 */
    const __m256i bits = _mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 7);
    return _mm512_cvtph_ps(_mm256_add_epi16(bits, _mm256_and_si256(bits, _mm256_set1_epi16(0x4000))));
#elif defined(KV_FP8_E5M2)
    return _mm512_cvtph_ps(_mm256_slli_epi16(_mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i *)p)), 8));
#elif defined(KV_INT8)
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
#else
    return _mm512_loadu_ps(p);
#endif
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
static inline __m256 softcap8(__m256 s, float cap) {
    const __m256 x = _mm256_mul_ps(s, _mm256_set1_ps(1.0f / cap)), sign = _mm256_set1_ps(-0.0f);
    const __m256 e = exp8_nonpositive(_mm256_mul_ps(_mm256_andnot_ps(sign, x), _mm256_set1_ps(-2.0f)));
    const __m256 one = _mm256_set1_ps(1.0f);
    const __m256 t = _mm256_div_ps(_mm256_sub_ps(one, e), _mm256_add_ps(one, e));
    return _mm256_mul_ps(_mm256_or_ps(t, _mm256_and_ps(sign, x)), _mm256_set1_ps(cap));
}

/* 8 cache elements as float32. */
static inline __m256 kv_load8(const kv_t *p) {
#if defined(KV_BF16)
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)p)), 16));
#elif defined(KV_FP8_E4M3)
    const __m128i bits = _mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 7); /* as above */
    return _mm256_cvtph_ps(_mm_add_epi16(bits, _mm_and_si128(bits, _mm_set1_epi16(0x4000))));
#elif defined(KV_FP8_E5M2)
    return _mm256_cvtph_ps(_mm_slli_epi16(_mm_cvtepu8_epi16(_mm_loadl_epi64((const __m128i *)p)), 8));
#elif defined(KV_INT8)
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
#else
    return _mm256_loadu_ps(p);
#endif
}
#endif

/* The prefill tiles (paged_prefill.c) over num_reqs chunks of query rows, each seeing the positions
 * window_start(start_pos, its own, window) .. min(its own, stop_pos - 1), scores soft-capped at softcap (0: not);
 * paged_prefill_f32 and paged_prefix_f32 are this with their arguments. Returns -1 for what the tiles do not take
 * (neither AVX-512 nor AVX2, head size not 64, 128 or 256, group above 16). */
__attribute__((visibility("hidden"))) int run_prefill(
    const float *q, int64_t q_row_stride, const kv_t *k_cache, const kv_t *v_cache, const int32_t *block_table,
    int64_t block_table_stride, const int32_t *query_start, const int32_t *query_len, const int32_t *seq_len,
    int start_pos, int stop_pos, int window, float *out, float *lse, int num_reqs, int num_heads, int num_kv_heads,
    int head_size, int block_size, float scale, float softcap, const float *k_scale, const float *v_scale,
    int num_threads);
#endif
