/* The quantized kernels of gemm_quant_f32 (gemm.c), generic in the format (fmt, a constant in each instance): its
 * formats, their panels' layout, and the tiles that multiply rows by their codes. Each format is instantiated
 * (QUANT_KERNELS) in one of the gemm_quant_*.c files, a few formats a file, so that the library's formats compile in
 * parallel (native/build.py runs a compiler a file) instead of one after another in one compiler; gemm.c calls
 * them by the format's number. */
#ifndef GEMM_QUANT_H
#define GEMM_QUANT_H

#include "gemm.h"

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
/* ---- Quantized panels: GGUF Q4_0/Q4_1 (format Q4), Q4_K (Q4K), Q8_0 (Q8), Q6_K and Q3_K (Q6K), Q5_K (Q5K), Q2_K
 * (Q2K), IQ4_NL (IQ4NL) and IQ4_XS (IQ4XS) ----
 * Per block of 32 along K (Q6K and Q2K: 16), a record: the 64 columns' scales (fp16 for Q4, Q8 and IQ4NL; float32
 * for the others, as d * sc of a K-quant's sub-block is no fp16 value), for Q4, Q4K, Q5K and Q2K their float32
 * zeros, then a row of codes per k. Q4, Q4K and the IQ4 formats' rows are 32 bytes of nibbles, column i in the low
 * nibble of byte i and column 32 + i in its high one; Q8, Q6K, Q5K and Q2K rows are 64 int8 codes (Q6_K's q - 32,
 * Q5_K's and Q2_K's q). A weight is code * scale + zero (Q4_0: zero -8 d, Q4_1: m, Q4_K, Q5_K and
 * Q2_K: -dmin m; none for Q8, Q6K and the IQ4 formats). A code of up to 5 bits times an fp16 scale or a d * sc is
 * exact in float32, so such a weight rounds once, at the zero's add; Q6K's and IQ4's once, at the product; as the
 * loader's dequantization does. So results equal the dense kernel's.
 * The factored formats, Q4KC (Q4_K's compact form), Q6KC (Q6_K's), Q3KC (Q3_K's), Q5KC and Q2KC (Q5_K's and
 * Q2_K's): a block's scales (and zeros) are factored per super-block of 256, each column's d' (and z', float32) in a
 * panel header ahead of the records, each block's multipliers in its record (uint8; Q6KC's and Q3KC's int8; Q2KC's
 * scale and zero multipliers, 4 bits each, in one byte): scale = multiplier * d', zero = multiplier * z', products
 * exact in float32 (the packer checks them, as Q4_K's d * sc and -dmin * m and Q6_K's d * sc are). Q6KC, Q5KC,
 * Q2KC and Q3KC hold their codes bit-packed (packed_codes): unsigned,
 * code + code_offset (Q6_K's q, Q5_K's, Q2_K's and Q3_K's q), its low 4 bits in a row of nibbles as Q4's (Q6KC,
 * Q5KC), the bits above (all of Q2KC's 2 and Q3KC's 3) in a row of plane_bits bits per column, column c at bit
 * c * plane_bits of the row's bytes (little-endian); all the block's nibble rows, then all its plane rows. A vector
 * of columns shifts a broadcast word of the plane by each lane's place (per 8 lanes for Q3KC, whose 16 lanes' 48
 * bits do not fit a 32-bit lane). So the weights are the float32 layouts' to the bit in 0.59 bytes a weight instead
 * of 0.75 (Q4_K), 0.83 instead of 1.25 (Q6_K), 0.72 instead of 1.25 (Q5_K), 0.34 instead of 1.5 (Q2_K) and 0.45
 * instead of 1.25 (Q3_K, its scales as Q6KC's). */
enum { Q4 = 0, Q8 = 1, Q4K = 2, Q6K = 3, Q5K = 4, IQ4NL = 5, IQ4XS = 6, Q2K = 7, Q4KC = 8, Q6KC = 9, Q5KC = 10,
       Q2KC = 11, Q3KC = 12 };
/* gemm_quant_f32's format flag: the caller is a bfloat16 model's layer, whose products need not be the float32 dense
 * kernel's bit for bit (its dense layers round x to bf16): up to SUM_TILE_ROWS rows of the formats
 * block_sum_format names then take block sums (tile_quant_sums), where this build has them. */
#define BF16_MODEL 0x100
/* Each format's cases, CASE(format) for every one of the enum's. */
#define FOR_EACH_FORMAT(CASE)                                                                                 \
    CASE(Q4) CASE(Q8) CASE(Q4K) CASE(Q6K) CASE(Q5K) CASE(IQ4NL) CASE(IQ4XS) CASE(Q2K) CASE(Q4KC) CASE(Q6KC)      \
    CASE(Q5KC) CASE(Q2KC) CASE(Q3KC)
/* IQ4NL and IQ4XS: Q4's rows of nibbles, but each an index into these 16 values (llama.cpp's kvalues_iq4nl), times
 * the block's scale (fp16, as IQ4_NL's d; float32, as IQ4_XS's d * (ls - 32)), no zero: the product rounds once. */
static const int8_t IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
#define QBLOCK 32 /* weights along K per GGUF block (but Q6K's: qblock) */

static inline int qblock(const int fmt) {
    return fmt == Q6K || fmt == Q2K || fmt == Q6KC || fmt == Q2KC || fmt == Q3KC ? 16 : QBLOCK;
}
static inline int int8_codes(const int fmt) { return fmt == Q8 || fmt == Q6K || fmt == Q5K || fmt == Q2K; }
static inline int packed_codes(const int fmt) { return fmt == Q6KC || fmt == Q5KC || fmt == Q2KC || fmt == Q3KC; }
/* bits per code in a packed format's plane rows (above the nibbles, or all of Q2KC's and Q3KC's), and what was added
 * to its codes to make them unsigned */
static inline int plane_bits(const int fmt) {
    return fmt == Q5KC ? 1 : fmt == Q6KC || fmt == Q2KC ? 2 : fmt == Q3KC ? 3 : 0;
}
static inline int code_offset(const int fmt) { return fmt == Q6KC ? 32 : fmt == Q3KC ? 4 : 0; }
/* whether a record's rows of codes are nibbles (the 4-bit formats', and the low bits of Q6KC's and Q5KC's) */
static inline int nibble_rows(const int fmt) { return !int8_codes(fmt) && fmt != Q2KC && fmt != Q3KC; }
static inline int has_zeros(const int fmt) {
    return fmt == Q4 || fmt == Q4K || fmt == Q5K || fmt == Q2K || fmt == Q4KC || fmt == Q5KC || fmt == Q2KC;
}
/* Whether a weight is code * scale + zero: the formats with zeros, and those whose codes carry an offset, whose zero
 * is -offset * scale (exact: a power of two times the scale), so one fused multiply-add rounds (code - offset) *
 * scale, exact, once, as the loader's product does. */
