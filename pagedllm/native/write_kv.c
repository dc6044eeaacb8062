/* KV-cache writes, part of the fused_ops library: this step's float32 K and V rows into the paged cache at their
 * slots, as the cache holds them: float32, bf16, or one byte (kv_cache_dtype fp8_e4m3, fp8_e5m2 or int8; the
 * layouts in paged_attention.h). Each value is rounded exactly as the torch path rounds it
 * (kv_cache_dtype.quantize_rows), so the two paths write the same bytes.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#define PARALLEL_MIN_FLOATS 32768 /* below this a parallel region costs more than it saves */

static int slots_in_range(const int64_t *slot_mapping, int64_t rows, int64_t num_slots) {
    for (int64_t t = 0; t < rows; t++)
        if (slot_mapping[t] < 0 || slot_mapping[t] >= num_slots) return 0;
    return 1;
}

/* key_cache[slot_mapping[t]] = key[t] and the same for value; rows of row_floats, the sources row_stride
 * floats apart (views into the fused QKV output), the caches dense with num_slots rows. Returns -1, having
 * written nothing, when a slot is out of range. */
int write_kv_f32(const float *key, const float *value, int64_t row_stride, float *key_cache, float *value_cache,
                 int64_t num_slots, const int64_t *slot_mapping, int64_t rows, int row_floats) {
    if (!slots_in_range(slot_mapping, rows, num_slots)) return -1;
#pragma omp parallel for schedule(static) if (rows * row_floats >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        const int64_t slot = slot_mapping[t];
        memcpy(key_cache + slot * row_floats, key + t * row_stride, sizeof(float) * row_floats);
        memcpy(value_cache + slot * row_floats, value + t * row_stride, sizeof(float) * row_floats);
    }
    return 0;
}

/* x rounded to bf16, to nearest even as torch rounds (a NaN stays a quiet NaN). */
static inline uint16_t bf16_bits(float x) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((bits >> 16) | 0x40u);
    return (uint16_t)((bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16);
}

/* write_kv_f32 into bf16 caches (a bfloat16 model whose activations are float32), each value rounded. */
int write_kv_bf16(const float *key, const float *value, int64_t row_stride, uint16_t *key_cache,
                  uint16_t *value_cache, int64_t num_slots, const int64_t *slot_mapping, int64_t rows,
                  int row_floats) {
    if (!slots_in_range(slot_mapping, rows, num_slots)) return -1;
#pragma omp parallel for schedule(static) if (rows * row_floats >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        uint16_t *k = key_cache + slot_mapping[t] * row_floats, *v = value_cache + slot_mapping[t] * row_floats;
        const float *kt = key + t * row_stride, *vt = value + t * row_stride;
#pragma omp simd
        for (int i = 0; i < row_floats; i++) {
            k[i] = bf16_bits(kt[i]);
            v[i] = bf16_bits(vt[i]);
        }
    }
    return 0;
}

/* x as an fp8 of M mantissa bits and exponent bias BIAS, rounded to nearest even, first clamped to +-max_finite
 * (torch's conversion of x.clamp(-max_finite, max_finite)); a NaN stays a NaN (S.1111111 in both formats). */
static inline uint8_t fp8_bits(float x, const int M, const int BIAS, const float max_finite) {
    uint32_t bits;
    memcpy(&bits, &x, sizeof bits);
    const uint8_t sign = (uint8_t)((bits >> 24) & 0x80u);
    float magnitude = fabsf(x);
    if (magnitude != magnitude) return sign | 0x7Fu;
    if (magnitude > max_finite) magnitude = max_finite;
    const float min_normal = 1.0f / (float)(1 << (BIAS - 1)), subnormal_step = min_normal / (float)(1 << M);
    if (magnitude < min_normal) /* a multiple of the subnormal step; 2^M of them is the smallest normal's code */
        return sign | (uint8_t)nearbyintf(magnitude / subnormal_step);
    memcpy(&bits, &magnitude, sizeof bits);
    const int drop = 23 - M; /* float32 mantissa bits dropped, rounded to nearest even */
    bits += (1u << (drop - 1)) - 1u + ((bits >> drop) & 1u);
    const int exponent = (int)(bits >> 23) - 127 + BIAS; /* max_finite rounds to itself: no overflow */
    return sign | (uint8_t)(exponent << M) | (uint8_t)((bits >> drop) & ((1u << M) - 1u));
}

