/* Paged attention for decode rows (one query token per request), float32, reading K/V in place.
 *
 * The torch path gathers every request's whole K/V history out of the paged cache into new tensors in
 * every layer and step; this kernel walks the request's block table instead, so each K/V row is read once
 * and nothing is written but the output. Work items are (request, KV head); an item keeps the query heads
 * of its group together, so a K/V row loaded once serves all of them, and it goes block by block with an
 * online softmax (one rescale per block).
 *
 * Threads: OpenMP, linked against the libgomp.so.1 torch has already loaded, so the parallel loop runs on
 * torch's own worker threads instead of competing with them.
 * Built at first use by native/__init__.py with the system C compiler; without one the torch path runs.
 */
#include <math.h>
#include <stdint.h>

#define MAX_GROUP 16
#define MAX_HEAD_SIZE 256
#define MAX_BLOCK 256

static void decode_item(const float *q_all, const float *k_cache, const float *v_cache,
                        const int32_t *block_table, int64_t block_table_stride, const int32_t *seq_lens,
                        int start_pos, float *out, float *lse, int num_heads, int num_kv_heads, int head_size,
                        int block_size, float scale, int item) {
    const int req = item / num_kv_heads, kv_head = item % num_kv_heads;
    const int group = num_heads / num_kv_heads, d = head_size, bs = block_size;
    const int32_t *blocks = block_table + (int64_t)req * block_table_stride;
    const float *q = q_all + ((int64_t)req * num_heads + (int64_t)kv_head * group) * d;
    const int64_t row_stride = (int64_t)num_kv_heads * d; /* floats between consecutive slots */
    const int seq_len = seq_lens[req];
    float acc[MAX_GROUP][MAX_HEAD_SIZE], running_max[MAX_GROUP], running_sum[MAX_GROUP];
    float scores[MAX_GROUP][MAX_BLOCK];
    for (int g = 0; g < group; g++) {
        running_max[g] = -INFINITY;
        running_sum[g] = 0.0f;
        for (int i = 0; i < d; i++) acc[g][i] = 0.0f;
    }
    for (int pos = start_pos; pos < seq_len;) {
        const int offset = pos % bs;
        const int n = (seq_len - pos < bs - offset) ? seq_len - pos : bs - offset;
        const int64_t slot = (int64_t)blocks[pos / bs] * bs + offset;
        const float *k = k_cache + slot * row_stride + (int64_t)kv_head * d;
        const float *v = v_cache + slot * row_stride + (int64_t)kv_head * d;
        for (int g = 0; g < group; g++) {
            const float *qg = q + (int64_t)g * d;
            float block_max = running_max[g];
            int t = 0;
            /* Four tokens at a time: four independent accumulation chains instead of one. */
            for (; t + 4 <= n; t += 4) {
                const float *k0 = k + t * row_stride, *k1 = k0 + row_stride, *k2 = k1 + row_stride,
                            *k3 = k2 + row_stride;
                float s0 = 0.0f, s1 = 0.0f, s2 = 0.0f, s3 = 0.0f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
                for (int i = 0; i < d; i++) {
                    s0 += qg[i] * k0[i];
                    s1 += qg[i] * k1[i];
                    s2 += qg[i] * k2[i];
                    s3 += qg[i] * k3[i];
                }
                scores[g][t] = s0 * scale;
                scores[g][t + 1] = s1 * scale;
                scores[g][t + 2] = s2 * scale;
                scores[g][t + 3] = s3 * scale;
            }
            for (; t < n; t++) {
                const float *kt = k + t * row_stride;
                float score = 0.0f;
#pragma omp simd reduction(+ : score)
                for (int i = 0; i < d; i++) score += qg[i] * kt[i];
                scores[g][t] = score * scale;
            }
            for (t = 0; t < n; t++)
                if (scores[g][t] > block_max) block_max = scores[g][t];
            const float rescale = expf(running_max[g] - block_max);
            float *acc_g = acc[g];
            running_sum[g] *= rescale;
#pragma omp simd
            for (int i = 0; i < d; i++) acc_g[i] *= rescale;
            running_max[g] = block_max;
            float weights[MAX_BLOCK];
            for (t = 0; t < n; t++) {
                weights[t] = expf(scores[g][t] - block_max);
                running_sum[g] += weights[t];
            }
            for (t = 0; t < n; t++) {
                const float *vt = v + t * row_stride;
                const float weight = weights[t];
#pragma omp simd
                for (int i = 0; i < d; i++) acc_g[i] += weight * vt[i];
            }
        }
        pos += n;
    }
    for (int g = 0; g < group; g++) {
        const int64_t row = (int64_t)req * num_heads + (int64_t)kv_head * group + g;
        const float inv = 1.0f / running_sum[g];
        for (int i = 0; i < d; i++) out[row * d + i] = acc[g][i] * inv;
        lse[row] = running_max[g] + logf(running_sum[g]);
    }
}

/* q: [num_reqs, num_heads, head_size]; caches: [num_slots, num_kv_heads, head_size]; block_table:
 * [num_reqs, block_table_stride] int32; request r reads positions start_pos .. seq_lens[r]-1 (each
 * seq_lens[r] > start_pos). Writes out [num_reqs, num_heads, head_size] and lse [num_reqs, num_heads].
 * Returns 0, or -1 for sizes the kernel does not handle. */
int paged_decode_f32(const float *q, const float *k_cache, const float *v_cache, const int32_t *block_table,
                     int64_t block_table_stride, const int32_t *seq_lens, int start_pos, float *out, float *lse,
                     int num_reqs, int num_heads, int num_kv_heads, int head_size, int block_size, float scale,
                     int num_threads) {
    if (num_heads % num_kv_heads != 0 || num_heads / num_kv_heads > MAX_GROUP || head_size > MAX_HEAD_SIZE ||
        block_size > MAX_BLOCK)
        return -1;
    const int items = num_reqs * num_kv_heads;
#pragma omp parallel for schedule(static) num_threads(num_threads)
    for (int item = 0; item < items; item++)
        decode_item(q, k_cache, v_cache, block_table, block_table_stride, seq_lens, start_pos, out, lse, num_heads,
                    num_kv_heads, head_size, block_size, scale, item);
    return 0;
}