static inline int fused_weights(const int fmt) { return has_zeros(fmt) || code_offset(fmt) != 0; }
static inline int nonlinear(const int fmt) { return fmt == IQ4NL || fmt == IQ4XS; }
static inline int factored(const int fmt) { return fmt >= Q4KC; } /* the enum's last formats */
/* Q6_K's and Q3_K's scales: signed */
static inline int signed_multipliers(const int fmt) { return fmt == Q6KC || fmt == Q3KC; }
/* Q2KC's scale and zero multipliers (Q2_K's 4-bit sc and m) share a byte, the scale's in its low nibble and the
 * zero's in its high one, as Q2_K's own scales bytes hold them */
static inline int nibble_multipliers(const int fmt) { return fmt == Q2KC; }
/* where a factored record's zero multipliers start: after its scale multipliers, or in the same bytes */
static inline int zero_multipliers_at(const int fmt) { return nibble_multipliers(fmt) ? 0 : NR; }
/* bytes of a record's scales: fp16, float32, or (factored) uint8 multipliers; its zeros are float32, or factored
 * multipliers as its scales */
static inline int scale_bytes(const int fmt) {
    return NR * (factored(fmt) ? 1 : fmt == Q4 || fmt == Q8 || fmt == IQ4NL ? 2 : 4);
}
static inline int codes_at(const int fmt) {
    return scale_bytes(fmt) + (has_zeros(fmt) ? (factored(fmt) ? zero_multipliers_at(fmt) : NR * 4) : 0);
}
/* bytes of a record's row of codes: int8 codes, nibbles, and a packed format's plane bits */
static inline int row_bytes(const int fmt) {
    return int8_codes(fmt) ? NR : (nibble_rows(fmt) ? NR / 2 : 0) + NR / 8 * plane_bits(fmt);
}
static inline int record_bytes(const int fmt) { return codes_at(fmt) + qblock(fmt) * row_bytes(fmt); }
/* Row kk's plane bits in a packed format's record: after the block's nibble rows. */
static inline const uint8_t *plane_row(const uint8_t *record, int kk, const int fmt) {
    return record + codes_at(fmt) + (nibble_rows(fmt) ? qblock(fmt) * (NR / 2) : 0) + kk * (NR / 8) * plane_bits(fmt);
}
/* The plane bits of `lanes` consecutive columns from `at` (their first's byte), as a word to shift per lane, by one
 * load (bytes copied into a word and read back as one stall its load on the store): 3 bytes as the word ending at
 * their last, the byte before them shifted out (a plane row follows the record's multipliers: it is the record's). */
static inline uint32_t plane_word(const uint8_t *at, int lanes, const int fmt) {
    const int bytes = lanes * plane_bits(fmt) / 8;
    uint32_t word;
    if (bytes == 3) {
        memcpy(&word, at - 1, 4);
        return word >> 8;
    }
    if (bytes == 4) {
        memcpy(&word, at, 4);
        return word;
    }
    uint16_t half;
    if (bytes == 2) {
        memcpy(&half, at, 2);
        return half;
    }
    return at[0];
}
#define SUPER_K 256 /* weights along K per super-block of a factored format: a header entry each */
/* A header entry: the 64 columns' d' (float32), then, with zeros, their z'. */
static inline int factor_bytes(const int fmt) { return NR * 4 * (has_zeros(fmt) ? 2 : 1); }
static inline int64_t header_bytes(int K, const int fmt) {
    return factored(fmt) ? (int64_t)(K / SUPER_K) * factor_bytes(fmt) : 0;
}
/* Whether `format` is one of the enum's and K whole blocks of it (super-blocks, where factored). */
static inline int takes_format(int format, int K) {
    return format >= Q4 && format <= Q3KC && K % (factored(format) ? SUPER_K : qblock(format)) == 0;
}
static inline int64_t quant_panel_bytes(int K, const int fmt) {
    return header_bytes(K, fmt) + (int64_t)(K / qblock(fmt)) * record_bytes(fmt);
}
static inline const uint8_t *record_at(const uint8_t *panel, int K, int blk, const int fmt) {
    return panel + header_bytes(K, fmt) + (int64_t)blk * record_bytes(fmt);
}
/* A factored format's d' (then z') for the panel's 64 columns in block blk's super-block; NULL for the others. */
static inline const float *factors_at(const uint8_t *panel, int blk, const int fmt) {
    return factored(fmt) ? (const float *)(panel + (int64_t)(blk / (SUPER_K / qblock(fmt))) * factor_bytes(fmt))
                         : NULL;
}
#endif

#if defined(__AVX512F__)
#define ROUNDED (_MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC) /* an explicitly rounded product: never fused */
#define QUANT_TILE_ROWS MR /* rows a tile multiplies by the codes; items of more dequantize their panel once */
#define QUANT_TALL_ROWS 10 /* rows a tile of half a panel multiplies by the codes (20 accumulators) */

/* 16 multipliers (uint8; int8 where signed_multipliers; nibble_multipliers: the bytes' low nibbles, or with
 * `high` their high ones) times their factors (exact products, a factored format's scales or zeros). */
static inline __attribute__((always_inline)) __m512 factored16(const uint8_t *multipliers, const float *factors,
                                                               const int fmt, const int high) {
    const __m128i m = _mm_loadu_si128((const __m128i *)multipliers);
    __m512i v = signed_multipliers(fmt) ? _mm512_cvtepi8_epi32(m) : _mm512_cvtepu8_epi32(m);
    if (nibble_multipliers(fmt))
        v = high ? _mm512_srli_epi32(v, 4) : _mm512_and_si512(v, _mm512_set1_epi32(15));
    return _mm512_mul_ps(_mm512_cvtepi32_ps(v), _mm512_loadu_ps(factors));
}

/* The scales and zeros of a block's record; `factors` its super-block's (factors_at). */
static inline __attribute__((always_inline)) void block_scales(const uint8_t *record, const float *factors,
                                                               const int fmt, __m512 s[4], __m512 z[4],
                                                               const unsigned vectors) {
    for (int j = 0; j < 4; j++) {
        if (!(vectors >> j & 1u)) continue;
        if (factored(fmt)) {
            s[j] = factored16(record + 16 * j, factors + 16 * j, fmt, 0);
            z[j] = has_zeros(fmt)     ? factored16(record + zero_multipliers_at(fmt) + 16 * j, factors + NR + 16 * j,
                                                   fmt, 1)
                   : code_offset(fmt) ? _mm512_mul_ps(s[j], _mm512_set1_ps((float)-code_offset(fmt)))
                                      : _mm512_setzero_ps();
            continue;
        }
        s[j] = scale_bytes(fmt) == NR * 4 ? _mm512_loadu_ps((const float *)record + 16 * j)
                                          : _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(record + 32 * j)));
        z[j] = has_zeros(fmt) ? _mm512_loadu_ps((const float *)(record + scale_bytes(fmt)) + 16 * j)
                              : _mm512_setzero_ps();
    }
}

