/* Cascade attention (see layers/attention/cpu_plan.py): when every request of a step starts with the same blocks, the
 * shared prefix is attended once for all query rows (paged_prefix_f32, the prefill tiles of paged_prefill.c over the
 * prefix alone) and merged with each row's attention over the rest of its history by the two partial softmaxes'
 * log-sum-exps (merge_attn_states_f32).
 */
#include "paged_attention.h"

/* Cascade attention's shared part: num_rows query rows (q_row_stride floats apart), all after a prefix of
 * prefix_tokens positions that every row's request holds in the blocks block_table starts with, attend to that
 * prefix alone: the prefill tiles over one "request" whose keys stop at the prefix, scores soft-capped at softcap
 * (0: not) and keys and values scaled by k_scale and v_scale (per KV head) as the rest of each row's history is.
 * Writes out [num_rows, num_heads, head_size] and lse [num_rows, num_heads]; -1 as paged_prefill_f32. */
int paged_prefix_f32(const float *q, int64_t q_row_stride, const kv_t *k_cache, const kv_t *v_cache,
                     const int32_t *block_table, int prefix_tokens, int num_rows, float *out, float *lse,
                     int num_heads, int num_kv_heads, int head_size, int block_size, float scale, float softcap,
                     const float *k_scale, const float *v_scale, int num_threads) {
    const int32_t query_start = 0, query_len = num_rows, seq_len = prefix_tokens + num_rows;
    return run_prefill(q, q_row_stride, k_cache, v_cache, block_table, 0, &query_start, &query_len, &seq_len, 0,
                       prefix_tokens, 0, out, lse, 1, num_heads, num_kv_heads, head_size, block_size, scale, softcap,
                       k_scale, v_scale, num_threads);
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
