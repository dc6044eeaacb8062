/* The order in which the panel GEMMs (gemm_bf16.c, gemm_int8.c's AMX body) walk their work items, (panel, block of
 * rows) pairs, split into contiguous runs over the threads: in chunks of row blocks whose activations fit in L2
 * (CHUNK_BYTES), then panel by panel, then row block, so that a panel read from memory by its chunk's first row
 * block is in cache for the others, and a chunk's activations stay in L2 over all panels.
 */
#ifndef PAGEDLLM_PANEL_ITEMS_H
#define PAGEDLLM_PANEL_ITEMS_H
#include <stdint.h>

#define CHUNK_BYTES (512 * 1024) /* activations a chunk of items shares */

typedef struct {
    int panel, row_block;
    int first_block; /* the panel's first row block in its chunk, which reads the panel from memory */
    int blocks;      /* row blocks in the item's chunk (the last chunk may have fewer) */
} PanelItem;

/* Row blocks per chunk for blocks of block_bytes of activations: those that fit in CHUNK_BYTES, at least one, at
 * most all row_blocks. */
static inline int chunk_row_blocks(int64_t block_bytes, int row_blocks) {
    int64_t blocks = CHUNK_BYTES / block_bytes;
    if (blocks < 1) blocks = 1;
    return blocks > row_blocks ? row_blocks : (int)blocks;
}

/* Item `it` of panels x row_blocks: chunk-major, then panel, then row block within the chunk. */
static inline PanelItem panel_item(int it, int panels, int row_blocks, int chunk_blocks) {
    const int chunk = it / (panels * chunk_blocks), in_chunk = it - chunk * panels * chunk_blocks;
    const int left = row_blocks - chunk * chunk_blocks, blocks = left < chunk_blocks ? left : chunk_blocks;
    const PanelItem item = {in_chunk / blocks, chunk * chunk_blocks + in_chunk % blocks, in_chunk % blocks == 0,
                            blocks};
    return item;
}
#endif