/* A weight from its code: code * scale + zero where the format has zeros (codes of up to 5 bits, whose products with
 * their scales are exact, so one fused multiply-add rounds once, at the zero, as the loader's mul-then-add does) or
 * an offset (fused_weights); else the product, rounded. */
static inline __attribute__((always_inline)) __m512 weight_of(__m512 code, __m512 s, __m512 z, const int fmt) {
    return fused_weights(fmt) ? _mm512_fmadd_ps(code, s, z) : _mm512_mul_round_ps(code, s, ROUNDED);
}

#if defined(__AVX512VBMI__)
/* Row kk of a packed format with nibbles (Q6KC, Q5KC) as its 64 codes' bytes in column order: one multishift takes
 * each column's plane bits from its quadword of the plane (broadcast: Q6KC's columns 0-31 in the first, 32-63 in the
 * second) to bits 4 and up, over the column's nibble. (Where there are no nibbles, Q2KC's, dequant_row's shifts of
 * 32-bit lanes did better.) */
static inline __attribute__((always_inline)) __m512i packed_row_bytes(const uint8_t *record, int kk, const int fmt) {
    static const uint8_t columns[64] = {
        0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21,
        22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42, 43,
        44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59, 60, 61, 62, 63};
    const int bits = plane_bits(fmt);
    const __m512i c = _mm512_loadu_si512(columns); /* column c's bits start at bit bits * c, mod 64, of its quadword */
    const __m512i at = _mm512_sub_epi8(bits == 2 ? _mm512_add_epi8(c, c) : c, _mm512_set1_epi8(4));
    const uint8_t *plane = plane_row(record, kk, fmt);
    uint64_t q0, q1 = 0;
    memcpy(&q0, plane, 8);
    if (bits == 2) memcpy(&q1, plane + 8, 8);
    const __m512i source = bits == 2 ? _mm512_mask_set1_epi64(_mm512_set1_epi64((long long)q0), 0xF0, (long long)q1)
                                     : _mm512_set1_epi64((long long)q0);
    const __m256i n = _mm256_loadu_si256((const __m256i *)(record + codes_at(fmt) + kk * (NR / 2)));
    const __m512i nibbles = _mm512_and_si512(
        _mm512_inserti64x4(_mm512_castsi256_si512(n), _mm256_srli_epi16(n, 4), 1), _mm512_set1_epi8(15));
    return _mm512_ternarylogic_epi32(_mm512_multishift_epi64_epi8(at, source),
                                     _mm512_set1_epi8((char)(((1 << bits) - 1) << 4)), nibbles, 0xEA);
}
#endif

#if defined(__AVX512VBMI__)
/* Q3KC's 16 codes of the 48 plane bits at `at` (as plane3_codes reads them), each at byte `byte` (a constant) of its
 * lane, the bits above it not cleared: the 48 bits above the 2 bytes before them, in a quadword broadcast; lane i's
 * byte multishifted from bit 16 + 3i of it. */
static inline __attribute__((always_inline)) __m512i plane3_lanes(const uint8_t *at, const int byte) {
    int64_t quad;
    memcpy(&quad, at - 2, 8);
    const __m512i from = _mm512_set_epi32(61, 58, 55, 52, 49, 46, 43, 40, 37, 34, 31, 28, 25, 22, 19, 16);
    return _mm512_multishift_epi64_epi8(_mm512_slli_epi32(from, 8 * byte), _mm512_set1_epi64(quad));
}
#endif

/* Q3KC's 16 codes (one a lane) of the 48 plane bits at `at`: a row's columns 16j .. from its plane row + 6j, read
 * with a byte or two before them (the row's or the record's multipliers: a plane row follows them), none past the
 * row's end. */
static inline __attribute__((always_inline)) __m512i plane3_codes(const uint8_t *at) {
#if defined(__AVX512VBMI__)
    return _mm512_and_si512(plane3_lanes(at, 0), _mm512_set1_epi32(7));
#else
    /* each 8 lanes' 24 bits in the word ending at their last byte, above the byte before them */
    int32_t low, high;
    memcpy(&low, at - 1, 4);
    memcpy(&high, at + 2, 4);
    const __m512i word = _mm512_mask_blend_epi32(0xFF00, _mm512_set1_epi32(low), _mm512_set1_epi32(high));
    const __m512i shifts = _mm512_set_epi32(29, 26, 23, 20, 17, 14, 11, 8, 29, 26, 23, 20, 17, 14, 11, 8);
    return _mm512_and_si512(_mm512_srlv_epi32(word, shifts), _mm512_set1_epi32(7));
#endif
}

/* Row kk of a block: w[j] holds columns 16j .. 16j + 15, for the vectors j in the bit set `vectors` (a constant). */
static inline __attribute__((always_inline)) void dequant_row(const uint8_t *record, int kk, const int fmt,
                                                              const __m512 s[4], const __m512 z[4], __m512 w[4],
                                                              const unsigned vectors) {
    if (int8_codes(fmt)) {
        const int8_t *codes = (const int8_t *)(record + codes_at(fmt)) + kk * NR;
        for (int j = 0; j < 4; j++) {
            if (!(vectors >> j & 1u)) continue;
            w[j] = weight_of(
                _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16 * j)))), s[j],
                z[j], fmt);
        }
        return;
    }
#if defined(__AVX512VBMI__)
    if (packed_codes(fmt) && nibble_rows(fmt)) {
        const __m512i code = packed_row_bytes(record, kk, fmt);
        for (int j = 0; j < 4; j++)
            if (vectors >> j & 1u)
                w[j] = weight_of(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm512_extracti32x4_epi32(code, j))), s[j],
                                 z[j], fmt);
        return;
    }
#endif
    __m512i nibbles[4];
    if (nibble_rows(fmt)) {
        const uint8_t *codes = record + codes_at(fmt) + kk * (NR / 2);
        const __m512i a = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)codes));
        const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(codes + 16)));
        const __m512i low = _mm512_set1_epi32(15);
        nibbles[0] = _mm512_and_si512(a, low), nibbles[1] = _mm512_and_si512(b, low);
        nibbles[2] = _mm512_srli_epi32(a, 4), nibbles[3] = _mm512_srli_epi32(b, 4);
    }
    if (packed_codes(fmt)) { /* the plane's bits of vector j's columns (each lane's shifted down to bit 0), above
                              * its nibbles; the offset is in z (block_scales) */
        const int bits = plane_bits(fmt);
        const uint8_t *plane = plane_row(record, kk, fmt);
        const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i shifts = _mm512_mullo_epi32(lanes, _mm512_set1_epi32(bits));
        const __m512i mask = _mm512_set1_epi32((1 << bits) - 1);
        for (int j = 0; j < 4; j++) {
            if (!(vectors >> j & 1u)) continue;
            if (bits == 3) {
                w[j] = weight_of(_mm512_cvtepi32_ps(plane3_codes(plane + 6 * j)), s[j], z[j], fmt);
                continue;
            }
            const __m512i high = _mm512_srlv_epi32(_mm512_set1_epi32((int)plane_word(plane + 2 * bits * j, 16, fmt)),
                                                   shifts);
            const __m512i code = nibble_rows(fmt) /* (high << 4) & (mask << 4) | nibbles */
                                     ? _mm512_ternarylogic_epi32(_mm512_slli_epi32(high, 4), _mm512_slli_epi32(mask, 4),
                                                                 nibbles[j], 0xEA)
                                     : _mm512_and_si512(high, mask);
            w[j] = weight_of(_mm512_cvtepi32_ps(code), s[j], z[j], fmt);
        }
        return;
    }
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)IQ4_VALUES)));
    for (int j = 0; j < 4; j++) {
        if (!(vectors >> j & 1u)) continue;
        w[j] = weight_of(nonlinear(fmt) ? _mm512_permutexvar_ps(nibbles[j], values) : _mm512_cvtepi32_ps(nibbles[j]),
                         s[j], z[j], fmt);
    }
}

