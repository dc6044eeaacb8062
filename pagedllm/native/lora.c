/* Multi-LoRA for one linear layer (Punica's SGMV, on CPU): y[r] += (x[r] A[s]) B[s] for every row r whose adapter
 * slot s = token_slots[r] is >= 0 and holds weights for this layer (holds[s]).
 *
 * A slot's A is [in][lda]: each slice's A transposed, side by side (lanes i*rank .. (i+1)*rank for slice i), the
 * row padded with zeros to a whole number of LANES. Its B is [rank][out]: output column c of slice i
 * (slice_offsets[i] <= c < slice_offsets[i+1]) takes slice i's lanes of x A. So B holds each slice's own block and
 * no zeros, and one pass over x A serves every slice.
 *
 * Rows are grouped by slot (a counting sort) and taken TILE at a time, so each weight row read serves a tile of
 * rows. Two phases split over torch's OpenMP threads: the shrink (x A, by tile and chunk of LANES lanes) into a
 * scratch buffer, then the expand (by tile and block of one slice's output columns); so one decode row still uses
 * every thread. The slots are read when the call runs: a CPU graph replays it for any mapping of rows to adapters.
 * The weights are float32, or bf16 for a bf16 model (widened as they are read; the sums are float32 either way).
 * Plain C written to vectorise.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 8
#define LANES 16
#define COLS 256
#define PARALLEL_MIN_MACS 65536 /* below this a parallel region costs more than it saves */

/* A weight as float32: stored as float32, or as bf16 (its top 16 bits, widened exactly). */
static inline __attribute__((always_inline)) float weight(const void *w, int64_t i, const int bf16) {
    if (bf16) {
        const uint32_t bits = (uint32_t)((const uint16_t *)w)[i] << 16;
        float f;
        memcpy(&f, &bits, sizeof f);
        return f;
    }
    return ((const float *)w)[i];
}

/* The shrink of one tile and lane chunk: acc[r] = x[rows[r]] . A[:, w0 : w0 + LANES]. Short tiles repeat their
 * first row, so every loop has a constant trip count and the accumulators stay in registers. */
static inline __attribute__((always_inline)) void shrink_tile(const float *x, int64_t ldx, const int64_t *rows,
                                                              int n, const void *a, int lda, int in_features, int w0,
                                                              float *t, int width, const int bf16) {
    const float *xr[TILE];
    for (int r = 0; r < TILE; r++) xr[r] = x + rows[r < n ? r : 0] * ldx;
    float acc[TILE][LANES] = {{0}};
    for (int k = 0; k < in_features; k++) {
        float ak[LANES];
#pragma omp simd
        for (int l = 0; l < LANES; l++) ak[l] = weight(a, (int64_t)k * lda + w0 + l, bf16);
        for (int r = 0; r < TILE; r++) {
            const float xv = xr[r][k];
#pragma omp simd
            for (int l = 0; l < LANES; l++) acc[r][l] += xv * ak[l];
        }
    }
    const int lanes = width - w0 < LANES ? width - w0 : LANES;
    for (int r = 0; r < n; r++) memcpy(t + (int64_t)r * width + w0, acc[r], (size_t)lanes * sizeof(float));
}

/* The expand of one tile into columns [c0, c1) of one slice: y[rows[r], c] += t[r, lane0 : lane0 + rank] . B[:, c].
 * Each row of B's block is widened once for the whole tile. */
static inline __attribute__((always_inline)) void expand_tile(float *y, int64_t ldy, const int64_t *rows, int n,
                                                              const float *t, int width, int lane0, const void *b,
                                                              int64_t out, int rank, int64_t c0, int64_t c1,
                                                              const int bf16) {
    float bk[COLS];
    const int64_t cols = c1 - c0;
    for (int k = 0; k < rank; k++) {
#pragma omp simd
        for (int64_t c = 0; c < cols; c++) bk[c] = weight(b, (int64_t)k * out + c0 + c, bf16);
        for (int r = 0; r < n; r++) {
            const float tv = t[(int64_t)r * width + lane0 + k];
            float *yr = y + rows[r] * ldy + c0;
#pragma omp simd
            for (int64_t c = 0; c < cols; c++) yr[c] += tv * bk[c];
        }
    }
}

/* Returns 0; -1 when a row's slot is max_loras or more, -2 when scratch memory cannot be had (nothing is written
 * then). */
