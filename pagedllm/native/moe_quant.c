/* A mixture-of-experts layer of GGUF experts kept packed (layers/quantization/gguf_moe.py) in one call: the routing
 * (moe_routing.h, as the torch path's select_experts), then per expert in ascending order its tokens' rows gathered,
 * g = x W13^T through the expert's quantized panels (gemm_quant_f32: one [gate | up] weight, or the gate's and the
 * up's each writing its half), a = silu(g_gate) * g_up, out += (a W2^T) * p per token, in the torch path's order
 * (routed_experts' index_add). So a decode step of such a model is native calls only and replays a CPU graph
 * (graph.py): the routing depends on the step's values, which a graph can only follow if the kernel decides it.
 *
 * The experts' panels are passed as addresses (int64, one table per projection), their formats as gemm_quant_f32
 * numbers them; each product splits its panels over the threads as gemm_quant_f32 does.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_routing.h"
#include "simd.h"

int gemm_quant_f32(const float *x, int64_t ldx, const uint8_t *packed, const float *bias, float *y, int64_t ldy,
                   int M, int N, int K, int num_threads, int format);

/* The experts' panels by address and their formats (gemm_quant_f32's numbers). */
typedef struct {
    const int64_t *w13, *w2;
    const int32_t *w13_formats, *w2_formats;
} QuantExperts;

/* Expert e's MLP (moe_routing.h's ExpertMLP): its gate and up are w13[2e] (format w13_formats[2e]), 2 * inter
 * outputs, where w13[2e + 1] is 0; else the gate (inter outputs) and w13[2e + 1] the up (inter outputs). Its down is
 * w2[e] (w2_formats[e]), hidden outputs over inter inputs. */
static int quant_expert(const void *weights, int e, const float *rows, int n, int hidden, int inter, float *gate_up,
                        float *act, float *down, int num_threads) {
    const QuantExperts *w = weights;
    const uint8_t *gate = (const uint8_t *)(intptr_t)w->w13[2 * e], *up = (const uint8_t *)(intptr_t)w->w13[2 * e + 1];
    int status;
    if (up == NULL) {
        status = gemm_quant_f32(rows, hidden, gate, NULL, gate_up, 2 * inter, n, 2 * inter, hidden, num_threads,
                                w->w13_formats[2 * e]);
    } else {
        status = gemm_quant_f32(rows, hidden, gate, NULL, gate_up, 2 * inter, n, inter, hidden, num_threads,
                                w->w13_formats[2 * e]);
        status |= gemm_quant_f32(rows, hidden, up, NULL, gate_up + inter, 2 * inter, n, inter, hidden, num_threads,
                                 w->w13_formats[2 * e + 1]);
    }
    for (int i = 0; i < n; i++) {
        const float *g = gate_up + (int64_t)i * 2 * inter;
        float *a = act + (int64_t)i * inter;
#pragma omp simd
        for (int c = 0; c < inter; c++) a[c] = silu_mul(g[c], g[inter + c]);
    }
    return status | gemm_quant_f32(act, inter, (const uint8_t *)(intptr_t)w->w2[e], NULL, down, hidden, n, hidden,
                                   inter, num_threads, w->w2_formats[e]);
}

/* out [T, hidden] = the layer's output for x [T, hidden] and router_logits [T, E] (quant_expert: the tables).
 * Returns 0, -1 for arguments out of range or a product the GEMM refused, -2 where memory ran out. */
int moe_quant_f32(const float *x, const float *router_logits, const int64_t *w13, const int32_t *w13_formats,
                  const int64_t *w2, const int32_t *w2_formats, float *out, int64_t tokens, int hidden, int inter,
                  int num_experts, int top_k, int renormalize, int num_threads) {
    const QuantExperts experts = {w13, w2, w13_formats, w2_formats};
    return run_moe_layer(x, router_logits, out, tokens, hidden, inter, num_experts, 0, num_experts, top_k,
                         renormalize, quant_expert, &experts, num_threads);
}
