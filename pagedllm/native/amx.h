/* What the kernels that multiply on AMX tiles share (gemm_bf16.c, gemm_int8.c, paged_prefill.c): the tile
 * configuration's layout (palette 1: up to 16 rows of up to 64 bytes per tile), the two GEMMs' configuration, and
 * the permission Linux wants a process to ask for before its first tile instruction (without it that instruction
 * faults), asked once per library and kept.
 */
#ifndef PAGEDLLM_AMX_H
#define PAGEDLLM_AMX_H
#if defined(__AMX_TILE__)
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

#define ARCH_REQ_XCOMP_PERM 0x1023
#define XFEATURE_XTILEDATA 18

struct tile_config {
    uint8_t palette;
    uint8_t start_row;
    uint8_t reserved[14];
    uint16_t bytes_per_row[16];
    uint8_t rows[16];
};

/* Whether the OS lets this process use the tiles (asked on the first call; the answer holds for every thread). */
static inline int amx_granted(void) {
    static int granted = -1;
    if (granted < 0) granted = syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
    return granted;
}

/* GCC's _tile_loadconfig tells the compiler it reads 8 bytes of the configuration, not 64, so stores to the rest
 * (the tiles' rows and widths) may be dropped as dead: with them gone the first tile instruction faults. The
 * configuration's address goes into an asm with a memory clobber first, so that every store to it is made. */
static inline void amx_load_config(const struct tile_config *cfg) {
    __asm__ volatile("" : : "r"(cfg) : "memory");
    _tile_loadconfig(cfg);
}

/* GCC's tile loads and stores are asm statements without a memory clobber: the compiler is not told that they
 * read or write memory, so it may drop or move plain stores that a tile load is to read (a buffer written just
 * before, and read by nothing else), or plain loads of what a tile store wrote. This barrier between them keeps
 * them in order. */
static inline void amx_memory_barrier(void) { __asm__ volatile("" ::: "memory"); }

/* The GEMMs' items (gemm_bf16.c, gemm_int8.c): up to 32 rows x two 16-column halves, every row 64 bytes. Tiles 0-3
 * accumulate (0: rows 0-15 x columns 0-15, 1: rows 0-15 x columns 16-31, 2 and 3 the same for rows 16-31), 4 and
 * 5 hold x's two row halves (upper_rows and lower_rows of them; a half of none is configured to one row, unused),
 * 6 and 7 the weights' two column halves. Loading a configuration zeroes every tile. */
static inline void amx_configure_gemm(int upper_rows, int lower_rows) {
    struct tile_config cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette = 1;
    const int rows[8] = {upper_rows, upper_rows, lower_rows, lower_rows, upper_rows, lower_rows, 16, 16};
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = (uint8_t)(rows[t] > 0 ? rows[t] : 1);
        cfg.bytes_per_row[t] = 64;
    }
    amx_load_config(&cfg);
}
#endif
#endif
