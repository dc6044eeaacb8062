/* Fused float32 element-wise kernels for the decoder layer: each one pass over its rows instead of the
 * chain of separate torch ops (add, pow, mean, rsqrt, mul, mul / chunk, silu, mul / chunk, mul, mul, sub,
 * cat / index_copy_ of a strided view) that each read and write the whole activation. With the embedding
 * lookups here too, a decode step's forward is native calls only, which a CPU graph can replay (graph.py).
 *
 * Row-parallel with OpenMP on torch's own threads (the library binds to the libgomp.so.1 torch has loaded); small
 * calls stay on one thread.
 * Plain C written to vectorise: the exp is a polynomial, no libm call in the inner loops.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "simd.h"

#define PARALLEL_MIN_FLOATS 32768 /* below this a parallel region costs more than it saves */

/* out = src / rms(src) * weight over n floats, in the reference's order: (src * rsqrt(mean(src^2) + eps)) * weight;
 * out may be src. */
static inline void rms_norm_row(const float *src, const float *weight, float *out, int n, float eps) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int i = 0; i < n; i++) squares += src[i] * src[i];
    const float inv_rms = 1.0f / sqrtf(squares / (float)n + eps);
#pragma omp simd
    for (int i = 0; i < n; i++) out[i] = (src[i] * inv_rms) * weight[i];
}

/* out = x / rms(x) * weight per row (rms_norm_row). When residual is given, x + residual is normalised and also
 * written to sum_out. Rows are hidden floats apart. */
void add_rms_norm_f32(const float *x, const float *residual, const float *weight, float *out, float *sum_out,
                      int64_t rows, int hidden, float eps) {
#pragma omp parallel for schedule(static) if (rows * hidden >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        const float *xt = x + t * hidden;
        float *ot = out + t * hidden;
        const float *src = xt;
        if (residual != NULL) {
            const float *rt = residual + t * hidden;
            float *st = sum_out + t * hidden;
#pragma omp simd
            for (int i = 0; i < hidden; i++) st[i] = xt[i] + rt[i];
            src = st;
        }
        rms_norm_row(src, weight, ot, hidden, eps);
    }
}

/* In place, each of the first num_heads heads of head_size floats of each row (rows row_stride floats apart: a
 * view of the QKV projection's output) becomes head / rms(head) * weight (rms_norm_row): Qwen3's per-head q and k
 * norms, which must run before the rotary embedding. */
void head_rms_norm_f32(float *x, int64_t row_stride, const float *weight, int64_t rows, int num_heads,
                       int head_size, float eps) {
#pragma omp parallel for schedule(static) if (rows * num_heads * head_size >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        for (int h = 0; h < num_heads; h++) {
            float *xh = x + t * row_stride + (int64_t)h * head_size;
            rms_norm_row(xh, weight, xh, head_size, eps);
        }
    }
}

/* The gated activations: act(g) * u. */
enum { SILU_MUL, GELU_TANH_MUL };

/* out[i] = act(gate[i]) * up[i], act(g) * u being act_mul(g, u) (inlined: the caller passes a constant). */
static inline __attribute__((always_inline)) void gated_row(const float *gate, const float *up, float *out, int d,
                                                            float (*act_mul)(float, float)) {
#pragma omp simd
    for (int i = 0; i < d; i++) out[i] = act_mul(gate[i], up[i]);
}

/* out[t] = act(x[t, :d]) * x[t, d:] for rows of 2d floats. The activation is chosen per row inside the parallel
 * loop: the compiler outlines the loop into one function, so a function pointer passed from outside it would be
 * called per element there, unvectorised. */
static void gated_rows(const float *x, float *out, int64_t rows, int d, int activation) {
#pragma omp parallel for schedule(static) if (rows * d >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        const float *gate = x + t * 2 * d, *up = gate + d;
        if (activation == SILU_MUL) gated_row(gate, up, out + t * d, d, silu_mul);
        else gated_row(gate, up, out + t * d, d, gelu_tanh_mul);
    }
}

/* SwiGLU: silu(x[t, :d]) * x[t, d:]. */
void silu_and_mul_f32(const float *x, float *out, int64_t rows, int d) { gated_rows(x, out, rows, d, SILU_MUL); }

/* GeGLU: gelu_tanh(x[t, :d]) * x[t, d:]. */
void gelu_tanh_and_mul_f32(const float *x, float *out, int64_t rows, int d) {
    gated_rows(x, out, rows, d, GELU_TANH_MUL);
}

