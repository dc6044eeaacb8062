/* A mixture-of-experts layer's routing, as transformers routes (layers/fused_moe.py's select_experts), shared by the
 * native layers of float32 experts (fused_moe.c) and of quantized ones (moe_quant.c): per token p = softmax(logits)
 * (exp of logit - max over their sum), its top_k largest (the lower expert of equals first), divided by their sum
 * with renormalize; then the (token, slot) pairs sorted by expert, tokens ascending within each, as fused_experts'
 * stable sort orders them. */
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

#endif
