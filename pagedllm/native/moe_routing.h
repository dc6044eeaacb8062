/* A mixture-of-experts layer's routing, as transformers routes (layers/fused_moe.py's select_experts), shared by the
 * native layers of float32 experts (fused_moe.c), of quantized ones (moe_quant.c) and of bf16 panels (moe_bf16.c):
 * per token p = softmax(logits) (exp of logit - max over their sum), its top_k largest (the lower expert of equals
 * first), divided by their sum with renormalize; then the (token, slot) pairs sorted by expert, tokens ascending
 * within each, as fused_experts' stable sort orders them. The last two run their experts through run_moe_layer. */
#ifndef PAGEDLLM_MOE_ROUTING_H
#define PAGEDLLM_MOE_ROUTING_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* A token's top_k experts (ids) and weights from its E logits. */
static inline void route(const float *logits, int E, int top_k, int renormalize, float *probs, int32_t *ids,
                  float *weights) {
    float max = logits[0], sum = 0.0f;
    for (int e = 1; e < E; e++) max = logits[e] > max ? logits[e] : max;
    for (int e = 0; e < E; e++) sum += probs[e] = expf(logits[e] - max);
    for (int e = 0; e < E; e++) probs[e] /= sum;
    float total = 0.0f;
    for (int j = 0; j < top_k; j++) {
        int best = -1;
        for (int e = 0; e < E; e++) {
            int taken = 0;
            for (int i = 0; i < j; i++) taken |= ids[i] == e;
            if (!taken && (best < 0 || probs[e] > probs[best])) best = e;
        }
        ids[j] = best;
        total += weights[j] = probs[best];
    }
    if (renormalize)
        for (int j = 0; j < top_k; j++) weights[j] /= total;
}

/* Routes T tokens by their router_logits [T, E]: ids and weights [T * top_k] (token t's slot j at t * top_k + j), and
 * the pairs by expert: expert e's are order[counts[e] .. counts[e + 1]) (counts: E + 1 entries). Returns 0, or -2
 * where memory ran out. */
static inline int route_tokens(const float *router_logits, int64_t T, int E, int top_k, int renormalize,
                               int32_t *ids, float *weights, int32_t *counts, int32_t *order) {
    float *probs = malloc((size_t)T * E * sizeof(float) + 1);
    int32_t *next = malloc((size_t)E * sizeof(int32_t));
    if (!probs || !next) {
        free(probs);
        free(next);
        return -2;
    }
#pragma omp parallel for schedule(static) if (T * E >= 4096)
    for (int64_t t = 0; t < T; t++)
        route(router_logits + t * E, E, top_k, renormalize, probs + t * E, ids + t * top_k, weights + t * top_k);
    memset(counts, 0, ((size_t)E + 1) * sizeof(int32_t)); /* a counting sort */
    for (int64_t p = 0; p < T * top_k; p++) counts[ids[p] + 1]++;
    for (int e = 0; e < E; e++) counts[e + 1] += counts[e];
    memcpy(next, counts, (size_t)E * sizeof(int32_t));
    for (int64_t p = 0; p < T * top_k; p++) order[next[ids[p]]++] = (int32_t)p;
    free(probs);
    free(next);
    return 0;
}

/* A layer's routing: ids, weights and order [T * top_k], counts [E + 1] (see route_tokens). */
typedef struct {
    int32_t *ids, *counts, *order;
    float *weights;
} Routing;

static inline void free_routing(Routing *r) {
    free(r->ids);
    free(r->counts);
    free(r->order);
    free(r->weights);
}

/* A layer's start: checks its sizes, zeroes out [T, hidden] and routes the T tokens into r. Returns 0, -1 for sizes
 * out of range, -2 where memory ran out; the caller frees r with free_routing whatever it returns. */
