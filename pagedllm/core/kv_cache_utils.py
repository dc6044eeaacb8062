"""KV blocks, the LRU free-block queue, and chained block hashing for prefix caching."""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import msgspec
import numpy as np

if TYPE_CHECKING:
    from pagedllm.core.request import Request

BlockHash = bytes
# The parent of a request's first block: a fixed seed, so hashes are stable across processes and restarts.
ROOT_BLOCK_HASH: BlockHash = hashlib.sha256(b"pagedllm-root").digest()


class KVCacheBlock:
    """One block of KV slots. Sits in the free queue while ref_cnt == 0 (possibly still holding cached KV)."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free_block", "next_free_block")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: Optional[BlockHash] = None
        self.prev_free_block: Optional[KVCacheBlock] = None
        self.next_free_block: Optional[KVCacheBlock] = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, cached={self.block_hash is not None})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks, least recently freed at the front (evicted first).

    A prefix-cache hit removes a block from the middle in O(1), which a deque cannot do.
    """

    def __init__(self, blocks: Sequence[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self._head = KVCacheBlock(-1)  # sentinels: no None checks on the hot path
        self._tail = KVCacheBlock(-1)
        prev = self._head
        for block in blocks:
            prev.next_free_block, block.prev_free_block = block, prev
            prev = block
        prev.next_free_block, self._tail.prev_free_block = self._tail, prev

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free_block
        if block is self._tail:
            raise ValueError("No free blocks available")
        self.remove(block)
        return block

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > self.num_free_blocks:
            raise ValueError(f"Cannot pop {n} blocks: only {self.num_free_blocks} free")
        out = []
        block = self._head.next_free_block
        for _ in range(n):
            out.append(block)
            nxt = block.next_free_block
            block.prev_free_block = block.next_free_block = None
            block = nxt
        self._head.next_free_block, block.prev_free_block = block, self._head
        self.num_free_blocks -= n
        return out

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free_block is None or block.next_free_block is None:
            raise RuntimeError(f"{block} is not in the free queue")
        block.prev_free_block.next_free_block = block.next_free_block
        block.next_free_block.prev_free_block = block.prev_free_block
        block.prev_free_block = block.next_free_block = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free_block
        last.next_free_block, block.prev_free_block = block, last
        block.next_free_block, self._tail.prev_free_block = self._tail, block
        self.num_free_blocks += 1

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        out, block = [], self._head.next_free_block
        while block is not self._tail:
            out.append(block)
            block = block.next_free_block
        return out


_extra_keys_encoder = msgspec.msgpack.Encoder()


def hash_block_tokens(parent_block_hash: Optional[BlockHash], token_ids: Sequence[int],
                      extra_keys: Optional[tuple[Any, ...]] = None) -> BlockHash:
    """sha256 over (parent hash, the block's token ids as int64 bytes, msgpack of extra keys).

    Chaining the parent makes a block's hash identify the whole prefix up to and including it.
    """
    h = hashlib.sha256(parent_block_hash or ROOT_BLOCK_HASH)
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    if extra_keys:
        h.update(_extra_keys_encoder.encode(extra_keys))
    return h.digest()


def block_extra_keys(request: "Request", block_index: int) -> Optional[tuple[Any, ...]]:
    """Keys besides the tokens that make KV differ: the cache salt and the LoRA adapter (an adapter changes every
    layer's K/V) by its name and path, as vLLM's (_gen_lora_extra_hash_keys), not by its id: an id reloaded from
    another path (load_inplace) then never serves the KV of the adapter it had, and the same adapter under another
    id (loaded again after an unload) shares its blocks. The first block's keys suffice: every later hash chains
    from it, so requests with different keys share no block, and requests with the same keys share them all."""
    if block_index != 0:
        return None
    lora = request.lora_request
    keys = ((request.cache_salt,) if request.cache_salt else ()) + (
        ("lora", lora.lora_name, lora.lora_path) if lora is not None else ())
    return keys or None


def make_block_hasher(block_size: int) -> Callable[["Request"], list[BlockHash]]:
    """Returns a hasher that computes the hashes of the request's newly full blocks, once each."""

    def hasher(request: "Request") -> list[BlockHash]:
        start = len(request.block_hashes)
        end = request.num_tokens // block_size
        if end <= start:
            return []
        parent = request.block_hashes[-1] if start else None
        tokens = request.all_token_ids
        new_hashes = []
        for i in range(start, end):
            parent = hash_block_tokens(parent, tokens[i * block_size:(i + 1) * block_size],
                                       block_extra_keys(request, i))
            new_hashes.append(parent)
        return new_hashes

    return hasher
