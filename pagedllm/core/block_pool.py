"""BlockPool: owns every KV block, their ref counts, the LRU free queue and the prefix-cache map."""
from __future__ import annotations

from typing import Iterable, Optional

from pagedllm.core.kv_cache_utils import BlockHash, FreeKVCacheBlockQueue, KVCacheBlock


class BlockPool:
    """A fixed set of KV blocks.

    A free block may still hold a cached full block (its hash in `cached_block_hash_to_block`): it stays
    reusable by a prefix hit until get_new_blocks evicts it, least recently freed first. Several blocks may hold the
    same tokens (requests that computed one prefix at once): each is cached, under its hash and id (vLLM's
    BlockHashToBlockMap), so that a hit still finds one once another is evicted.

    `null_block` stands in a request's block list where a block fell out of its group's sliding window and went
    back to the pool (vLLM's null block). It is no block of the pool: never counted, cached, handed out or freed,
    and touch, cache_full_blocks and free_blocks pass over it. Its id (0) is also a real block's, which is safe
    only because attention never reads a position outside its window, so no kernel reads through that entry.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached_block_hash_to_block: dict[BlockHash, dict[int, KVCacheBlock]] = {}
        self.null_block = KVCacheBlock(0)

    def get_cached_block(self, block_hash: BlockHash) -> Optional[KVCacheBlock]:
        blocks = self.cached_block_hash_to_block.get(block_hash)
        return next(iter(blocks.values())) if blocks else None

    def cache_full_blocks(self, blocks: list[KVCacheBlock], block_hashes: list[BlockHash],
                          num_cached_blocks: int, num_full_blocks: int) -> None:
        """Registers blocks[num_cached_blocks:num_full_blocks] under their hashes, beside any other block already
        cached under the same hash (never deduplicated: a request's block table only grows)."""
        if not self.enable_caching:
            return
        for i in range(num_cached_blocks, num_full_blocks):
            block, block_hash = blocks[i], block_hashes[i]
            if block.block_hash is not None or block is self.null_block:
                continue  # a prefix-hit block, already cached, or one out of the window
            block.block_hash = block_hash
            self.cached_block_hash_to_block.setdefault(block_hash, {})[block.block_id] = block

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Takes blocks from the front of the free queue (evicting their cached content), ref_cnt 1 each."""
        if num_blocks > self.free_block_queue.num_free_blocks:
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool "
                             f"({self.free_block_queue.num_free_blocks} free)")
        blocks = self.free_block_queue.popleft_n(num_blocks)
        for block in blocks:
            self._maybe_evict_cached_block(block)
            block.ref_cnt += 1
        return blocks

    def _maybe_evict_cached_block(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        blocks = self.cached_block_hash_to_block[block.block_hash]
        del blocks[block.block_id]
        if not blocks:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None

    def uncache_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drops the blocks' hashes from the prefix cache (the null block has none), wherever they are held."""
        for block in blocks:
            self._maybe_evict_cached_block(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """A prefix hit: take each block out of the free queue if it was free, and count the new owner."""
        for block in blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drops one reference from each; blocks reaching 0 join the queue's tail in the given order."""
        for block in ordered_blocks:
            if block is self.null_block:
                continue
            if block.ref_cnt <= 0:
                raise RuntimeError(f"{block} freed more times than it was allocated")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forgets every cached hash. Refused (returns False) while any block is in use.

        With nothing cached the free order carries no information, so the queue goes back to block-id order:
        the blocks handed out next are the ones used first before, whose memory the OS has already mapped,
        rather than the never-used tail of the cache. On CPU the first write to a page costs a fault (the OS
        zeroes a 2 MiB huge page as it is first touched): in LRU order a run after a same-sized warm-up would
        write its K/V into the never-touched part of the cache and pay those faults in its decode steps."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.free_block_queue = FreeKVCacheBlockQueue(self.blocks)
        return True

    def get_num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks
