/* What the kernels that multiply on AMX tiles share (gemm_bf16.c, paged_prefill.c): the tile configuration's layout
 * (palette 1: up to 16 rows of up to 64 bytes per tile) and the permission Linux wants a process to ask for before
 * its first tile instruction (without it that instruction faults), asked once per library and kept.
 */
#ifndef PAGEDLLM_AMX_H
#define PAGEDLLM_AMX_H
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <immintrin.h>
#include <stdint.h>
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
#endif
#endif
