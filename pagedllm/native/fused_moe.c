/* A mixture-of-experts feed-forward layer in one call, float32: layers/fused_moe.py's select_experts and
 * fused_experts (routing, then each expert's SiLU-gated MLP over its tokens, weighted into theirs), so that an MoE
 * model's decode step is native calls only and replays a CPU graph (graph.py): the routing depends on the step's
 * values, which a graph can only follow if the kernel decides it as it runs.
 *
 * Routing as moe_routing.h (transformers' softmax and top-k). Then per expert in ascending order, its tokens in
 * ascending order: g = x W13^T ([gate | up], 2 * inter wide), a = silu(g_gate) * g_up, out += (a W2^T) * p,
 * so a token's experts add into it in the order fused_experts' index_add does. Weights as nn.Linear keeps them
 * ([out, in] rows), so each output is a dot product of two contiguous rows: a tile of 2 tokens x 4 weight rows
 * shares its loads, each weight row read once per pair of tokens. Decode steps (a few tokens an expert) stream the
 * experts' weights; the eager torch path keeps larger steps (layers/fused_moe.py: NATIVE_MAX_TOKENS).
 *
 * Threads split each product's weight rows (OpenMP, on torch's threads as fused_ops.c).
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_routing.h"
#include "simd.h"

typedef float vec8 __attribute__((vector_size(32)));

enum { TOKEN_TILE = 2, ROW_TILE = 4 };

/* (macros, not functions: a vec8 passed or returned by value would take a different ABI on CPUs without AVX) */
#define LOAD8(v, p) memcpy(&(v), (p), sizeof(vec8))
#define LANES_SUM(v) ((((v)[0] + (v)[4]) + ((v)[1] + (v)[5])) + (((v)[2] + (v)[6]) + ((v)[3] + (v)[7])))

/* The rest of a dot product past the vectors' k: a scalar sum onto s. */
static inline float dot_tail(float s, const float *x, const float *w, int k, int K) {
    for (; k < K; k++) s += x[k] * w[k];
    return s;
}

/* dot(x, w) over K for one token and one weight row (a tile's edges), in the whole tile's arithmetic. */
static float dot1(const float *x, const float *w, int K) {
    vec8 acc = {0}, a, b;
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        LOAD8(a, x + k);
        LOAD8(b, w + k);
        acc += a * b;
    }
    return dot_tail(LANES_SUM(acc), x, w, k, K);
}

/* A whole tile: out[i * ldo + j] = dot(x_i, w + j * K) for tokens x0, x1 and 4 weight rows, 8 accumulators held in
 * registers (named, not an array, which compilers leave in memory). */
static void dot_tile(const float *x0, const float *x1, const float *w, int K, float *out, int64_t ldo) {
    const float *w0 = w, *w1 = w + K, *w2 = w + 2 * (int64_t)K, *w3 = w + 3 * (int64_t)K;
    vec8 a00 = {0}, a01 = {0}, a02 = {0}, a03 = {0}, a10 = {0}, a11 = {0}, a12 = {0}, a13 = {0};
    vec8 u, v, r0, r1, r2, r3;
    int k = 0;
    for (; k + 8 <= K; k += 8) {
        LOAD8(r0, w0 + k);
        LOAD8(r1, w1 + k);
        LOAD8(r2, w2 + k);
        LOAD8(r3, w3 + k);
        LOAD8(u, x0 + k);
        LOAD8(v, x1 + k);
        a00 += u * r0;
        a01 += u * r1;
        a02 += u * r2;
        a03 += u * r3;
        a10 += v * r0;
        a11 += v * r1;
        a12 += v * r2;
        a13 += v * r3;
    }
    out[0] = dot_tail(LANES_SUM(a00), x0, w0, k, K);
    out[1] = dot_tail(LANES_SUM(a01), x0, w1, k, K);
    out[2] = dot_tail(LANES_SUM(a02), x0, w2, k, K);
    out[3] = dot_tail(LANES_SUM(a03), x0, w3, k, K);
    out[ldo] = dot_tail(LANES_SUM(a10), x1, w0, k, K);
    out[ldo + 1] = dot_tail(LANES_SUM(a11), x1, w1, k, K);
    out[ldo + 2] = dot_tail(LANES_SUM(a12), x1, w2, k, K);
    out[ldo + 3] = dot_tail(LANES_SUM(a13), x1, w3, k, K);
}

