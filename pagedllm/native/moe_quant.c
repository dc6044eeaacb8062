/* A mixture-of-experts layer of GGUF experts kept packed (layers/quantization/gguf_moe.py) in one call: the routing
 * (moe_routing.h, as the torch path's select_experts), then per expert in ascending order its tokens' rows gathered,
 * g = x W13^T through the expert's quantized panels (gemm_quant_f32: one [gate | up] weight, or the gate's and the
 * up's each writing its half), a = silu(g_gate) * g_up, out += (a W2^T) * p per token, in the torch path's order
 * (routed_experts' index_add). So a decode step of such a model is native calls only and replays a CPU graph
 * (graph.py): the routing depends on the step's values, which a graph can only follow if the kernel decides it.
 *
 * The experts' panels are passed as addresses (int64, one table per projection), their formats as gemm_quant_f32
 * numbers them; each product splits its panels over the threads as gemm_quant_f32 does.
 *
 * In a bfloat16 model on AMX (the caller passes gemm_bf16, which lives in the other library, by address) an expert
 * with bf16_min_rows rows or more multiplies as the model's dense quantized layers do in such steps
 * (layers/gemm_layout.py's QuantizedWeight): each projection's panels are dequantized into bf16 panels
 * (dequant_bf16_panels) and multiplied on the tiles (rows rounded to bf16, float32 sums), which outpaces the float32
 * FMAs over the codes from about that many rows on; fewer rows keep the quantized panels, whose bytes bound them.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "moe_routing.h"
#include "simd.h"

int gemm_quant_f32(const float *x, int64_t ldx, const uint8_t *packed, const float *bias, float *y, int64_t ldy,
                   int M, int N, int K, int num_threads, int format);
int dequant_bf16_panels(const uint8_t *packed, uint16_t *out, int N, int K, int num_threads, int format);

/* gemm_bf16's signature (gemm_bf16.c). */
typedef int (*Bf16Gemm)(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                        int64_t ldy, int M, int N, int K, int num_threads);

/* The experts' panels by address and their formats (gemm_quant_f32's numbers); where bf16_gemm is given, a scratch
 * for the largest projection as bf16 panels, and the rows from which an expert takes that path. */
typedef struct {
    const int64_t *w13, *w2;
    const int32_t *w13_formats, *w2_formats;
    Bf16Gemm bf16_gemm;
    uint16_t *bf16_panels;
    int bf16_min_rows;
} QuantExperts;

/* y [n, N] (rows ldy apart) = rows [n, K] @ W^T for W in `format`'s panels at `packed`: through bf16 panels on the
 * tiles where the experts take that path for n rows and dequant_bf16_panels takes the format, else the quantized
 * panels. */
static int expert_product(const QuantExperts *w, const float *rows, int n, const uint8_t *packed, int format,
                          float *y, int64_t ldy, int N, int K, int num_threads) {
    if (w->bf16_gemm != NULL && n >= w->bf16_min_rows &&
        dequant_bf16_panels(packed, w->bf16_panels, N, K, num_threads, format) == 0)
        return w->bf16_gemm(rows, K, w->bf16_panels, NULL, y, ldy, n, N, K, num_threads);
    return gemm_quant_f32(rows, K, packed, NULL, y, ldy, n, N, K, num_threads, format);
}

/* Expert e's MLP (moe_routing.h's ExpertMLP): its gate and up are w13[2e] (format w13_formats[2e]), 2 * inter
 * outputs, where w13[2e + 1] is 0; else the gate (inter outputs) and w13[2e + 1] the up (inter outputs). Its down is
 * w2[e] (w2_formats[e]), hidden outputs over inter inputs. */
static int quant_expert(const void *weights, int e, const float *rows, int n, int hidden, int inter, float *gate_up,
                        float *act, float *down, int num_threads) {
    const QuantExperts *w = weights;
    const uint8_t *gate = (const uint8_t *)(intptr_t)w->w13[2 * e], *up = (const uint8_t *)(intptr_t)w->w13[2 * e + 1];
    int status;
    if (up == NULL) {
        status = expert_product(w, rows, n, gate, w->w13_formats[2 * e], gate_up, 2 * inter, 2 * inter, hidden,
                                num_threads);
    } else {
        status = expert_product(w, rows, n, gate, w->w13_formats[2 * e], gate_up, 2 * inter, inter, hidden,
                                num_threads);
        status |= expert_product(w, rows, n, up, w->w13_formats[2 * e + 1], gate_up + inter, 2 * inter, inter,
                                 hidden, num_threads);
    }
    for (int i = 0; i < n; i++) {
        const float *g = gate_up + (int64_t)i * 2 * inter;
        float *a = act + (int64_t)i * inter;
#pragma omp simd
        for (int c = 0; c < inter; c++) a[c] = silu_mul(g[c], g[inter + c]);
    }
    return status | expert_product(w, act, n, (const uint8_t *)(intptr_t)w->w2[e], w->w2_formats[e], down, hidden,
                                   hidden, inter, num_threads);
}

/* Elements of a weight of N outputs x K inputs as gemm_bf16's panels: both padded to whole 32s. */
static int64_t bf16_panel_elements(int N, int K) { return (int64_t)(N + 31) / 32 * 32 * ((K + 31) / 32 * 32); }

/* out [T, hidden] = the layer's output for x [T, hidden] and router_logits [T, E] (quant_expert: the tables);
 * bf16_gemm: gemm_bf16, for experts of bf16_min_rows rows or more, or NULL. Returns 0, -1 for arguments out of range
 * or a product the GEMM refused, -2 where memory ran out. */
int moe_quant_f32(const float *x, const float *router_logits, const int64_t *w13, const int32_t *w13_formats,
                  const int64_t *w2, const int32_t *w2_formats, float *out, int64_t tokens, int hidden, int inter,
                  int num_experts, int top_k, int renormalize, int num_threads, const void *bf16_gemm,
                  int bf16_min_rows) {
    QuantExperts experts = {w13, w2, w13_formats, w2_formats, NULL, NULL, bf16_min_rows};
    if (bf16_gemm != NULL && tokens * top_k >= bf16_min_rows) { /* else no expert has the rows */
        const int64_t gate_up = bf16_panel_elements(2 * inter, hidden), down = bf16_panel_elements(hidden, inter);
        experts.bf16_panels = malloc((size_t)(gate_up > down ? gate_up : down) * sizeof(uint16_t));
        if (experts.bf16_panels == NULL) return -2;
        experts.bf16_gemm = (Bf16Gemm)bf16_gemm;
    }
    const int status = run_moe_layer(x, router_logits, out, tokens, hidden, inter, num_experts, 0, num_experts, top_k,
                                     renormalize, quant_expert, &experts, num_threads);
    free(experts.bf16_panels);
    return status;
}
