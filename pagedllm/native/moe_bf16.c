/* A mixture-of-experts layer of a bfloat16 model whose experts are kept in gemm_bf16's panels
 * (layers/fused_moe.py's UnquantizedFusedMoEMethod under bf16 panels) in one call: moe_routing.h's routing and expert
 * loop, each expert's [gate | up] through its gated panels with the activation fused (gemm_bf16_silu_mul), its down
 * through its panels (gemm_bf16). The experts' products are those of the model's dense bf16 layers (rows rounded to
 * bf16, float32 sums, AMX tiles where granted), and a decode step replays a CPU graph, the kernel deciding the
 * routing as it runs.
 */
#include <stdint.h>

#include "moe_routing.h"

int gemm_bf16(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y, int64_t ldy, int M,
              int N, int K, int num_threads);
int gemm_bf16_silu_mul(const float *x, int64_t ldx, const uint16_t *packed, const float *bias, float *y,
                       int64_t ldy, int M, int N, int K, int num_threads);

/* The held experts' panels: held expert e's gated [gate | up] at w13 + e * w13_stride, its down at
 * w2 + e * w2_stride. */
typedef struct {
    const uint16_t *w13, *w2;
    int64_t w13_stride, w2_stride;
} Bf16Experts;

static int bf16_expert(const void *weights, int e, const float *rows, int n, int hidden, int inter, float *gate_up,
                       float *act, float *down, int num_threads) {
    (void)gate_up; /* the activation is fused into the gate_up product */
    const Bf16Experts *w = weights;
    const int status = gemm_bf16_silu_mul(rows, hidden, w->w13 + e * w->w13_stride, NULL, act, inter, n, 2 * inter,
                                          hidden, num_threads);
    return status | gemm_bf16(act, inter, w->w2 + e * w->w2_stride, NULL, down, hidden, n, hidden, inter,
                              num_threads);
}

/* out [T, hidden] = the layer's output for x [T, hidden] and router_logits [T, E] from experts [first_expert,
 * first_expert + held) (all of them, or an expert-parallel rank's). Returns 0, -1 for arguments out of range or a
 * product the GEMM refused (no bf16 body here), -2 where memory ran out. */
int moe_bf16(const float *x, const float *router_logits, const uint16_t *w13, int64_t w13_stride, const uint16_t *w2,
             int64_t w2_stride, float *out, int64_t tokens, int hidden, int inter, int num_experts, int first_expert,
             int held, int top_k, int renormalize, int num_threads) {
    const Bf16Experts experts = {w13, w2, w13_stride, w2_stride};
    return run_moe_layer(x, router_logits, out, tokens, hidden, inter, num_experts, first_expert, held, top_k,
                         renormalize, bf16_expert, &experts, num_threads);
}