static inline int begin_moe_layer(const float *router_logits, float *out, int64_t T, int hidden, int inter, int E,
                                  int top_k, int renormalize, Routing *r) {
    memset(r, 0, sizeof *r);
    if (T < 0 || hidden <= 0 || inter <= 0 || E <= 0 || top_k <= 0 || top_k > E) return -1;
    memset(out, 0, (size_t)T * hidden * sizeof(float));
    r->ids = malloc((size_t)T * top_k * sizeof(int32_t) + 1);
    r->counts = malloc(((size_t)E + 1) * sizeof(int32_t));
    r->order = malloc((size_t)T * top_k * sizeof(int32_t) + 1);
    r->weights = malloc((size_t)T * top_k * sizeof(float) + 1);
    if (!r->ids || !r->counts || !r->order || !r->weights) return -2;
    return route_tokens(router_logits, T, E, top_k, renormalize, r->ids, r->weights, r->counts, r->order);
}

/* One expert's SiLU-gated MLP, as a library's GEMMs run it (moe_quant.c, moe_bf16.c): expert e of `weights` (its
 * index among the experts held) over
 * its n gathered rows [n, hidden] into down [n, hidden], with scratch gate_up [n, 2 * inter] and act [n, inter].
 * Returns 0, or a negative status. */
typedef int (*ExpertMLP)(const void *weights, int e, const float *rows, int n, int hidden, int inter,
                         float *gate_up, float *act, float *down, int num_threads);

/* out [T, hidden] = the layer's output for x [T, hidden] and router_logits [T, E] from the experts held, [held_from,
 * held_from + held) (an expert-parallel rank's; all E otherwise): the routing over all E, then per held expert in
 * ascending order its tokens' rows gathered, its MLP, and out += down * p per token, in the torch path's order
 * (routed_experts' index_add). Returns 0, -1 for sizes out of range or an MLP that failed, -2 where memory ran
 * out. */
static inline int run_moe_layer(const float *x, const float *router_logits, float *out, int64_t T, int hidden,
                                int inter, int E, int held_from, int held, int top_k, int renormalize, ExpertMLP mlp,
                                const void *weights, int num_threads) {
    Routing routing;
    int status = begin_moe_layer(router_logits, out, T, hidden, inter, E, top_k, renormalize, &routing);
    float *rows = NULL, *gate_up = NULL, *act = NULL, *down = NULL;
    if (status == 0 && (held_from < 0 || held <= 0 || held_from + held > E)) status = -1;
    if (status != 0 || T == 0) goto done;
    rows = malloc((size_t)T * hidden * sizeof(float));
    gate_up = malloc((size_t)T * 2 * inter * sizeof(float));
    act = malloc((size_t)T * inter * sizeof(float));
    down = malloc((size_t)T * hidden * sizeof(float));
    if (!rows || !gate_up || !act || !down) {
        status = -2;
        goto done;
    }
    for (int e = held_from; e < held_from + held && status == 0; e++) {
        const int first = routing.counts[e], n = routing.counts[e + 1] - first;
        if (n == 0) continue;
        const int32_t *pairs = routing.order + first;
        for (int i = 0; i < n; i++) /* the expert's tokens' rows, gathered: the GEMMs take rows ldx apart */
            memcpy(rows + (int64_t)i * hidden, x + (int64_t)(pairs[i] / top_k) * hidden,
                   (size_t)hidden * sizeof(float));
        status = mlp(weights, e - held_from, rows, n, hidden, inter, gate_up, act, down, num_threads) < 0 ? -1 : 0;
        for (int i = 0; i < n && status == 0; i++) { /* a token appears once an expert */
            const float weight = routing.weights[pairs[i]], *d = down + (int64_t)i * hidden;
            float *o = out + (int64_t)(pairs[i] / top_k) * hidden;
#pragma omp simd
            for (int h = 0; h < hidden; h++) o[h] += d[h] * weight;
        }
    }
done:
    free_routing(&routing);
    free(rows);
    free(gate_up);
    free(act);
    free(down);
    return status;
}

#endif
