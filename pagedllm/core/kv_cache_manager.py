"""KVCacheManager: the scheduler's interface to KV memory — prefix-cache lookup, slot allocation, freeing."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from pagedllm.core.block_pool import BlockPool
from pagedllm.core.kv_cache_utils import KVCacheBlock
from pagedllm.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def max_blocks(windows: Sequence[int | None], block_size: int, num_tokens: int, max_step_tokens: int) -> int:
    """The most blocks a request of up to num_tokens tokens holds at once in KV cache groups of these sliding
    windows, when a step gives it at most max_step_tokens new slots: in each group a block per block_size tokens, or
    under a sliding window at most those of the window before a step's first query and of the step's slots (vLLM's
    SlidingWindowSpec bound)."""
    blocks = cdiv(num_tokens, block_size)
    return sum(blocks if window is None else min(blocks, cdiv(window - 1 + max_step_tokens, block_size) + 1)
               for window in windows)


def longest_request(windows: Sequence[int | None], block_size: int, num_blocks: int, max_step_tokens: int,
                    limit: int) -> int:
    """The most tokens, up to ``limit``, a request may reach whose blocks (max_blocks) fit in ``num_blocks``: the
    context length vLLM's max_model_len -1 fits to the KV cache. 0 where not even one token's do."""
    low, high = 0, limit  # max_blocks grows with the tokens: the last that fits, by bisection
    while low < high:
        middle = (low + high + 1) // 2
        if max_blocks(windows, block_size, middle, max_step_tokens) <= num_blocks:
            low = middle
        else:
            high = middle - 1
    return low


class GroupBlocks:
    """One KV cache group's handling of a request's blocks (vLLM's SingleTypeKVCacheManager), from the shared pool.

    With a ``sliding_window`` (its layers', CacheConfig) a request keeps only the blocks its next query can see, as
    vLLM's SlidingWindowManager: before each allocation the blocks wholly before ``num_computed_tokens -
    sliding_window + 1`` go back to the pool (still cached, so other requests can hit them) and the pool's null
    block takes their place in the list, so block i still holds positions i * block_size ..; a request's memory
    stays about a window however long it runs. A prefix hit then needs only the blocks of the window before its end
    (see sliding_window_hit).

    Its blocks are cached under their hashes keyed by the group (group 0's under the hashes themselves, group g's
    followed by g: vLLM's BlockHashWithGroupId), as the same tokens have other blocks in each group.
    """

    def __init__(self, block_pool: BlockPool, block_size: int, sliding_window: int | None, group: int) -> None:
        self.block_pool = block_pool
        self.block_size = block_size
        self.sliding_window = sliding_window
        self.suffix = group.to_bytes(2, "little") if group else b""

    def cached_block(self, block_hash: bytes) -> Optional[KVCacheBlock]:
        return self.block_pool.get_cached_block(block_hash + self.suffix)

    def longest_hit(self, block_hashes: list) -> list[KVCacheBlock]:
        """The longest prefix of ``block_hashes`` whose blocks this group can take from the prefix cache."""
        if self.sliding_window is not None:
            return self.sliding_window_hit(block_hashes)
        hits = []
        for block_hash in block_hashes:
            block = self.cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def sliding_window_hit(self, block_hashes: list) -> list[KVCacheBlock]:
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
            block = self.cached_block(block_hashes[i])
            if block is None:
                run.clear()
                continue
            run.append(block)
            if len(run) == needed:
                return [null] * i + run[::-1]
        return run[::-1]  # fewer than needed from the first block on: the next query sees all of them

    def remove_skipped_blocks(self, req_blocks: list[KVCacheBlock], num_computed_tokens: int) -> None:
        """Under a sliding window, the blocks wholly before the window of the next query (at num_computed_tokens)
        go back to the pool, the null block in their place. Walks back from the window's first block to the
        first null (those before it went earlier), and frees them in that order, as vLLM does: the later blocks
        are evicted first."""
        null = self.block_pool.null_block
        skipped = []
        for i in range(min((num_computed_tokens - self.sliding_window + 1) // self.block_size, len(req_blocks)) - 1,
                       -1, -1):
            if req_blocks[i] is null:
                break
            skipped.append(req_blocks[i])
            req_blocks[i] = null
        self.block_pool.free_blocks(skipped)

    def cache_full_blocks(self, block_hashes: list, req_blocks: list[KVCacheBlock], num_cached: int,
                          num_full: int) -> None:
        """Registers req_blocks[num_cached:num_full] under their hashes, keyed by the group."""
        if self.suffix:
            block_hashes = [None] * num_cached + [h + self.suffix for h in block_hashes[num_cached:num_full]]
        self.block_pool.cache_full_blocks(req_blocks, block_hashes, num_cached, num_full)


class KVCacheManager:
    """Maps each request to its blocks in token order, a list per KV cache group (core/kv_cache_groups.py; a model
    whose layers all attend alike has one), all from one pool. A request's lists all have the same length: a block
    per block_size positions (a windowed group's null block where its blocks went back).

    ``group_windows``: each group's sliding window (None: full attention), CacheConfig.group_windows; by default one
    group of full attention. Blocks, hits and block ids go as tuples with an entry per group.

    ``max_step_tokens``: the KV slots a step gives a request at most (EngineConfig.max_step_slots; by default
    max_model_len): under a sliding window they bound the blocks a request holds at once (max_blocks).
    """

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int,
                 enable_caching: bool = True, group_windows: Sequence[int | None] = (None,),
                 max_step_tokens: Optional[int] = None) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.max_step_tokens = max_model_len if max_step_tokens is None else max_step_tokens
        self.enable_caching = enable_caching
        self.block_pool = BlockPool(num_blocks, enable_caching)
        windows = tuple(group_windows)
        self.groups = [GroupBlocks(self.block_pool, block_size, window, g) for g, window in enumerate(windows)]
        self._windowed = [(g, group) for g, group in enumerate(self.groups) if group.sliding_window is not None]
        self.req_to_blocks: dict[str, tuple[list[KVCacheBlock], ...]] = {}
        # How many of each request's leading blocks are already registered in the prefix cache (in every group).
        self.num_cached_block: dict[str, int] = {}
        self.no_new_blocks: tuple[tuple[()], ...] = ((),) * len(windows)  # what a step that needs none gets
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.prefix_cache_requests = 0
        self.prefix_cache_resets = 0

    @property
    def num_blocks(self) -> int:
        return self.block_pool.num_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    def max_blocks(self, num_tokens: int) -> int:
        """The most blocks a request of up to num_tokens tokens holds at once (the module's max_blocks)."""
        return max_blocks([group.sliding_window for group in self.groups], self.block_size, num_tokens,
                          self.max_step_tokens)

    def get_computed_blocks(self, request: Request) -> tuple[tuple[list[KVCacheBlock], ...], int]:
        """Each group's run of cached blocks for the longest prefix of full blocks that every group can take from
        the prefix cache, and how many tokens it covers.

        Never the whole sequence: the last token is always recomputed so the step yields its logits.
        Requests asking for prompt logprobs get no hits (those need every prompt position's logits).
        A group's hit for a shorter prefix may be shorter still (a window's last blocks evicted), so the prefix
        shrinks until every group's hit covers it (vLLM's HybridKVCacheCoordinator).
        Counts nothing in the hit rate: a request the pool cannot take yet is looked up again the next step
        (record_prefix_cache_stats counts it once it is admitted).
        """
        if not self.lookup_enabled(request):
            return tuple([] for _ in self.groups), 0
        num_hit_blocks = (request.num_tokens - 1) // self.block_size
        while True:
            hits = tuple(group.longest_hit(request.block_hashes[:num_hit_blocks]) for group in self.groups)
            shortest = min(len(blocks) for blocks in hits)
            if shortest == num_hit_blocks or len(hits) == 1:
                break
            num_hit_blocks = shortest
        return hits, len(hits[0]) * self.block_size

    def lookup_enabled(self, request: Request) -> bool:
        """Whether the request reads the prefix cache (not with prompt logprobs, which need every position's
        logits)."""
        return self.enable_caching and request.sampling_params.prompt_logprobs is None

    def record_prefix_cache_stats(self, request: Request, num_hit_tokens: int) -> None:
        """Counts a lookup in the hit rate once its request is admitted (vLLM's record_prefix_cache_stats, called at
        admission): its tokens as queries, its hit as hits. A request that skipped the lookup counts nothing, and
        neither does one resuming from preemption, which mostly finds its own blocks again (vLLM keeps those apart
        from queries and hits, in PrefixCacheStats' preempted_* fields)."""
        if not self.lookup_enabled(request) or request.num_preemptions > 0:
            return
        self.prefix_cache_requests += 1
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Optional[tuple[list[KVCacheBlock], ...]] = None,
                       num_new_computed_tokens: int = 0, num_lookahead_tokens: int = 0,
                       full_sequence_must_fit: bool = False) -> Optional[tuple[Sequence[KVCacheBlock], ...]]:
        """Makes room for num_new_tokens more tokens of KV (after any prefix-hit blocks) in every group.

        Returns each group's newly allocated blocks (no_new_blocks where none was needed), or None when the pool
        cannot supply them all — in which case nothing was allocated and no ref count changed (but for blocks out of
        a sliding window, freed first either way: no later query reads them). Full blocks are registered in the
        prefix cache as they fill.

        ``full_sequence_must_fit`` (vLLM's, for scheduler_reserve_full_isl): None also unless the free blocks hold
        every block the request's known tokens need, so that a waiting request is admitted once its whole prompt
        fits, not to be preempted half-computed.
        """
        if num_new_tokens <= 0:
            raise ValueError(f"num_new_tokens must be positive, got {num_new_tokens}")
        request_id = request.request_id
        new_computed_blocks = new_computed_blocks or self.no_new_blocks
        num_computed_tokens = request.num_computed_tokens + num_new_computed_tokens
        if full_sequence_must_fit and self._num_blocks_to_allocate(
                self.req_to_blocks.get(request_id, self.no_new_blocks), min(request.num_tokens, self.max_model_len),
                new_computed_blocks, num_computed_tokens, admission_cap=True) > self.block_pool.get_num_free_blocks():
            return None
        req_blocks = self.req_to_blocks.get(request_id)
        fresh = req_blocks is None
        if fresh:
            req_blocks = self.req_to_blocks[request_id] = tuple([] for _ in self.groups)
        for g, group in self._windowed:
            group.remove_skipped_blocks(req_blocks[g], request.num_computed_tokens)
        num_tokens_after = min(num_computed_tokens + num_new_tokens + num_lookahead_tokens, self.max_model_len)
        num_held = len(req_blocks[0])
        if not new_computed_blocks[0] and num_tokens_after <= num_held * self.block_size:
            # The common decode step: the last block still has room.
            self._cache_new_full_blocks(request, req_blocks, num_computed_tokens + num_new_tokens)
            return self.no_new_blocks
        if self._num_blocks_to_allocate(req_blocks, num_tokens_after, new_computed_blocks, num_computed_tokens,
                                        admission_cap=False) > self.block_pool.get_num_free_blocks():
            if fresh:
                del self.req_to_blocks[request_id]
            return None

        # Every group's hits out of the free queue before any group's new blocks come from it: a hit block near the
        # queue's front would otherwise be handed out (its hash dropped) as another group's new block, and then held
        # by both (vLLM's coordinator saves all hits before allocating).
        for blocks, hits in zip(req_blocks, new_computed_blocks):
            if hits:
                self.block_pool.touch(hits)
                blocks.extend(hits)
        num_new_blocks = cdiv(num_tokens_after, self.block_size) - len(req_blocks[0])
        new_blocks = []
        for blocks in req_blocks:
            new = self.block_pool.get_new_blocks(num_new_blocks) if num_new_blocks > 0 else []
            blocks.extend(new)
            new_blocks.append(new)
        self._cache_new_full_blocks(request, req_blocks, num_computed_tokens + num_new_tokens)
        return tuple(new_blocks)

    def _num_blocks_to_allocate(self, req_blocks: tuple[Sequence[KVCacheBlock], ...], num_tokens: int,
                                new_computed_blocks: tuple[list[KVCacheBlock], ...], num_computed_tokens: int,
                                admission_cap: bool) -> int:
        """The free blocks that slots for a request's first ``num_tokens`` tokens take (vLLM's
        get_num_blocks_to_allocate, summed over the groups). In each group: a block per block_size tokens (with
        ``admission_cap``, under a sliding window at most max_blocks' bound, what the request holds at once as its
        chunks run), less those it holds or its hit covers, or that its window has skipped by num_computed_tokens
        (the null block stands for those); and the hit's blocks sitting in the free queue, which taking them removes
        from it."""
        null = self.block_pool.null_block
        num_needed = 0
        for group, blocks, hits in zip(self.groups, req_blocks, new_computed_blocks):
            window = group.sliding_window
            num_required = cdiv(num_tokens, self.block_size)
            if admission_cap and window is not None:
                num_required = max_blocks((window,), self.block_size, num_tokens, self.max_step_tokens)
            num_skipped = 0 if window is None else max(num_computed_tokens - window + 1, 0) // self.block_size
            num_needed += max(num_required - max(num_skipped, len(blocks) + len(hits)), 0)
            num_needed += sum(b.ref_cnt == 0 and b is not null for b in hits)
        return num_needed

    def _cache_new_full_blocks(self, request: Request, req_blocks: tuple[list[KVCacheBlock], ...], num_tokens: int
                               ) -> None:
        """Registers, in every group, the blocks that the first num_tokens tokens fill (and whose hashes are
        known)."""
        if not self.enable_caching:
            return
        num_full = min(num_tokens // self.block_size, len(request.block_hashes))
        num_cached = self.num_cached_block.get(request.request_id, 0)
        if num_full > num_cached:
            for group, blocks in zip(self.groups, req_blocks):
                group.cache_full_blocks(request.block_hashes, blocks, num_cached, num_full)
            self.num_cached_block[request.request_id] = num_full

    def uncache_uncomputed_blocks(self, request: Request) -> None:
        """Drops from the prefix cache the request's blocks that hold a token it has not computed: registered when
        its slots were allocated for a step that will not run them (a request preempted in the step that scheduled
        it, which the priority policy may pick), they would otherwise serve later hits K/V never written."""
        first = request.num_computed_tokens // self.block_size
        for blocks in self.req_to_blocks.get(request.request_id, ()):
            self.block_pool.uncache_blocks(blocks[first:])
        if self.num_cached_block.get(request.request_id, 0) > first:
            self.num_cached_block[request.request_id] = first

    def free(self, request: Request) -> None:
        """Releases the request's blocks, each group's tail first, so its unique tail is evicted before a shared
        prefix."""
        for blocks in self.req_to_blocks.pop(request.request_id, ()):
            self.block_pool.free_blocks(reversed(blocks))
        self.num_cached_block.pop(request.request_id, None)

    def free_blocks_beyond(self, request: Request, num_tokens: int) -> None:
        """Gives back the request's blocks past those its first ``num_tokens`` tokens fill (speculative decoding:
        slots only rejected drafts had reached). Never a cached block: cached blocks hold known tokens only."""
        keep = cdiv(num_tokens, self.block_size)
        for blocks in self.req_to_blocks.get(request.request_id, ()):
            if len(blocks) > keep:
                excess = blocks[keep:]
                del blocks[keep:]
                self.block_pool.free_blocks(reversed(excess))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return tuple([] for _ in self.groups)
        return tuple([b.block_id for b in group_blocks] for group_blocks in blocks)

    def new_block_ids(self, new_blocks: tuple[Sequence[KVCacheBlock], ...]) -> tuple[Sequence[int], ...]:
        """The ids of allocate_slots' new blocks, per group (no_new_blocks as it is: a tuple of empty tuples)."""
        if new_blocks is self.no_new_blocks:
            return new_blocks
        return tuple([[b.block_id for b in blocks] for blocks in new_blocks])

    def reset_prefix_cache(self) -> bool:
        """The pool's reset, counted when it succeeds: the logged hit rate then starts afresh, as vLLM's."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_resets += 1
        return True
