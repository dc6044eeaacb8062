/* The order in which the panel GEMMs (gemm_bf16.c, gemm_int8.c's AMX body) walk their work items, (panel, block of
 * rows) pairs, split into contiguous runs over the threads: in chunks of row blocks whose activations fit in L2
 * (CHUNK_BYTES), then panel by panel, then row block, so that a panel read from memory by its chunk's first row
 * block is in cache for the others, and a chunk's activations stay in L2 over all panels. Meanwhile the items of a
 * panel fetch the next panel into L2, each its share (fetch_ahead), so that memory streams while they multiply.
 */
#ifndef PAGEDLLM_PANEL_ITEMS_H
#define PAGEDLLM_PANEL_ITEMS_H
#include <stdint.h>

#define CHUNK_BYTES (512 * 1024) /* activations a chunk of items shares */

typedef struct {
    int panel, row_block;
    int block;  /* the row block's place in its chunk: the first (0) reads the panel from memory */
    int blocks; /* row blocks in the item's chunk (the last chunk may have fewer) */
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
    const PanelItem item = {in_chunk / blocks, chunk * chunk_blocks + in_chunk % blocks, in_chunk % blocks, blocks};
    return item;
}

/* An item's share of the next panel to fetch into L2: lines [begin, end) from base (NULL: nothing). */
typedef struct {
    const char *base;
    int64_t begin, end;
} Ahead;

/* The share of `next` (`bytes` of panel, NULL: no next panel) that item fetches: its block's part of it, so that
 * the fetch is spread over all the chunk's items of the panel, not issued by the first alone in its short time. */
static inline Ahead ahead_share(const PanelItem *item, const void *next, int64_t bytes) {
    const int64_t lines = (bytes + 63) / 64;
    const Ahead a = {(const char *)next, lines * item->block / item->blocks, lines * (item->block + 1) / item->blocks};
    return a;
}

/* At step s of an item's steps, its share's lines for that step, into L2. */
static inline void fetch_ahead(const Ahead *a, int s, int steps) {
    if (a->base == NULL) return;
    const int64_t span = a->end - a->begin;
    for (int64_t line = a->begin + span * s / steps; line < a->begin + span * (s + 1) / steps; line++)
        __builtin_prefetch(a->base + 64 * line, 0, 2); /* prefetcht1 */
}
#endif