/* rows x 64 tile over a quantized panel, dequantizing each row of weights once for all its rows; only the vectors in
 * the bit set `vectors` (a constant, as tile's); the first `live` rows stored (the rest: x's zero padding). */
static inline __attribute__((always_inline)) void tile_quant(const float *x, int64_t ldx, const uint8_t *panel,
                                                             const float *bias, float *y, int64_t ldy, int K,
                                                             const int rows, const __mmask16 masks[4],
                                                             const int fmt, const unsigned vectors, int live) {
    __m512 c[QUANT_TALL_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) c[r][j] = _mm512_setzero_ps();
    const int bytes = record_bytes(fmt);
    const int block = qblock(fmt);
    for (int blk = 0; blk < K / block; blk++) {
        const uint8_t *record = record_at(panel, K, blk, fmt);
        __m512 s[4], z[4];
        block_scales(record, factors_at(panel, blk, fmt), fmt, s, z, vectors);
        for (int kk = 0; kk < block; kk++) {
            for (int line = kk; line < bytes / 64; line += block) /* the record 3 ahead, a line or two a row */
                _mm_prefetch((const char *)(record + 3 * bytes + 64 * line), _MM_HINT_T0);
            __m512 w[4];
            dequant_row(record, kk, fmt, s, z, w, vectors);
            const int k = blk * block + kk;
            for (int r = 0; r < rows; r++) {
                const __m512 b = _mm512_set1_ps(x[r * ldx + k]);
                for (int j = 0; j < 4; j++)
                    if (vectors >> j & 1u) c[r][j] = _mm512_fmadd_ps(b, w[j], c[r][j]);
            }
        }
    }
    for (int r = 0; r < rows && r < live; r++) store_vectors(c[r], bias, y + r * ldy, masks, vectors);
}

static inline __attribute__((always_inline)) void quant_panel_rows(const float *x, int64_t ldx,
                                                                   const uint8_t *panel, const float *bias, float *y,
                                                                   int64_t ldy, int K, int row_begin, int row_end,
                                                                   int cols, const int fmt) {
    __mmask16 masks[4];
    column_masks(cols, masks);
    for (int r = row_begin; r < row_end; r += MR) {
        const float *xr = x + r * ldx;
        float *yr = y + r * ldy;
#define QUANT_TILE(rows) tile_quant(xr, ldx, panel, bias, yr, ldy, K, rows, masks, fmt, ALL_VECTORS, rows)
        WITH_TILE_ROWS(row_end - r, QUANT_TILE)
#undef QUANT_TILE
    }
}

/* One row against a quantized panel's vectors 0 and 2 (half 0: columns 0-15 and 32-47, whose Q4 codes are a record
 * row's first 16 bytes) or 1 and 3 (half 1), as a single row's threads split a panel (half_run); -1: all of them. */
static inline __attribute__((always_inline)) void row_quant(const float *x, const uint8_t *panel, const float *bias,
                                                            float *y, int K, int cols, const int half,
                                                            const int fmt) {
    __mmask16 masks[4];
    column_masks(cols, masks);
    tile_quant(x, 0, panel, bias, y, 0, K, 1, masks, fmt, half < 0 ? ALL_VECTORS : 0x5u << half, 1);
}

#if defined(__AVX512VBMI__)
#define BLOCK_SUMS
#define SUM_TILE_ROWS 4 /* rows tile_quant_sums takes: from 5 the dequantizing tiles do about as well */
/* The formats whose rows take block sums (tile_quant_sums): codes of up to 7 bits as nibbles (Q4, Q4K, Q4KC),
 * nibbles and plane bits (Q6KC, Q5KC) or plane bits alone (Q3KC, Q2KC), IQ4's nibble indices, and Q8_0's int8
 * codes. */
static inline int block_sum_format(const int fmt) {
    return fmt == Q4 || fmt == Q4K || fmt == Q4KC || packed_codes(fmt) || fmt == Q8 || nonlinear(fmt);
}
/* Whether tile_quant_sums takes a format's codes as the floats 1 + c / 128 (else as their values: Q8's, IQ4's). */
static inline int unit_codes(const int fmt) { return !int8_codes(fmt) && !nonlinear(fmt); }

/* Vector j's 16 codes of a plane-only row (Q3KC's 3 bits, Q2KC's 2 a column) at bits 16 and up of their lanes (the
 * bits above them not cleared): one multishift from a quadword holding the vector's plane bits, lane i's byte 2 taken
 * from its column's first bit (Q3KC: plane3_lanes; Q2KC's 32 bits fill both halves of the quadword). */
static inline __attribute__((always_inline)) __m512i plane_codes_at_16(const uint8_t *plane, int j, const int fmt) {
    if (plane_bits(fmt) == 3) return plane3_lanes(plane + 6 * j, 2);
    const uint32_t word = plane_word(plane + 4 * j, 16, fmt);
    const __m512i from = _mm512_set_epi32(30, 28, 26, 24, 22, 20, 18, 16, 14, 12, 10, 8, 6, 4, 2, 0);
    return _mm512_multishift_epi64_epi8(_mm512_slli_epi32(from, 16),
                                        _mm512_set1_epi64((int64_t)((uint64_t)word << 32 | word)));
}

/* The byte permutation putting byte `first` + i of a row in every byte of lane i. */
static inline __m512i lane_bytes_from(int first) {
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(first)), _mm512_set1_epi32(0x01010101));
}

