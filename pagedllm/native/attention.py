"""Typed calls of the paged-attention library (paged_decode.c, paged_prefill.c, paged_cascade.c; layout and dtypes in
paged_attention.h): each C function declared once by name (its CFunction) and called through one wrapper that takes
tensors, derives the sizes and strides the C side wants from them, and, with ``PAGEDLLM_NATIVE_CHECKS=1``, checks
them first (native/checks.py). The calls go through ``graph.launch`` so that CPU graphs can record them.

The library is built once per KV cache dtype (float32; bf16 with ``-DKV_BF16``; the kv_cache_dtypes fp8_e4m3, fp8_e5m2
and int8 with ``-DKV_FP8_E4M3``, ``-DKV_FP8_E5M2``, ``-DKV_INT8``); queries, outputs and log-sum-exps are float32
whatever it is. Caches are passed flat, ``[num_slots, num_kv_heads, row_width]`` (kv_cache_dtype.row_width: the head
size, and for int8 the bytes of each row's scale after it). Each attention kernel takes ``logits_soft_cap`` (vLLM's
name; Gemma 2's attn_logit_softcapping): scores become cap * tanh(score / cap) before the softmax; None (0 to the C
side) leaves them as they are; and ``kv_scales``, float32 ``[2, num_kv_heads]``, the rows k_scale and v_scale: every
cached key of KV head h is worth k_scale[h] times what it widens to, every value v_scale[h] times (an fp8 cache's
scales, per tensor or per KV head; kv_cache_dtype.unit_kv_scales, the default, for the others). The kernels read
them when they run: a CPU graph's recorded call points at the tensor, which must outlive it (a layer's does).
"""

from __future__ import annotations

import ctypes

import torch

from pagedllm.kv_cache_dtype import row_width, unit_kv_scales
from pagedllm.native import checks
from pagedllm.native.checks import check_block_tables, expect, require
from pagedllm.native.graph import launch
from pagedllm.native.signature import FLOAT, INT, INT64, POINTER, STRING, CFunction, arguments

PAGED_DECODE = CFunction("paged_decode_f32", INT, *arguments(
    "q", POINTER, "q_row_stride", INT64, "k_cache", "v_cache", "block_table", POINTER, "block_table_stride", INT64,
    "seq_lens", POINTER, "start_pos", "window", INT, "out", "lse", POINTER, "num_reqs", "num_heads", "num_kv_heads",
    "head_size", "block_size", INT, "scale", "softcap", FLOAT, "k_scale", "v_scale", POINTER, "num_threads", INT))
PAGED_PREFILL = CFunction("paged_prefill_f32", INT, *arguments(
    "q", POINTER, "q_row_stride", INT64, "k_cache", "v_cache", "block_table", POINTER, "block_table_stride", INT64,
    "query_start", "query_len", "seq_len", POINTER, "start_pos", "window", INT, "out", "lse", POINTER, "num_reqs",
    "num_heads", "num_kv_heads", "head_size", "block_size", INT, "scale", "softcap", FLOAT, "k_scale", "v_scale",
    POINTER, "num_threads", INT))
PAGED_PREFIX = CFunction("paged_prefix_f32", INT, *arguments(
    "q", POINTER, "q_row_stride", INT64, "k_cache", "v_cache", "block_table", POINTER, "prefix_tokens", "num_rows",
    INT, "out", "lse", POINTER, "num_heads", "num_kv_heads", "head_size", "block_size", INT, "scale", "softcap",
    FLOAT, "k_scale", "v_scale", POINTER, "num_threads", INT))
MERGE_ATTN_STATES = CFunction("merge_attn_states_f32", None, *arguments(
    "out", "out_a", "lse_a", "out_b", "lse_b", POINTER, "rows_heads", INT64, "head_size", INT))
PAGED_DECODE_ISA = CFunction("paged_decode_isa", STRING)
PAGED_PREFILL_AVAILABLE = CFunction("paged_prefill_available", INT)
PAGED_PREFILL_SUPPORTS = CFunction("paged_prefill_supports", INT, *arguments(
    "num_heads", "num_kv_heads", "head_size", INT))
PAGED_PREFILL_PAIRS = CFunction("paged_prefill_pairs", INT)
PAGED_PREFILL_AMX = CFunction("paged_prefill_amx", INT)
SIGNATURES = (PAGED_DECODE, PAGED_PREFILL, PAGED_PREFIX, MERGE_ATTN_STATES, PAGED_DECODE_ISA, PAGED_PREFILL_AVAILABLE,
              PAGED_PREFILL_SUPPORTS, PAGED_PREFILL_PAIRS, PAGED_PREFILL_AMX)

MAX_GROUP, MAX_HEAD_SIZE = 16, 256  # paged_attention.h's: the decode rows take these