static int lora_add(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t rows, const int64_t *token_slots,
                    const uint8_t *holds, int max_loras, const void *lora_a, int lda, const void *lora_b,
                    int in_features, int rank, int slices, const int64_t *slice_offsets, const int bf16) {
    const size_t wsize = bf16 ? sizeof(uint16_t) : sizeof(float);
    const int width = slices * rank;
    const int64_t out = slice_offsets[slices];
    int64_t count[max_loras + 1];
    memset(count, 0, sizeof(count));
    for (int64_t i = 0; i < rows; i++) {
        const int64_t s = token_slots[i];
        if (s >= max_loras) return -1;
        if (s >= 0 && holds[s]) count[s + 1]++;
    }
    for (int s = 0; s < max_loras; s++) count[s + 1] += count[s];
    const int64_t kept = count[max_loras];
    if (kept == 0) return 0;
    /* order: the kept rows by slot; tiles of up to TILE rows of one slot; blocks of up to COLS columns of one slice */
    int64_t *order = malloc((size_t)kept * sizeof(int64_t));
    int64_t *next = malloc((size_t)max_loras * sizeof(int64_t));
    const int64_t max_tiles = kept / TILE + max_loras;
    int64_t *tile_start = malloc((size_t)max_tiles * sizeof(int64_t));
    int64_t max_blocks = slices;
    for (int i = 0; i < slices; i++) max_blocks += (slice_offsets[i + 1] - slice_offsets[i]) / COLS;
    int64_t *block = malloc((size_t)max_blocks * 3 * sizeof(int64_t)); /* (slice, first column, end column) */
    float *t = malloc((size_t)kept * width * sizeof(float));
    if (order == NULL || next == NULL || tile_start == NULL || block == NULL || t == NULL) {
        free(order);
        free(next);
        free(tile_start);
        free(block);
        free(t);
        return -2;
    }
    memcpy(next, count, (size_t)max_loras * sizeof(int64_t));
    for (int64_t i = 0; i < rows; i++) {
        const int64_t s = token_slots[i];
        if (s >= 0 && holds[s]) order[next[s]++] = i;
    }
    int64_t tiles = 0;
    for (int s = 0; s < max_loras; s++)
        for (int64_t p = count[s]; p < count[s + 1]; p += TILE) tile_start[tiles++] = p;
    int64_t blocks = 0;
    for (int i = 0; i < slices; i++)
        for (int64_t c = slice_offsets[i]; c < slice_offsets[i + 1]; c += COLS) {
            block[3 * blocks] = i;
            block[3 * blocks + 1] = c;
            block[3 * blocks + 2] = c + COLS < slice_offsets[i + 1] ? c + COLS : slice_offsets[i + 1];
            blocks++;
        }
    const int chunks = (width + LANES - 1) / LANES;
    const int64_t macs = kept * (int64_t)width * (in_features + out / slices);
#pragma omp parallel if (macs >= PARALLEL_MIN_MACS)
    {
#pragma omp for schedule(static)
        for (int64_t item = 0; item < tiles * chunks; item++) {
            const int64_t p = tile_start[item / chunks];
            const int64_t s = token_slots[order[p]];
            const int n = (int)((count[s + 1] - p) < TILE ? count[s + 1] - p : TILE);
            const void *a = (const char *)lora_a + s * in_features * (int64_t)lda * wsize;
            const int w0 = (int)(item % chunks) * LANES;
            if (bf16)
                shrink_tile(x, ldx, order + p, n, a, lda, in_features, w0, t + p * width, width, 1);
            else
                shrink_tile(x, ldx, order + p, n, a, lda, in_features, w0, t + p * width, width, 0);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < tiles * blocks; item++) {
            const int64_t p = tile_start[item / blocks], *bl = block + 3 * (item % blocks);
            const int64_t s = token_slots[order[p]];
            const int n = (int)((count[s + 1] - p) < TILE ? count[s + 1] - p : TILE);
            const void *b = (const char *)lora_b + s * rank * out * wsize;
            if (bf16)
                expand_tile(y, ldy, order + p, n, t + p * width, width, (int)bl[0] * rank, b, out, rank, bl[1],
                            bl[2], 1);
            else
                expand_tile(y, ldy, order + p, n, t + p * width, width, (int)bl[0] * rank, b, out, rank, bl[1],
                            bl[2], 0);
        }
    }
    free(order);
    free(next);
    free(tile_start);
    free(block);
    free(t);
    return 0;
}

/* lora_a and lora_b as float32. */
int lora_add_f32(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t rows, const int64_t *token_slots,
                 const uint8_t *holds, int max_loras, const float *lora_a, int lda, const float *lora_b,
                 int in_features, int rank, int slices, const int64_t *slice_offsets) {
    return lora_add(x, ldx, y, ldy, rows, token_slots, holds, max_loras, lora_a, lda, lora_b, in_features, rank,
                    slices, slice_offsets, 0);
}

/* lora_a and lora_b as bf16 (a bf16 model's slots): half the bytes a step reads, float32 sums all the same. */
int lora_add_bf16(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t rows, const int64_t *token_slots,
                  const uint8_t *holds, int max_loras, const uint16_t *lora_a, int lda, const uint16_t *lora_b,
                  int in_features, int rank, int slices, const int64_t *slice_offsets) {
    return lora_add(x, ldx, y, ldy, rows, token_slots, holds, max_loras, lora_a, lda, lora_b, in_features, rank,
                    slices, slice_offsets, 1);
}
