"""KVCacheManager: the scheduler's interface to KV memory — prefix-cache lookup, slot allocation, freeing."""
from __future__ import annotations

from typing import Optional

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_utils import KVCacheBlock
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps each request to the list of blocks holding its KV, in token order.

    With a ``sliding_window`` (every attention layer's, CacheConfig.sliding_window) a request keeps only the blocks
    its next query can see, as vLLM's SlidingWindowManager: before each allocation the blocks wholly before
    ``num_computed_tokens - sliding_window + 1`` go back to the pool (still cached, so other requests can hit
    them) and the pool's null block takes their place in the list, so block i still holds positions
    i * block_size ..; a request's memory stays about a window however long it runs. A prefix hit then needs
    only the blocks of the window before its end (see _sliding_window_hit).
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True, sliding_window: int | None = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many of each request's leading blocks are already registered in the prefix cache.
        self.num_cached_block: dict[str, int] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def max_blocks(self, num_tokens: int, max_step_tokens: int) -> int:
        """The most blocks a request of up to num_tokens tokens holds at once, when a step gives it at most
        max_step_tokens new slots: a block per block_size tokens, or under a sliding window at most those of the
        window before a step's first query and of the step's slots (vLLM's SlidingWindowSpec bound)."""
        blocks = cdiv(num_tokens, self.block_size)
        if self.sliding_window is None:
            return blocks
        return min(blocks, cdiv(self.sliding_window - 1 + max_step_tokens, self.block_size) + 1)

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest run of cached full blocks that prefixes the request, and how many tokens it covers.

        Never the whole sequence: the last token is always recomputed so the step yields its logits.
        Requests asking for prompt logprobs get no hits (those need every prompt position's logits).
        """
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if self.sliding_window is not None:
            hits = self._sliding_window_hit(request.block_hashes[:max_hit_blocks])
        else:
            hits = []
            for block_hash in request.block_hashes[:max_hit_blocks]:
                block = self.block_pool.get_cached_block(block_hash)
                if block is None:
                    break
                hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        return hits, num_hit_tokens

    def _sliding_window_hit(self, block_hashes: list) -> list[KVCacheBlock]:
        """The longest prefix whose last cdiv(sliding_window - 1, block_size) blocks are cached (fewer where the
        prefix is shorter): the next query, at the prefix's end, sees no further back. Blocks before those are the
        null block. Block hashes chain over the whole prefix, so a cached block's hash vouches for every token
        before it, cached or not. vLLM's SlidingWindowManager.find_longest_cache_hit: the search runs from the
        longest prefix down."""
        needed = cdiv(self.sliding_window - 1, self.block_size)
        null = self.block_pool.null_block
        if needed == 0:  # a window of 1: each query sees only itself
            return [null] * len(block_hashes)
        run: list[KVCacheBlock] = []  # the cached blocks from index i on, last first
        for i in range(len(block_hashes) - 1, -1, -1):
            block = self.block_pool.get_cached_block(block_hashes[i])
            if block is None:
                run.clear()
                continue
            run.append(block)
            if len(run) == needed:
                return [null] * i + run[::-1]
        return run[::-1]  # fewer than needed from the first block on: the next query sees all of them

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[list[KVCacheBlock]] = None,
                       num_new_computed_tokens: int = 0,
                       num_lookahead_tokens: int = 0) -> Optional[list[KVCacheBlock]]:
        """Makes room for num_new_tokens more tokens of KV (after any prefix-hit blocks).

        Returns the newly allocated blocks, or None when the pool cannot supply them — in which case nothing
        was allocated and no ref count changed (but for blocks out of the sliding window, freed first either way:
        no later query reads them). Full blocks are registered in the prefix cache as they fill.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        req_blocks = self.req_to_blocks.get(request.request_id)
        if req_blocks is None:
            req_blocks = self.req_to_blocks[request.request_id] = []
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        self._remove_skipped_blocks(req_blocks, request.num_computed_tokens)
        num_tokens_after = num_computed_tokens + num_new_tokens + num_lookahead_tokens
        if num_tokens_after > self.max_model_len:
            num_tokens_after = self.max_model_len
        if not new_computed_blocks and num_tokens_after <= len(req_blocks) * self.block_size:
            # The common decode step: the last block still has room.
            self._cache_new_full_blocks(request, req_blocks, num_computed_tokens + num_new_tokens)
            return []
        new_computed_blocks = new_computed_blocks or []
        num_new_blocks = cdiv(num_tokens_after, self.block_size) - len(req_blocks) - len(new_computed_blocks)
        # Hit blocks sitting in the free queue will be taken out of it, so they cannot also be handed out.
        null = self.block_pool.null_block
        num_evictable_hits = sum(1 for b in new_computed_blocks if b.ref_cnt == 0 and b is not null)
        if num_new_blocks > self.block_pool.get_num_free_blocks() - num_evictable_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None

        if new_computed_blocks:
            self.block_pool.touch(new_computed_blocks)
            req_blocks.extend(new_computed_blocks)
        new_blocks = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
        req_blocks.extend(new_blocks)
        self._cache_new_full_blocks(request, req_blocks, num_computed_tokens + num_new_tokens)
        return new_blocks

    def _remove_skipped_blocks(self, req_blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        """Under a sliding window, the blocks wholly before the window of the next query (at num_computed_tokens)
        go back to the pool, the null block in their place. Walks back from the window's first block to the
        first null (those before it went earlier), and frees them in that order, as vLLM does: the later blocks
        are evicted first."""
        if self.sliding_window is None:
            return
        null = self.block_pool.null_block
        skipped = []
        for i in range(min((num_computed_tokens - self.sliding_window + 1) // self.block_size, len(req_blocks)) - 1,
                       -1, -1):
            if req_blocks[i] is null:
                break
            skipped.append(req_blocks[i])
            req_blocks[i] = null
        self.block_pool.free_blocks(skipped)

    def _cache_new_full_blocks(self, request: Request, req_blocks: list[KVCacheBlock], num_tokens: int) -> None:
        """Registers the blocks that the first num_tokens tokens fill (and whose hashes are known)."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_full > num_cached:
            self.block_pool.cache_full_blocks(req_blocks, request.block_hashes, num_cached, num_full)
            self.num_cached_block[request.request_id] = num_full

    def free(self, request: Request) -> None:
        """Releases the request's blocks tail first, so its unique tail is evicted before a shared prefix."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)

    def free_blocks_beyond(self, request: Request, num_tokens: int) -> None:
        """Gives back the request's blocks past those its first ``num_tokens`` tokens fill (speculative decoding:
        slots only rejected drafts had reached). Never a cached block: cached blocks hold known tokens only."""
        blocks = self.req_to_blocks.get(request.request_id)
        keep = cdiv(num_tokens, self.block_size)
        if blocks is None or len(blocks) <= keep:
            return
        excess = blocks[keep:]
        del blocks[keep:]
        self.block_pool.free_blocks(reversed(excess))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