def _check_rows(kernel: str, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, kv_dtype: torch.dtype,
                out: torch.Tensor, lse: torch.Tensor, rows: int) -> None:
    """q ``[rows, heads, head_size]`` (rows may be strided), the two caches, and out/lse for those rows."""
    expect(kernel, "q", q, torch.float32, (rows, None, None), dense_rows=True)
    heads, head_size = q.shape[1], q.shape[2]
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        expect(kernel, name, cache, kv_dtype, (None, None, row_width(head_size, kv_dtype)), contiguous=True)
    require(kernel, k_cache.shape == v_cache.shape, "k_cache and v_cache differ in shape")
    require(kernel, heads % k_cache.shape[1] == 0 and heads // k_cache.shape[1] <= MAX_GROUP,
            f"{heads} query heads do not group over {k_cache.shape[1]} KV heads (at most {MAX_GROUP} a group)")
    # out and lse may group the heads by KV head ([rows, kv_heads, group, ...]): only their elements count.
    expect(kernel, "out", out, torch.float32, contiguous=True)
    expect(kernel, "lse", lse, torch.float32, contiguous=True)
    require(kernel, out.numel() == rows * heads * head_size and lse.numel() == rows * heads,
            f"out and lse must hold {rows} rows of {heads} heads (x {head_size}), hold {out.numel()} and "
            f"{lse.numel()} elements")


def _scale_pointers(kernel: str, kv_scales: torch.Tensor | None, num_kv_heads: int) -> tuple[int, int]:
    """The k_scale and v_scale rows' addresses of ``kv_scales`` (None: unit_kv_scales)."""
    if kv_scales is None:
        kv_scales = unit_kv_scales(num_kv_heads)
    if checks.ENABLED:
        expect(kernel, "kv_scales", kv_scales, torch.float32, (2, num_kv_heads), contiguous=True)
    return kv_scales[0].data_ptr(), kv_scales[1].data_ptr()


class _AttentionKernel:
    """One kernel of a loaded library for one KV cache dtype: ``SIGNATURE`` names its C function."""

    SIGNATURE: CFunction

    def __init__(self, lib: ctypes.CDLL, kv_dtype: torch.dtype):
        self.function, self.kv_dtype = getattr(lib, self.SIGNATURE.name), kv_dtype

    def _launch(self, *args) -> None:
        status = launch(self.function, *args)
        if status != 0:
            raise RuntimeError(f"{self.SIGNATURE.name} rejected its sizes (status {status})")


class PagedDecode(_AttentionKernel):
    """paged_decode_f32: one query row per request against its history, read through its block table."""

    SIGNATURE = PAGED_DECODE

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 seq_lens: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, *, start_pos: int, block_size: int,
                 scale: float, sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 kv_scales: torch.Tensor | None = None) -> None:
        """Request r's row q[r] ``[heads, head_size]`` attends to positions start_pos .. seq_lens[r] - 1 (each
        seq_lens[r] > start_pos) of its blocks ``block_table[r]`` (int32, rows may be strided), under a
        ``sliding_window`` only the last that many of them; writes out[r] and lse[r]."""
        num_reqs = block_table.shape[0]
        if checks.ENABLED:
            kernel = PAGED_DECODE.name
            _check_rows(kernel, q, k_cache, v_cache, self.kv_dtype, out, lse, num_reqs)
            require(kernel, q.shape[2] <= MAX_HEAD_SIZE, f"head size {q.shape[2]} is above {MAX_HEAD_SIZE}")
            expect(kernel, "block_table", block_table, torch.int32, (num_reqs, None), dense_rows=True)
            expect(kernel, "seq_lens", seq_lens, torch.int32, (num_reqs,), contiguous=True)
            require(kernel, bool((seq_lens > start_pos).all()), f"a sequence ends at or before start_pos {start_pos}")
            check_block_tables(kernel, block_table, seq_lens, block_size, k_cache.shape[0])
        self._launch(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                     block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr(), start_pos,
                     sliding_window or 0, out.data_ptr(),
                     lse.data_ptr(), num_reqs, q.shape[1], k_cache.shape[1], q.shape[2], block_size, scale,
                     logits_soft_cap or 0.0, *_scale_pointers(PAGED_DECODE.name, kv_scales, k_cache.shape[1]),
                     torch.get_num_threads())