/* `rows` rows (a constant, up to SUM_TILE_ROWS; more than one: half a panel) against a panel's vectors (row_quant's
 * halves) by block sums: a weight is c * s + zero (a code offset's zero is -offset * s), so a block of a row's product
 * is s * sum(x * c) + zero * sum(x), and codes of up to 7 bits need no float conversion: 0x3F800000 | c << 16 is the
 * float 1 + c / 128 (exact), one ternary-logic op from a lane holding c's byte at bits 16-23 (a byte permutation of a
 * row's bytes puts column 16 j + i's in lane i; Q4's high nibbles, a shift away, are vectors 2 and 3; the packed
 * formats' codes come as bytes from packed_row_bytes). So a block is 128 s * sum(x * (1 + c / 128)) +
 * (zero - 128 s) * sum(x): three vector ops per 16 weights where row_quant's exact dequantization takes about five.
 * Rounded in its own order (the codes' 7 bits below the 1 cost that many of the sums' 24), within ~1e-6 of the
 * product's scale: not the dense kernel's bits, which a float32 model keeps. Q8's int8 codes are converted as
 * row_quant converts them, and IQ4's indices looked up in its values' floats by a permutation (which reads an index's
 * low 4 bits), but summed per block before their scale: s * sum(x * c), a multiply a weight fewer. A code's float
 * serves every row. A single row sums even and odd k apart, so that a half panel still has four chains of FMAs. */
static inline __attribute__((always_inline)) void tile_quant_sums(const float *x, int64_t ldx, const float *sums,
                                                                  const uint8_t *panel, const float *bias, float *y,
                                                                  int64_t ldy, int K, int cols, const int half,
                                                                  const int rows, const int fmt) {
    const unsigned vectors = half < 0 ? ALL_VECTORS : 0x5u << half;
    const int parities = rows == 1 ? 2 : 1, blocks = K / qblock(fmt);
    const __m512i code_bits = _mm512_set1_epi32(0x007F0000), nibble_bits = _mm512_set1_epi32(0x000F0000);
    const __m512i one = _mm512_set1_epi32(0x3F800000);
    const __m512i picks[4] = {lane_bytes_from(0), lane_bytes_from(16), lane_bytes_from(32), lane_bytes_from(48)};
    const __m512 unit = _mm512_set1_ps(128.0f);
    const __m512 values = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)IQ4_VALUES)));
    __mmask16 masks[4];
    column_masks(cols, masks);
    __m512 out[SUM_TILE_ROWS][4];
    for (int r = 0; r < rows; r++)
        for (int j = 0; j < 4; j++) out[r][j] = _mm512_setzero_ps();
    const int bytes = record_bytes(fmt), block = qblock(fmt);
    for (int blk = 0; blk < blocks; blk++) {
        const uint8_t *record = record_at(panel, K, blk, fmt);
        const uint8_t *codes = record + codes_at(fmt);
        __m512 acc[SUM_TILE_ROWS][4][2];
        for (int r = 0; r < rows; r++)
            for (int j = 0; j < 4; j++) acc[r][j][0] = acc[r][j][1] = _mm512_setzero_ps();
        for (int kk = 0; kk < block; kk += 2)
            for (int odd = 0; odd < 2; odd++) { /* unrolled: odd indexes the accumulators by a constant */
                const int k = kk + odd, parity = odd % parities;
                for (int line = k; line < bytes / 64; line += block) /* the record 3 ahead */
                    _mm_prefetch((const char *)(record + 3 * bytes + 64 * line), _MM_HINT_T0);
                __m512 w[4];
                if (int8_codes(fmt)) { /* Q8's codes, converted: the sums of x * c are all it needs */
                    for (int j = 0; j < 4; j++)
                        if (vectors >> j & 1u)
                            w[j] = _mm512_cvtepi32_ps(
                                _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(codes + k * NR + 16 * j))));
                } else if (packed_codes(fmt) && !nibble_rows(fmt)) { /* Q3KC's and Q2KC's plane bits alone */
                    const uint8_t *plane = plane_row(record, k, fmt);
                    const __m512i plane_bits16 = _mm512_set1_epi32(((1 << plane_bits(fmt)) - 1) << 16);
                    for (int j = 0; j < 4; j++)
                        if (vectors >> j & 1u)
                            w[j] = (__m512)_mm512_ternarylogic_epi32(plane_codes_at_16(plane, j, fmt), plane_bits16,
                                                                     one, 0xEA);
                } else if (packed_codes(fmt)) { /* Q6KC's and Q5KC's codes as bytes in column order */
                    const __m512i row = packed_row_bytes(record, k, fmt);
                    for (int j = 0; j < 4; j++)
                        if (vectors >> j & 1u)
                            w[j] = (__m512)_mm512_ternarylogic_epi32(_mm512_permutexvar_epi8(picks[j], row),
                                                                     code_bits, one, 0xEA); /* a & b | c */
                } else { /* nibbles: columns 16 h + i and 32 + 16 h + i in byte 16 h + i of the row */
                    const __m512i row =
                        _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(codes + k * (NR / 2))));
                    for (int h = 0; h < 2; h++) {
                        if (!(vectors >> h & 1u)) continue;
                        const __m512i lanes = _mm512_permutexvar_epi8(picks[h], row);
                        const __m512i high = _mm512_srli_epi32(lanes, 4);
                        w[h] = nonlinear(fmt) ? _mm512_permutexvar_ps(lanes, values)
                                              : (__m512)_mm512_ternarylogic_epi32(lanes, nibble_bits, one, 0xEA);
                        w[h + 2] = nonlinear(fmt) ? _mm512_permutexvar_ps(high, values)
                                                  : (__m512)_mm512_ternarylogic_epi32(high, nibble_bits, one, 0xEA);
                    }
                }
                for (int r = 0; r < rows; r++) {
                    const __m512 xk = _mm512_set1_ps(x[r * ldx + blk * block + k]);
                    for (int j = 0; j < 4; j++)
                        if (vectors >> j & 1u) acc[r][j][parity] = _mm512_fmadd_ps(xk, w[j], acc[r][j][parity]);
                }
            }
        __m512 s[4], z[4];
        block_scales(record, factors_at(panel, blk, fmt), fmt, s, z, vectors);
        for (int j = 0; j < 4; j++) {
            if (!(vectors >> j & 1u)) continue;
            const __m512 scaled = unit_codes(fmt) ? _mm512_mul_ps(s[j], unit) : s[j];
            const __m512 offset = _mm512_sub_ps(z[j], scaled); /* zero - 128 s (used for unit codes only) */
            for (int r = 0; r < rows; r++) {
                const __m512 both = parities == 2 ? _mm512_add_ps(acc[r][j][0], acc[r][j][1]) : acc[r][j][0];
                out[r][j] = _mm512_fmadd_ps(both, scaled, out[r][j]);
                if (unit_codes(fmt))
                    out[r][j] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * blocks + blk]), offset, out[r][j]);
            }
        }
    }
    for (int r = 0; r < rows; r++) store_vectors(out[r], bias, y + r * ldy, masks, vectors);
}
#endif

/* `live` rows of x (7 to QUANT_TALL_ROWS), as a tile of 8 or 10 (x's zero rows past them, not stored), against half
 * a quantized panel (half_run's: vectors 0 and 2, or 1 and 3), so that each weight is dequantized once for all of
 * them. */
