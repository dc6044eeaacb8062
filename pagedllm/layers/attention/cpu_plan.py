"""What the CPU attention backend derives from AttentionMetadata once per step and reuses in every layer.

The batch splits into decode rows (one new token; the native kernel's rows, or batched into one SDPA call,
histories padded to the longest) and prefill chunks (several new tokens; all in one native call, or one SDPA
call each). When every request's block table starts
with the same blocks (a shared system prompt, n > 1 samples, W3's common document) and every query comes
after them, the plan also holds that shared prefix: it is attended once for all query rows together
(cascade attention) and each request gathers only the rest of its history, instead of every request
copying the whole prefix out of the cache in every layer.

A layer with a sliding window gets its own plan: each torch-path query reads only its window (a decode row's
history starts at its window; a prefill chunk's context starts at its first query's window, masked per query), and
there is no shared prefix. Attending a prefix once for all rows is only right where every row sees all of it; under
a window the rows' windows start at different places, inside it or past it (and the blocks out of every window may
already be back in the pool, their table entries stale, or, after a prefix hit, the same null block's id in every
row, which would look like a shared prefix).
"""

from dataclasses import dataclass

import torch

from pagedllm.layers.attention.metadata import AttentionMetadata

# A shared prefix shorter than this is read by each request with the rest of its history: merging two partial
# attentions costs more than reading (or copying) a few blocks again per request.
CASCADE_MIN_PREFIX_TOKENS = 256


@dataclass
class SharedPrefix:
    num_tokens: int
    # Cache slots of the prefix, or None when its blocks are consecutive: then it is the view
    # cache[start_slot : start_slot + num_tokens] and nothing is copied.
    slots: torch.Tensor | None
    start_slot: int
    block_ids: torch.Tensor  # the first request's block table row: the prefix's blocks come first


@dataclass
class PrefillChunk:
    start: int
    end: int
    # Cache slots of the context this chunk reads (after any shared prefix), or None when the chunk is the
    # request's whole context (attend to this step's K/V directly, plain causal).
    slots: torch.Tensor | None
    # [q_len, context length] additive: 0 = may attend, -inf = may not; None: plain causal over this step's K/V
    mask: torch.Tensor | None


@dataclass
class NativePrefill:
    """The prefill chunks for the native kernel, which reads their context in place: per chunk its request's
    block table, first query row, number of query rows and positions after this step (all int32)."""
    block_table: torch.Tensor  # [num_chunks, max_blocks], contiguous
    query_start: torch.Tensor
    query_len: torch.Tensor
    seq_len: torch.Tensor


@dataclass
class AttentionPlan:
    block_size: int
    dtype: torch.dtype
    prefix: SharedPrefix | None
    decode_rows: torch.Tensor | None  # [Bd] query rows of the decode requests
    # The decode rows lead, in order: decode_rows is 0 .. Bd - 1 (every row a decode row, or the model runner put
    # them first), so the native kernel reads them and writes their results in place.
    decodes_lead: bool
    # For the native kernel (reads the cache in place): the decode requests' block tables and lengths.
    decode_block_table: torch.Tensor | None  # [Bd, max_blocks] int32, contiguous
    decode_seq_lens: torch.Tensor | None  # [Bd] int32
    # For the torch path (gathers the histories, padded to the longest):
    decode_slots: torch.Tensor | None  # [Bd * S] cache slots; padding repeats a real slot, then is masked out
    decode_seq_len: int  # S, the longest history read by a decode row (after the shared prefix)
    decode_mask: torch.Tensor | None  # [Bd, 1, 1, S] additive, None if every history is S long
    prefills: list[PrefillChunk]  # for the torch path
    native_prefill: NativePrefill | None
    native_prefix: bool  # the shared prefix goes to the native kernel (which reads prefix.block_ids in place)


