/* What the paged-attention kernels share (paged_decode.c: decode rows; paged_prefill.c: prefill tiles;
 * paged_cascade.c: cascade attention's shared prefix and the merge), built together into one library per KV cache
 * dtype by native/build.py.
 *
 * The cache is [num_slots, num_kv_heads, head_size] per layer for K and for V, slot = block * block_size + offset,
 * and holds float32, or, built with -DKV_BF16, bf16 (the top half of a float32: a bfloat16 model whose activations
 * are float32, see platforms/cpu.KernelChoice). Queries, outputs and all arithmetic stay float32; bf16 elements
 * widen as they load. A request's history is read through its block table in runs of up to RUN consecutive slots
 * (never crossing a block), each one step of an online softmax.
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
#define MAX_HEAD_SIZE 256  /* the decode rows' limit; the prefill tiles take 64 and 128 (paged_prefill.c) */
#define RUN 16             /* slots per online-softmax step */

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
#else
    return _mm256_loadu_ps(p);
#endif
}
#endif

/* The prefill tiles (paged_prefill.c) over num_reqs chunks of query rows, each seeing the positions
 * window_start(start_pos, its own, window) .. min(its own, stop_pos - 1), scores soft-capped at softcap (0: not);
 * paged_prefill_f32 and paged_prefix_f32 are this with their arguments. Returns -1 for what the tiles do not take
 * (no AVX-512, head size not 64 or 128, group above 16). */
__attribute__((visibility("hidden"))) int run_prefill(
    const float *q, int64_t q_row_stride, const kv_t *k_cache, const kv_t *v_cache, const int32_t *block_table,
    int64_t block_table_stride, const int32_t *query_start, const int32_t *query_len, const int32_t *seq_len,
    int start_pos, int stop_pos, int window, float *out, float *lse, int num_reqs, int num_heads, int num_kv_heads,
    int head_size, int block_size, float scale, float softcap, int num_threads);
#endif