static inline __attribute__((always_inline)) void tall_quant(const float *x, const uint8_t *panel, const float *bias,
                                                             float *y, int64_t ldy, int K, int cols, int live,
                                                             const int half, const int fmt) {
    __mmask16 masks[4];
    column_masks(cols, masks);
    const unsigned vectors = 0x5u << half;
    if (live <= 8) tile_quant(x, K, panel, bias, y, ldy, K, 8, masks, fmt, vectors, live);
    else tile_quant(x, K, panel, bias, y, ldy, K, QUANT_TALL_ROWS, masks, fmt, vectors, live);
}

/* The quantized panel as a dense [K][64] one. */
static inline __attribute__((always_inline)) void dequant_panel(const uint8_t *panel, int K, float *dense,
                                                                const int fmt) {
    const int block = qblock(fmt);
    for (int blk = 0; blk < K / block; blk++) {
        const uint8_t *record = record_at(panel, K, blk, fmt);
        __m512 s[4], z[4];
        block_scales(record, factors_at(panel, blk, fmt), fmt, s, z, ALL_VECTORS);
        for (int kk = 0; kk < block; kk++) {
            __m512 w[4];
            dequant_row(record, kk, fmt, s, z, w, ALL_VECTORS);
            for (int j = 0; j < 4; j++) _mm512_store_ps(dense + ((int64_t)blk * block + kk) * NR + 16 * j, w[j]);
        }
    }
}

#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define QUANT_TILE_ROWS MR

/* The scales and (Q4, Q4K, Q5K) zeros of column vectors j and j + 4 of a block's record, for j < 4. */
typedef struct {
    __m256 s, s4, z, z4;
} PairParams;

/* 8 multipliers times their factors, as the AVX-512 body's factored16. */
static inline __attribute__((always_inline)) __m256 factored8(const uint8_t *multipliers, const float *factors,
                                                              const int fmt, const int high) {
    const __m128i m = _mm_loadl_epi64((const __m128i *)multipliers);
    __m256i v = signed_multipliers(fmt) ? _mm256_cvtepi8_epi32(m) : _mm256_cvtepu8_epi32(m);
    if (nibble_multipliers(fmt))
        v = high ? _mm256_srli_epi32(v, 4) : _mm256_and_si256(v, _mm256_set1_epi32(15));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(v), _mm256_loadu_ps(factors));
}

/* `factors`: the block's super-block's (factors_at). */
static inline __attribute__((always_inline)) PairParams pair_params(const uint8_t *record, const float *factors, int j,
                                                                    const int fmt) {
    if (factored(fmt)) {
        const int zeros = has_zeros(fmt);
        const uint8_t *zero_multipliers = record + zero_multipliers_at(fmt);
        PairParams p = {factored8(record + 8 * j, factors + 8 * j, fmt, 0),
                        factored8(record + 8 * (j + 4), factors + 8 * (j + 4), fmt, 0),
                        zeros ? factored8(zero_multipliers + 8 * j, factors + NR + 8 * j, fmt, 1) : _mm256_setzero_ps(),
                        zeros ? factored8(zero_multipliers + 8 * (j + 4), factors + NR + 8 * (j + 4), fmt, 1)
                              : _mm256_setzero_ps()};
        if (code_offset(fmt)) { /* the offset's zero (fused_weights) */
            const __m256 minus_offset = _mm256_set1_ps((float)-code_offset(fmt));
            p.z = _mm256_mul_ps(p.s, minus_offset), p.z4 = _mm256_mul_ps(p.s4, minus_offset);
        }
        return p;
    }
    const float *zeros = (const float *)(record + scale_bytes(fmt));
    const int wide = scale_bytes(fmt) == NR * 4;
    const PairParams p = {wide ? _mm256_loadu_ps((const float *)record + 8 * j)
                               : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(record + 16 * j))),
                          wide ? _mm256_loadu_ps((const float *)record + 8 * (j + 4))
                               : _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(record + 16 * (j + 4)))),
                          has_zeros(fmt) ? _mm256_loadu_ps(zeros + 8 * j) : _mm256_setzero_ps(),
                          has_zeros(fmt) ? _mm256_loadu_ps(zeros + 8 * (j + 4)) : _mm256_setzero_ps()};
    return p;
}

/* IQ4_VALUES[index] as floats for 8 byte indices in [0, 16) (a byte shuffle looks them up, then they widen). */
static inline __m256 iq4_values(__m128i indices) {
    const __m128i values = _mm_shuffle_epi8(_mm_loadu_si128((const __m128i *)IQ4_VALUES), indices);
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(values));
}

/* Columns 8j .. 8j + 7 (wj) and 32 + 8j .. 32 + 8j + 7 (wj4) of row kk of a block's record, for j < 4. A 4-bit
 * code times its scale is exact, so one fused multiply-add with the zero rounds once, as the loader's
 * dequantization does; a Q8 code times its scale is exact. */
static inline __attribute__((always_inline)) void dequant_pair(const uint8_t *record, int kk, int j, const int fmt,
                                                               const PairParams *p, __m256 *wj, __m256 *wj4) {
    if (int8_codes(fmt)) {
        const int8_t *codes = (const int8_t *)(record + codes_at(fmt)) + kk * NR + 8 * j;
        const __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)codes)));
        const __m256 c4 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(codes + 32))));
        *wj = has_zeros(fmt) ? _mm256_fmadd_ps(c, p->s, p->z) : _mm256_mul_ps(c, p->s);
        *wj4 = has_zeros(fmt) ? _mm256_fmadd_ps(c4, p->s4, p->z4) : _mm256_mul_ps(c4, p->s4);
        return;
    }
    if (packed_codes(fmt)) { /* the plane's bits of columns 8j .. and 32 + 8j .., above their nibbles; the offset is
                              * in z (pair_params) */
        const int bits = plane_bits(fmt);
        const uint8_t *plane = plane_row(record, kk, fmt);
        const __m256i shifts = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(bits));
        const __m256i mask = _mm256_set1_epi32((1 << bits) - 1);
        __m256i code = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32((int)plane_word(plane + bits * j, 8, fmt)), shifts), mask);
        __m256i code4 = _mm256_and_si256(
            _mm256_srlv_epi32(_mm256_set1_epi32((int)plane_word(plane + bits * (j + 4), 8, fmt)), shifts), mask);
        if (nibble_rows(fmt)) {
            const __m256i bytes = _mm256_cvtepu8_epi32(
                _mm_loadl_epi64((const __m128i *)(record + codes_at(fmt) + kk * (NR / 2) + 8 * j)));
            code = _mm256_or_si256(_mm256_slli_epi32(code, 4), _mm256_and_si256(bytes, _mm256_set1_epi32(15)));
            code4 = _mm256_or_si256(_mm256_slli_epi32(code4, 4), _mm256_srli_epi32(bytes, 4));
        }
        *wj = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code), p->s, p->z); /* fused_weights */
        *wj4 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(code4), p->s4, p->z4);
        return;
    }
    const __m128i raw = _mm_loadl_epi64((const __m128i *)(record + codes_at(fmt) + kk * (NR / 2) + 8 * j));
    __m256 low, high;
    if (nonlinear(fmt)) {
        const __m128i nibble = _mm_set1_epi8(15);
        low = iq4_values(_mm_and_si128(raw, nibble));
        high = iq4_values(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble));
    } else {
        const __m256i bytes = _mm256_cvtepu8_epi32(raw);
        low = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
        high = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
    }
    *wj = fused_weights(fmt) ? _mm256_fmadd_ps(low, p->s, p->z) : _mm256_mul_ps(low, p->s);
    *wj4 = fused_weights(fmt) ? _mm256_fmadd_ps(high, p->s4, p->z4) : _mm256_mul_ps(high, p->s4);
}