class PagedPrefill(_AttentionKernel):
    """paged_prefill_f32: prefill chunks' query rows against their requests' histories, by tiles."""

    SIGNATURE = PAGED_PREFILL

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 query_start: torch.Tensor, query_len: torch.Tensor, seq_len: torch.Tensor, out: torch.Tensor,
                 lse: torch.Tensor, *, start_pos: int, block_size: int, scale: float,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None,
                 kv_scales: torch.Tensor | None = None) -> None:
        """Chunk r's query rows query_start[r] .. + query_len[r] - 1 of q (``[rows, heads, head_size]``, rows may
        be strided) are the last query_len[r] of its seq_len[r] positions, each seeing start_pos .. itself through
        block_table[r] (contiguous int32), under a ``sliding_window`` only the last that many of those; writes
        those rows of out and lse."""
        num_reqs = block_table.shape[0]
        if checks.ENABLED:
            kernel = PAGED_PREFILL.name
            _check_rows(kernel, q, k_cache, v_cache, self.kv_dtype, out, lse, q.shape[0])
            expect(kernel, "block_table", block_table, torch.int32, (num_reqs, None), contiguous=True)
            for name, t in (("query_start", query_start), ("query_len", query_len), ("seq_len", seq_len)):
                expect(kernel, name, t, torch.int32, (num_reqs,), contiguous=True)
            require(kernel, bool((query_start + query_len <= q.shape[0]).all() & (query_len <= seq_len).all()),
                    "a chunk's rows run past q, or it has more query rows than positions")
            check_block_tables(kernel, block_table, seq_len, block_size, k_cache.shape[0])
        self._launch(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), block_table.data_ptr(),
                     block_table.shape[1], query_start.data_ptr(), query_len.data_ptr(), seq_len.data_ptr(),
                     start_pos, sliding_window or 0, out.data_ptr(), lse.data_ptr(), num_reqs, q.shape[1],
                     k_cache.shape[1], q.shape[2], block_size, scale, logits_soft_cap or 0.0,
                     *_scale_pointers(PAGED_PREFILL.name, kv_scales, k_cache.shape[1]), torch.get_num_threads())


class PagedPrefix(_AttentionKernel):
    """paged_prefix_f32: cascade attention's shared part, every query row against a prefix of blocks alone."""

    SIGNATURE = PAGED_PREFIX

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor,
                 prefix_tokens: int, out: torch.Tensor, lse: torch.Tensor, *, block_size: int, scale: float,
                 logits_soft_cap: float | None = None, kv_scales: torch.Tensor | None = None) -> None:
        """Every row of q ``[rows, heads, head_size]`` (rows may be strided) attends to the prefix_tokens positions
        held by the blocks block_ids starts with (int32, contiguous); writes out and lse."""
        if checks.ENABLED:
            kernel = PAGED_PREFIX.name
            _check_rows(kernel, q, k_cache, v_cache, self.kv_dtype, out, lse, q.shape[0])
            expect(kernel, "block_ids", block_ids, torch.int32, (None,), contiguous=True)
            check_block_tables(kernel, block_ids[None], torch.tensor([prefix_tokens]), block_size,
                               k_cache.shape[0])
        self._launch(q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
                     block_ids.data_ptr(), prefix_tokens, q.shape[0], out.data_ptr(), lse.data_ptr(), q.shape[1],
                     k_cache.shape[1], q.shape[2], block_size, scale, logits_soft_cap or 0.0,
                     *_scale_pointers(PAGED_PREFIX.name, kv_scales, k_cache.shape[1]), torch.get_num_threads())


class MergeAttnStates:
    """merge_attn_states_f32: two partial attentions merged by their log-sum-exps."""

    def __init__(self, lib: ctypes.CDLL):
        self.function = getattr(lib, MERGE_ATTN_STATES.name)

    def __call__(self, out: torch.Tensor, out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> None:
        """out = the attention over both key sets, from a's and b's normalised outputs ``[..., head_size]`` and
        log-sum-exps ``[...]`` (all contiguous float32)."""
        if checks.ENABLED:
            kernel = MERGE_ATTN_STATES.name
            for name, t in (("out", out), ("out_a", out_a), ("out_b", out_b)):
                expect(kernel, name, t, torch.float32, tuple(out_a.shape), contiguous=True)
            for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
                expect(kernel, name, t, torch.float32, contiguous=True)
                require(kernel, t.numel() * out_a.shape[-1] == out_a.numel(), f"{name} must hold one value a head")
        launch(self.function, out.data_ptr(), out_a.data_ptr(), lse_a.data_ptr(), out_b.data_ptr(), lse_b.data_ptr(),
               lse_a.numel(), out_a.shape[-1])


class PagedAttentionLibrary:
    """The library for one KV cache dtype: its typed kernels and what this build has."""

    def __init__(self, lib: ctypes.CDLL, kv_dtype: torch.dtype):
        self._lib, self.kv_dtype = lib, kv_dtype
        self.decode = PagedDecode(lib, kv_dtype)
        self.decode_isa = lib.paged_decode_isa().decode()
        self.has_prefill = bool(lib.paged_prefill_available())
        self.prefill = PagedPrefill(lib, kv_dtype) if self.has_prefill else None
        self.prefix = PagedPrefix(lib, kv_dtype) if self.has_prefill else None
        self.merge = MergeAttnStates(lib)
        self.prefill_pairs = self.has_prefill and bool(lib.paged_prefill_pairs())
        # the pairs multiplied on AMX tiles (built for them, and the OS lets the process use them)
        self.prefill_amx = bool(lib.paged_prefill_amx())

    def prefill_supports(self, num_heads: int, num_kv_heads: int, head_size: int) -> bool:
        """Whether the prefill tiles (and so the cascade prefix) take these sizes (head sizes 64, 128 and 256)."""
        return self.has_prefill and bool(self._lib.paged_prefill_supports(num_heads, num_kv_heads, head_size))