/* Neox-style rotary in place on the first `heads` heads of each row (rows row_stride floats apart: the
 * query and key heads at the front of a fused QKV row). Row t is at positions[t]; cos_sin_cache holds per
 * position rotary_dim / 2 cosines then as many sines. Returns -1, having rotated nothing, when a position is
 * outside the cache's num_positions. */
int rotary_neox_f32(float *x, int64_t row_stride, const int64_t *positions, const float *cos_sin_cache,
                    int64_t num_positions, int64_t rows, int heads, int head_size, int rotary_dim) {
    for (int64_t t = 0; t < rows; t++)
        if (positions[t] < 0 || positions[t] >= num_positions) return -1;
    const int half = rotary_dim / 2;
#pragma omp parallel for schedule(static) if (rows * heads * head_size >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        const float *c = cos_sin_cache + positions[t] * rotary_dim, *s = c + half;
        for (int h = 0; h < heads; h++) {
            float *x1 = x + t * row_stride + (int64_t)h * head_size, *x2 = x1 + half;
#pragma omp simd
            for (int i = 0; i < half; i++) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
    return 0;
}

/* out[t] = weight[ids[t]] * scale for rows of dim floats (scale 1: a copy). Returns -1, having written nothing,
 * when an id is outside the vocab_rows rows. */
int embedding_f32(const int64_t *ids, const float *weight, float *out, int64_t rows, int dim, int64_t vocab_rows,
                  float scale) {
    for (int64_t t = 0; t < rows; t++)
        if (ids[t] < 0 || ids[t] >= vocab_rows) return -1;
    for (int64_t t = 0; t < rows; t++) {
        const float *w = weight + ids[t] * dim;
        float *o = out + t * dim;
        if (scale == 1.0f) {
            memcpy(o, w, sizeof(float) * dim);
            continue;
        }
#pragma omp simd
        for (int i = 0; i < dim; i++) o[i] = w[i] * scale;
    }
    return 0;
}

/* out[t] = the int8-coded row ids[t] (Q8_0: a scale per block of 32, Q6_K: per 16) dequantized: code * its
 * block's scale (one rounding, as torch's codes.float() * scales), then times scale (a second rounding, as the
 * dequantized weight's rows times it). Returns -1, having written nothing, when an id is outside the vocab_rows
 * rows. */
int embedding_q8_f32(const int64_t *ids, const int8_t *codes, const float *scales, float *out, int64_t rows,
                     int dim, int64_t vocab_rows, float scale, int block) {
    for (int64_t t = 0; t < rows; t++)
        if (ids[t] < 0 || ids[t] >= vocab_rows) return -1;
    for (int64_t t = 0; t < rows; t++) {
        const int8_t *c = codes + ids[t] * dim;
        const float *s = scales + ids[t] * (dim / block);
        float *o = out + t * dim;
#pragma omp simd
        for (int i = 0; i < dim; i++) o[i] = ((float)c[i] * s[i / block]) * scale;
    }
    return 0;
}

/* out[t] = the index of row t's largest value, the first of equal ones, a NaN counting as largest (the first
 * NaN), as torch.argmax, in a fraction of its time: greedy sampling over a decode batch's logits. One pass for the
 * maximum (and whether there is a NaN), one to find where it is. */
void argmax_rows_f32(const float *x, int64_t rows, int64_t cols, int64_t *out) {
#pragma omp parallel for schedule(static) if (rows * cols >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        const float *xt = x + t * cols;
        float best = -INFINITY;
        int has_nan = 0;
#pragma omp simd reduction(max : best) reduction(| : has_nan)
        for (int64_t i = 0; i < cols; i++) {
            best = xt[i] > best ? xt[i] : best;
            has_nan |= xt[i] != xt[i];
        }
        int64_t at = 0;
        while (at < cols && (has_nan ? xt[at] == xt[at] : xt[at] != best)) at++;
        out[t] = at < cols ? at : 0;
    }
}

/* out[t] += sigmoid(gate[t]) * x[t] over rows of d floats, gate one float a row: Qwen2-MoE's shared expert, weighted
 * by its gate, into the routed experts' sum (models/moe.py). */
void add_sigmoid_gated_f32(const float *gate, const float *x, float *out, int64_t rows, int d) {
#pragma omp parallel for schedule(static) if (rows * d >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        const float weight = 1.0f / (1.0f + expf(-gate[t]));
        const float *xt = x + t * d;
        float *ot = out + t * d;
#pragma omp simd
        for (int i = 0; i < d; i++) ot[i] += weight * xt[i];
    }
}