/* One row against a quantized panel (8 accumulators), dequantizing as it goes: single-row decode reads each weight
 * once, a record at a time, the record three ahead fetched meanwhile. Within a record the columns go in pairs of
 * vectors that share their Q4 code bytes, so only a pair's scales and zeros are held at once. `half` 0 or 1: only
 * that half of the columns (vectors 2 half, 2 half + 1 and their partners 4 on: 16 half .. 16 half + 15 and
 * 32 + 16 half ..), as quant_halves splits a panel between two threads; -1: all of them. */
static inline __attribute__((always_inline)) void row_quant(const float *x, const uint8_t *panel, const float *bias,
                                                            float *y, int K, int cols, const int half,
                                                            const int fmt) {
    __m256 c[NR / 8];
    for (int j = 0; j < NR / 8; j++) c[j] = _mm256_setzero_ps();
    const int bytes = record_bytes(fmt);
    const int block = qblock(fmt);
    const int j_begin = half == 1 ? 2 : 0, j_end = half == 0 ? 2 : 4;
    for (int blk = 0; blk < K / block; blk++) {
        const uint8_t *record = record_at(panel, K, blk, fmt);
        const float *factors = factors_at(panel, blk, fmt);
        const float *xb = x + blk * block;
        for (int line = 0; line < bytes; line += 64)
            _mm_prefetch((const char *)(record + 3 * bytes + line), _MM_HINT_T0);
        for (int j = j_begin; j < j_end; j += 2) {
            const PairParams params = pair_params(record, factors, j, fmt);
            const PairParams params1 = pair_params(record, factors, j + 1, fmt);
            __m256 cj = c[j], cj4 = c[j + 4], cj1 = c[j + 1], cj5 = c[j + 5];
            for (int kk = 0; kk < block; kk++) {
                __m256 w, w4, w1, w5;
                dequant_pair(record, kk, j, fmt, &params, &w, &w4);
                dequant_pair(record, kk, j + 1, fmt, &params1, &w1, &w5);
                const __m256 b = _mm256_broadcast_ss(xb + kk);
                cj = _mm256_fmadd_ps(b, w, cj);
                cj4 = _mm256_fmadd_ps(b, w4, cj4);
                cj1 = _mm256_fmadd_ps(b, w1, cj1);
                cj5 = _mm256_fmadd_ps(b, w5, cj5);
            }
            c[j] = cj, c[j + 4] = cj4, c[j + 1] = cj1, c[j + 5] = cj5;
        }
    }
    store_row(c, bias, y, cols, half < 0 ? ALL_VECTORS : 0x33u << (2 * half));
}

/* ROWS rows (a constant, up to MR) against one pair of a quantized panel's vectors, j and j + 4 (which share their
 * Q4 code bytes): 2 x ROWS accumulators, each weight dequantized once for all the rows. A panel goes in four such
 * passes, the first fetching the records ahead (the others find them in cache). */