def slots_of(block_ids: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Cache slot of each token position, given the request's block ids."""
    return block_ids.long().gather(-1, positions // block_size) * block_size + positions % block_size


def build_plan(md: AttentionMetadata, block_size: int, dtype: torch.dtype, native_decode: bool,
               native_prefill: bool, sliding_window: int | None = None) -> AttentionPlan:
    prefix = None if sliding_window else _shared_prefix(md, block_size)
    d = md.num_decodes
    if md.chunk_query_len is not None and native_prefill and (d == 0 or native_decode):
        # The batch as the model runner split it: decode rows first, then every request a chunk, as given (in a
        # graph's metadata the block table and lengths are already contiguous int32: nothing is copied).
        block_table, seq_lens = md.block_table.to(torch.int32).contiguous(), md.seq_lens.to(torch.int32)
        chunks = None
        if md.chunk_query_len.shape[0]:
            chunks = NativePrefill(block_table[d:], md.chunk_query_start, md.chunk_query_len, seq_lens[d:])
        decode_rows = torch.arange(d) if d else None
        return AttentionPlan(block_size, dtype, prefix, decode_rows, True, block_table[:d] if d else None,
                             seq_lens[:d] if d else None, None, 0, None, [], chunks, _native_prefix(prefix))
    skip = prefix.num_tokens if prefix else 0
    qsl = md.query_start_loc.tolist()
    seq_lens = md.seq_lens.tolist()
    decode_reqs, prefills, native_prefill_reqs = [], [], []
    for i, seq_len in enumerate(seq_lens):
        start, end = qsl[i], qsl[i + 1]
        q_len = end - start
        if q_len == 1:
            decode_reqs.append(i)
        elif q_len > 1 and native_prefill:
            native_prefill_reqs.append(i)
        elif q_len > 1 and seq_len == q_len and (sliding_window is None or seq_len <= sliding_window):
            prefills.append(PrefillChunk(start, end, None, None))
        elif q_len > 1:
            query_positions = torch.arange(seq_len - q_len, seq_len)  # query row r sits at seq_len - q_len + r
            first = _window_start(skip, seq_len - q_len, sliding_window)
            positions = torch.arange(first, seq_len)
            mask = _additive_mask(_allowed(positions[None, :], query_positions[:, None], sliding_window), dtype)
            slots = None if seq_len == q_len else slots_of(md.block_table[i], positions, block_size)
            prefills.append(PrefillChunk(start, end, slots, mask))

    decode_rows = decode_block_table = decode_seq_lens = decode_slots = decode_mask = None
    decode_seq_len = 0
    if decode_reqs:
        idx = torch.tensor(decode_reqs)
        decode_rows = md.query_start_loc[idx].long()
    decodes_lead = decode_reqs == list(range(len(decode_reqs))) and qsl[len(decode_reqs)] == len(decode_reqs)
    if decodes_lead and len(decode_reqs) == len(seq_lens) and native_decode:  # every request: the metadata's own
        decode_block_table = md.block_table.to(torch.int32).contiguous()  # tensors when already int32
        decode_seq_lens = md.seq_lens.to(torch.int32)
    elif decode_reqs and native_decode:
        decode_block_table = md.block_table[idx].to(torch.int32).contiguous()
        decode_seq_lens = md.seq_lens[idx].to(torch.int32)
    elif decode_reqs:
        seq_lens_d = md.seq_lens[idx].long()
        first = _window_start(skip, seq_lens_d - 1, sliding_window)
        lens = seq_lens_d - first
        decode_seq_len = int(lens.max())
        offsets = torch.arange(decode_seq_len).expand(len(decode_reqs), -1)
        valid = offsets < lens[:, None]
        # Padding reads the request's first slot it sees (real data), then is masked out.
        positions = torch.where(valid, offsets, 0) + first[:, None]
        decode_slots = slots_of(md.block_table[idx], positions, block_size).reshape(-1)
        if not bool(valid.all()):
            decode_mask = _additive_mask(valid[:, None, None, :], dtype)
    return AttentionPlan(block_size, dtype, prefix, decode_rows, decodes_lead, decode_block_table, decode_seq_lens,
                         decode_slots, decode_seq_len, decode_mask, prefills, _native_prefill(md, native_prefill_reqs),
                         native_prefill and _native_prefix(prefix))


def _window_start(start: int, position, sliding_window: int | None):
    """The first position a query at ``position`` (an int or a tensor of them) reads, from ``start`` on: its
    window's first (keys > position - sliding_window), as the native kernels' window_start."""
    if sliding_window is None:
        return start if isinstance(position, int) else torch.full_like(position, start)
    if isinstance(position, int):
        return max(start, position + 1 - sliding_window)
    return (position + 1 - sliding_window).clamp(min=start)


def _allowed(key_positions: torch.Tensor, query_positions: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Which keys each query sees (broadcast): those up to its own position, and inside its window."""
    allowed = key_positions <= query_positions
    if sliding_window is not None:
        allowed &= key_positions > query_positions - sliding_window
    return allowed


def _native_prefix(prefix: SharedPrefix | None) -> bool:
    """Whether the native kernel (given native prefill tiles) can read the shared prefix's blocks in place."""
    return prefix is not None and prefix.block_ids.dtype == torch.int32 and prefix.block_ids.stride(0) == 1


def _native_prefill(md: AttentionMetadata, reqs: list[int]) -> NativePrefill | None:
    if not reqs:
        return None
    idx = torch.tensor(reqs)
    start = md.query_start_loc[idx]
    return NativePrefill(md.block_table[idx].to(torch.int32).contiguous(), start.to(torch.int32),
                         (md.query_start_loc[idx + 1] - start).to(torch.int32), md.seq_lens[idx].to(torch.int32))


def shared_prefix_tokens(md: AttentionMetadata, block_size: int) -> int:
    """How many leading tokens the plan of this batch attends separately (cascade attention), or 0."""
    prefix = _shared_prefix(md, block_size)
    return 0 if prefix is None else prefix.num_tokens


def _shared_prefix(md: AttentionMetadata, block_size: int) -> SharedPrefix | None:
    """The leading blocks common to every request, cut to what every query comes after."""
    num_reqs = md.seq_lens.shape[0]
    if num_reqs < 2:
        return None
    num_computed = md.seq_lens - (md.query_start_loc[1:] - md.query_start_loc[:-1])
    max_blocks = min(int(num_computed.min()) // block_size, md.block_table.shape[1])
    if max_blocks * block_size < CASCADE_MIN_PREFIX_TOKENS:
        return None
    table = md.block_table[:, :max_blocks]
    num_blocks = int((table == table[:1]).all(0).int().cumprod(0).sum())
    if num_blocks * block_size < CASCADE_MIN_PREFIX_TOKENS:
        return None
    block_ids = table[0, :num_blocks].long()
    num_tokens = num_blocks * block_size
    start_slot = int(block_ids[0]) * block_size
    if bool((block_ids[1:] - block_ids[:-1] == 1).all()):
        return SharedPrefix(num_tokens, None, start_slot, md.block_table[0])
    return SharedPrefix(num_tokens, slots_of(block_ids, torch.arange(num_tokens), block_size), start_slot,
                        md.block_table[0])


def _additive_mask(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """0 where allowed, -inf elsewhere: the flash kernel (called for its log-sum-exp) takes masks only in
    the query's dtype."""
    return torch.zeros(allowed.shape, dtype=dtype).masked_fill_(~allowed, float("-inf"))