/* Row t of key/value (row_stride floats apart, row_floats each: heads of head_size) into slot slot_mapping[t] of the
 * caches as fp8, head h's keys divided by k_scale[h] and its values by v_scale[h] first (the layer's scales, per KV
 * head: float32 division, as the torch path's); -1 (nothing written) for a slot outside num_slots. */
static int write_kv_fp8(const float *key, const float *value, int64_t row_stride, uint8_t *key_cache,
                        uint8_t *value_cache, int64_t num_slots, const int64_t *slot_mapping, int64_t rows,
                        int row_floats, int head_size, const float *k_scale, const float *v_scale, const int M,
                        const int BIAS, const float max_finite) {
    if (!slots_in_range(slot_mapping, rows, num_slots)) return -1;
#pragma omp parallel for schedule(static) if (rows * row_floats >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < rows; t++) {
        uint8_t *k = key_cache + slot_mapping[t] * row_floats, *v = value_cache + slot_mapping[t] * row_floats;
        const float *kt = key + t * row_stride, *vt = value + t * row_stride;
        for (int i = 0; i < row_floats; i++) {
            k[i] = fp8_bits(kt[i] / k_scale[i / head_size], M, BIAS, max_finite);
            v[i] = fp8_bits(vt[i] / v_scale[i / head_size], M, BIAS, max_finite);
        }
    }
    return 0;
}

int write_kv_fp8_e4m3(const float *key, const float *value, int64_t row_stride, uint8_t *key_cache,
                      uint8_t *value_cache, int64_t num_slots, const int64_t *slot_mapping, int64_t rows,
                      int row_floats, int head_size, const float *k_scale, const float *v_scale) {
    return write_kv_fp8(key, value, row_stride, key_cache, value_cache, num_slots, slot_mapping, rows, row_floats,
                        head_size, k_scale, v_scale, 3, 7, 448.0f);
}

int write_kv_fp8_e5m2(const float *key, const float *value, int64_t row_stride, uint8_t *key_cache,
                      uint8_t *value_cache, int64_t num_slots, const int64_t *slot_mapping, int64_t rows,
                      int row_floats, int head_size, const float *k_scale, const float *v_scale) {
    return write_kv_fp8(key, value, row_stride, key_cache, value_cache, num_slots, slot_mapping, rows, row_floats,
                        head_size, k_scale, v_scale, 2, 15, 57344.0f);
}

/* One head's n floats as int8 codes round(x * 127 / max|x|) (to nearest even) followed by the float32 scale
 * max|x| / 127 (all codes and the scale 0 for a row of zeros). As torch's amax, the max is a NaN where the row holds
 * one (fmaxf would skip it), so the scale is a NaN and the whole row reads back NaN; a code that is no number (x * 0
 * for a NaN or infinite x, under a scale of NaN or infinity) is 0, as torch's conversion writes it. */
static inline void quantize_int8_row(const float *x, int8_t *out, int n) {
    float amax = 0.0f;
    for (int i = 0; i < n; i++) {
        const float a = fabsf(x[i]);
        amax = a > amax || a != a ? a : amax;
    }
    const float inverse = amax > 0.0f ? 127.0f / amax : 0.0f, scale = amax / 127.0f;
    for (int i = 0; i < n; i++) {
        const float code = nearbyintf(x[i] * inverse);
        out[i] = code == code ? (int8_t)code : 0;
    }
    memcpy(out + n, &scale, sizeof scale);
}

/* As write_kv_fp8, into int8 caches whose slots hold row_floats / head_size heads of head_size codes and a scale. */
int write_kv_int8(const float *key, const float *value, int64_t row_stride, int8_t *key_cache, int8_t *value_cache,
                  int64_t num_slots, const int64_t *slot_mapping, int64_t rows, int row_floats, int head_size) {
    if (!slots_in_range(slot_mapping, rows, num_slots)) return -1;
    const int heads = row_floats / head_size, slot_bytes = heads * (head_size + (int)sizeof(float));
#pragma omp parallel for schedule(static) if (rows * row_floats >= PARALLEL_MIN_FLOATS)
    for (int64_t t = 0; t < rows; t++)
        for (int h = 0; h < heads; h++) {
            const int64_t at = slot_mapping[t] * slot_bytes + h * (head_size + (int)sizeof(float));
            quantize_int8_row(key + t * row_stride + h * head_size, key_cache + at, head_size);
            quantize_int8_row(value + t * row_stride + h * head_size, value_cache + at, head_size);
        }
    return 0;
}