/* y[i, :] = xs[i] W^T for the n rows xs (K wide) and W [N, K]; the calling team splits W's rows. */
static void rows_times_weights(const float *const *xs, int n, const float *W, int N, int K, float *y, int64_t ldy) {
#pragma omp for schedule(static)
    for (int j0 = 0; j0 < N; j0 += ROW_TILE) {
        const int nw = N - j0 < ROW_TILE ? N - j0 : ROW_TILE;
        for (int i0 = 0; i0 < n; i0 += TOKEN_TILE) {
            const int nx = n - i0 < TOKEN_TILE ? n - i0 : TOKEN_TILE;
            if (nx == TOKEN_TILE && nw == ROW_TILE) {
                dot_tile(xs[i0], xs[i0 + 1], W + (int64_t)j0 * K, K, y + i0 * ldy + j0, ldy);
                continue;
            }
            for (int i = 0; i < nx; i++)
                for (int j = 0; j < nw; j++)
                    y[(i0 + i) * ldy + j0 + j] = dot1(xs[i0 + i], W + (int64_t)(j0 + j) * K, K);
        }
    }
}

/* out [T, hidden] = the layer's output for x [T, hidden] and router_logits [T, E] (T tokens, E experts); w13
 * [E, 2 * inter, hidden] (each expert's gate rows, then its up rows), w2 [E, hidden, inter]. Returns 0, or -1 for
 * arguments out of range, -2 where memory ran out. */
int fused_moe_f32(const float *x, const float *router_logits, const float *w13, const float *w2, float *out,
                  int64_t tokens, int hidden, int inter, int num_experts, int top_k, int renormalize) {
    const int64_t T = tokens;
    const int E = num_experts;
    Routing routing;
    int status = begin_moe_layer(router_logits, out, T, hidden, inter, E, top_k, renormalize, &routing);
    const int32_t *counts = routing.counts, *order = routing.order;
    const float *weights = routing.weights;
    float *gate_up = NULL, *act = NULL, *down = NULL;
    const float **rows = NULL;
    if (status != 0 || T == 0) goto done;
    gate_up = malloc((size_t)T * 2 * inter * sizeof(float));
    act = malloc((size_t)T * inter * sizeof(float));
    down = malloc((size_t)T * hidden * sizeof(float));
    rows = malloc((size_t)T * sizeof(float *));
    if (!gate_up || !act || !down || !rows) {
        status = -2;
        goto done;
    }
#pragma omp parallel
    for (int e = 0; e < E; e++) {
        const int first = counts[e], n = counts[e + 1] - first;
        if (n == 0) continue;
        const int32_t *pairs = order + first;
#pragma omp single
        for (int i = 0; i < n; i++) rows[i] = x + (int64_t)(pairs[i] / top_k) * hidden;
        rows_times_weights(rows, n, w13 + (int64_t)e * 2 * inter * hidden, 2 * inter, hidden, gate_up, 2 * inter);
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) {
            const float *g = gate_up + (int64_t)i * 2 * inter;
            float *a = act + (int64_t)i * inter;
#pragma omp simd
            for (int c = 0; c < inter; c++) a[c] = silu_mul(g[c], g[inter + c]);
        }
#pragma omp single
        for (int i = 0; i < n; i++) rows[i] = act + (int64_t)i * inter;
        rows_times_weights(rows, n, w2 + (int64_t)e * hidden * inter, hidden, inter, down, hidden);
#pragma omp for schedule(static)
        for (int i = 0; i < n; i++) { /* a token appears once an expert: its row is this thread's alone */
            const float weight = weights[pairs[i]], *d = down + (int64_t)i * hidden;
            float *o = out + (int64_t)(pairs[i] / top_k) * hidden;
            for (int h = 0; h < hidden; h++) o[h] += d[h] * weight;
        }
    }
done:
    free_routing(&routing);
    free(gate_up);
    free(act);
    free(down);
    free(rows);
    return status;
}