static inline __attribute__((always_inline)) void rows_quant_pair(const float *x, int64_t ldx, const uint8_t *panel,
                                                                  const float *bias, float *y, int64_t ldy, int K,
                                                                  int cols, int j, const int ROWS, const int fmt) {
    __m256 c[MR][2];
    for (int r = 0; r < ROWS; r++) c[r][0] = c[r][1] = _mm256_setzero_ps();
    const int bytes = record_bytes(fmt);
    const int block = qblock(fmt);
    for (int blk = 0; blk < K / block; blk++) {
        const uint8_t *record = record_at(panel, K, blk, fmt);
        for (int line = 0; line < bytes && j == 0; line += 64)
            _mm_prefetch((const char *)(record + 3 * bytes + line), _MM_HINT_T0);
        const PairParams params = pair_params(record, factors_at(panel, blk, fmt), j, fmt);
        for (int kk = 0; kk < block; kk++) {
            __m256 w, w4;
            dequant_pair(record, kk, j, fmt, &params, &w, &w4);
            for (int r = 0; r < ROWS; r++) {
                const __m256 b = _mm256_broadcast_ss(x + r * ldx + blk * block + kk);
                c[r][0] = _mm256_fmadd_ps(b, w, c[r][0]);
                c[r][1] = _mm256_fmadd_ps(b, w4, c[r][1]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        __m256 row[NR / 8];
        row[j] = c[r][0], row[j + 4] = c[r][1];
        store_row(row, bias, y + r * ldy, cols, 0x11u << j);
    }
}

/* One row in one pass (row_quant); more, up to MR, by pairs of vectors (rows_quant_pair). */
static inline __attribute__((always_inline)) void quant_panel_rows(const float *x, int64_t ldx,
                                                                   const uint8_t *panel, const float *bias, float *y,
                                                                   int64_t ldy, int K, int row_begin, int row_end,
                                                                   int cols, const int fmt) {
    if (row_end - row_begin == 1) {
        row_quant(x + row_begin * ldx, panel, bias, y + row_begin * ldy, K, cols, -1, fmt);
        return;
    }
    for (int j = 0; j < 4; j++) {
        const float *xr = x + row_begin * ldx;
        float *yr = y + row_begin * ldy;
#define PAIR_ROWS(rows) rows_quant_pair(xr, ldx, panel, bias, yr, ldy, K, cols, j, rows, fmt)
        WITH_TILE_ROWS(row_end - row_begin, PAIR_ROWS)
#undef PAIR_ROWS
    }
}

/* The quantized panel as a dense [K][64] one. */
static inline __attribute__((always_inline)) void dequant_panel(const uint8_t *panel, int K, float *dense,
                                                                const int fmt) {
    const int block = qblock(fmt);
    for (int blk = 0; blk < K / block; blk++) {
        const uint8_t *record = record_at(panel, K, blk, fmt);
        for (int j = 0; j < 4; j++) {
            const PairParams params = pair_params(record, factors_at(panel, blk, fmt), j, fmt);
            for (int kk = 0; kk < block; kk++) {
                __m256 w, w4;
                dequant_pair(record, kk, j, fmt, &params, &w, &w4);
                float *row = dense + ((int64_t)blk * block + kk) * NR;
                _mm256_store_ps(row + 8 * j, w);
                _mm256_store_ps(row + 8 * (j + 4), w4);
            }
        }
    }
}
#endif

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__) && defined(__F16C__))
/* Whether M rows take block sums (tile_quant_sums): a bfloat16 model's (the BF16_MODEL flag), up to SUM_TILE_ROWS,
 * of a format block_sum_format names, where this build has them. */
static inline int block_sum_rows(int M, int format, int bf16_model) {
#if defined(BLOCK_SUMS)
    return bf16_model && M >= 1 && M <= SUM_TILE_ROWS && block_sum_format(format);
#else
    return 0;
#endif
}

#if defined(BLOCK_SUMS)
/* quant_half's item for M rows (1 to SUM_TILE_ROWS) by block sums. `half` and the rows are constants in each call,
 * so that the loops over vectors and rows unroll. */
static inline __attribute__((always_inline)) void block_sum_half(const float *x, int64_t ldx, const float *sums,
                                                                 const uint8_t *panel, const float *bias, float *y,
                                                                 int64_t ldy, int K, int cols, int half, int M,
                                                                 const int fmt) {
#define SUMS_TILE(part, rows) tile_quant_sums(x, ldx, sums, panel, bias, y, ldy, K, cols, part, rows, fmt)
#define SUMS_HALVES(rows)                                                                                      \
    if (half != 1) SUMS_TILE(0, rows);                                                                          \
    if (half != 0) SUMS_TILE(1, rows);
    switch (M) {
    case 1:
        if (half < 0) SUMS_TILE(-1, 1);
        else if (half == 0) SUMS_TILE(0, 1);
        else SUMS_TILE(1, 1);
        break;
    case 2: SUMS_HALVES(2) break;
    case 3: SUMS_HALVES(3) break;
    default: SUMS_HALVES(4) break;
    }
#undef SUMS_HALVES
#undef SUMS_TILE
}
#endif

/* An item of gemm.c's quant_halves: M rows of x against the panel's half `half` (0 or 1: as row_quant's halves) or
 * all of it (-1). By block sums where `sums` holds the rows' (block_sum_rows); more than one row otherwise, with the
 * tall tiles, as QUANT_TALL_ROWS rows of `padded` (x's rows, zeros past M); one row by row_quant. `half` a constant
 * in each call, so that the loops over vectors unroll. */
static inline __attribute__((always_inline)) void quant_half(const float *x, int64_t ldx, const float *padded,
                                                             const float *sums, const uint8_t *panel,
                                                             const float *bias, float *y, int64_t ldy, int K,
                                                             int cols, int half, int M, const int fmt) {
#if defined(BLOCK_SUMS)
    if (sums != NULL) {
        if (block_sum_format(fmt)) block_sum_half(x, ldx, sums, panel, bias, y, ldy, K, cols, half, M, fmt);
        return;
    }
#endif
#if defined(QUANT_TALL_ROWS)
    if (M > 1) {
        if (half != 1) tall_quant(padded, panel, bias, y, ldy, K, cols, M, 0, fmt);
        if (half != 0) tall_quant(padded, panel, bias, y, ldy, K, cols, M, 1, fmt);
        return;
    }
#endif
    if (half < 0) row_quant(x, panel, bias, y, K, cols, -1, fmt);
    else if (half == 0) row_quant(x, panel, bias, y, K, cols, 0, fmt);
    else row_quant(x, panel, bias, y, K, cols, 1, fmt);
}

/* Rows row_begin .. row_end of one panel's columns; fmt a constant after inlining, so that each format's loops
 * compile without its tests. Items of more than one tile run the dense tiles over their panel dequantized into
 * scratch (when there is one), which `held` says holds panel `p` already where the thread's previous item had it (a
 * thread's items are consecutive, each panel's row blocks in turn, so a panel is dequantized once per thread, and
 * a short last row block takes it from there too); others multiply the codes as they go. */
static inline __attribute__((always_inline)) void quant_item(const float *x, int64_t ldx, const uint8_t *panel,
                                                             const float *bias, float *y, int64_t ldy, int K,
                                                             int row_begin, int row_end, int cols, float *scratch,
                                                             int p, int *held, const int fmt) {
    if (scratch != NULL && (row_end - row_begin > QUANT_TILE_ROWS || *held == p)) {
        if (*held != p) dequant_panel(panel, K, scratch, fmt);
        *held = p;
        panel_rows(x, ldx, scratch, bias, y, ldy, K, row_begin, row_end, cols, NULL);
    } else {
        quant_panel_rows(x, ldx, panel, bias, y, ldy, K, row_begin, row_end, cols, fmt);
    }
}

/* What gemm.c calls per format (the generic kernels above for one format): declared here for every format,
 * QUANT_KERNELS(fmt) defines them, in one of the gemm_quant_*.c files. dequant_panel_<fmt> (dequant_bf16_panels')
 * only where that has a body (AVX512-BF16). */
#define QUANT_ITEM_PARAMS                                                                                      \
    const float *x, int64_t ldx, const uint8_t *panel, const float *bias, float *y, int64_t ldy, int K,         \
        int row_begin, int row_end, int cols, float *scratch, int p, int *held
#define QUANT_HALF_PARAMS                                                                                      \
    const float *x, int64_t ldx, const float *padded, const float *sums, const uint8_t *panel, const float *bias, \
        float *y, int64_t ldy, int K, int cols, int half, int M
#define DEQUANT_PANEL_PARAMS const uint8_t *panel, int K, float *dense
#define DECLARE_QUANT_KERNELS(fmt)                                                                             \
    INTERNAL void quant_item_##fmt(QUANT_ITEM_PARAMS);                                                         \
    INTERNAL void quant_half_##fmt(QUANT_HALF_PARAMS);                                                         \
    INTERNAL void dequant_panel_##fmt(DEQUANT_PANEL_PARAMS);
FOR_EACH_FORMAT(DECLARE_QUANT_KERNELS)
#undef DECLARE_QUANT_KERNELS

#if defined(__AVX512BF16__)
#define DEQUANT_PANEL_KERNEL(fmt)                                                                              \
    void dequant_panel_##fmt(DEQUANT_PANEL_PARAMS) { dequant_panel(panel, K, dense, fmt); }
#else
#define DEQUANT_PANEL_KERNEL(fmt)
#endif
#define QUANT_KERNELS(fmt)                                                                                     \
    void quant_item_##fmt(QUANT_ITEM_PARAMS) {                                                                  \
        quant_item(x, ldx, panel, bias, y, ldy, K, row_begin, row_end, cols, scratch, p, held, fmt);           \
    }                                                                                                           \
    void quant_half_##fmt(QUANT_HALF_PARAMS) {                                                                  \
        quant_half(x, ldx, padded, sums, panel, bias, y, ldy, K, cols, half, M, fmt);                           \
    }                                                                                                           \
    DEQUANT_PANEL_KERNEL(fmt)
#else
#define QUANT_KERNELS(fmt) /* no quantized kernels in this build */
#endif

#endif
