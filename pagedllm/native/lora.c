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
 * Plain C written to vectorise.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TILE 8
#define LANES 16
#define COLS 256
#define PARALLEL_MIN_MACS 65536 /* below this a parallel region costs more than it saves */

/* The shrink of one tile and lane chunk: acc[r] = x[rows[r]] . A[:, w0 : w0 + LANES]. Short tiles repeat their
 * first row, so every loop has a constant trip count and the accumulators stay in registers. */
static void shrink_tile(const float *x, int64_t ldx, const int64_t *rows, int n, const float *a, int lda, int in_features,
                        int w0, float *t, int width) {
    const float *xr[TILE];
    for (int r = 0; r < TILE; r++) xr[r] = x + rows[r < n ? r : 0] * ldx;
    float acc[TILE][LANES] = {{0}};
    for (int k = 0; k < in_features; k++) {
        const float *ak = a + (int64_t)k * lda + w0;
        for (int r = 0; r < TILE; r++) {
            const float xv = xr[r][k];
#pragma omp simd
            for (int l = 0; l < LANES; l++) acc[r][l] += xv * ak[l];
        }
    }
    const int lanes = width - w0 < LANES ? width - w0 : LANES;
    for (int r = 0; r < n; r++) memcpy(t + (int64_t)r * width + w0, acc[r], (size_t)lanes * sizeof(float));
}

/* The expand of one tile into columns [c0, c1) of one slice: y[rows[r], c] += t[r, lane0 : lane0 + rank] . B[:, c]. */
static void expand_tile(float *y, int64_t ldy, const int64_t *rows, int n, const float *t, int width, int lane0,
                        const float *b, int64_t out, int rank, int64_t c0, int64_t c1) {
    for (int k = 0; k < rank; k++) {
        const float *bk = b + (int64_t)k * out;
        for (int r = 0; r < n; r++) {
            const float tv = t[(int64_t)r * width + lane0 + k];
            float *yr = y + rows[r] * ldy;
#pragma omp simd
            for (int64_t c = c0; c < c1; c++) yr[c] += tv * bk[c];
        }
    }
}

/* Returns 0, or -1 when a row's slot is max_loras or more (nothing is written then). */
int lora_add_f32(const float *x, int64_t ldx, float *y, int64_t ldy, int64_t rows, const int64_t *token_slots,
                 const uint8_t *holds, int max_loras, const float *lora_a, int lda, const float *lora_b, int in_features,
                 int rank, int slices, const int64_t *slice_offsets) {
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
            shrink_tile(x, ldx, order + p, n, lora_a + s * in_features * (int64_t)lda, lda, in_features,
                        (int)(item % chunks) * LANES, t + p * width, width);
        }
#pragma omp for schedule(static)
        for (int64_t item = 0; item < tiles * blocks; item++) {
            const int64_t p = tile_start[item / blocks], *bl = block + 3 * (item % blocks);
            const int64_t s = token_slots[order[p]];
            const int n = (int)((count[s + 1] - p) < TILE ? count[s + 1] - p : TILE);
            expand_tile(y, ldy, order + p, n, t + p * width, width, (int)bl[0] * rank,
                        lora_b + s * rank * out, out, rank, bl[1], bl[2]);
        }
    }
    free(order);
    free(next);
    free(tile_start);
    free(block);
    free(t);
    return 0;
}
