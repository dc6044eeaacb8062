"""Paged attention on CPU: the native kernels where they apply, torch's scaled_dot_product_attention elsewhere.

Per step the batch is planned once (cpu_plan.py). In float32, decode rows and (with AVX-512 or AVX2 and a head size
of 64, 128 or 256) prefill chunks go to the native kernels, which read each history in place through the block table
(native/attention.py; paged_decode.c, paged_prefill.c, paged_cascade.c). Which sizes those take is decided once,
when the layer is built; under ``PAGEDLLM_NATIVE_KERNELS=require`` sizes they do not take are an error there.
Otherwise decode rows are batched into one SDPA call over their histories, gathered from the cache and padded to
the longest one, and each prefill chunk is one call, causal inside the chunk and seeing the request's cached
earlier tokens. A prefix of blocks that every request shares is attended once for all rows and merged by
log-sum-exp (cascade attention). A layer with a sliding window has every path read only each query's window (the
kernels start each row's history at its window, the torch paths mask or narrow what they gather), and no cascade
attention (cpu_plan.build_plan says why). A layer with a logit soft cap (Gemma 2's) has every path cap its scores
before the softmax: the kernels take the cap as an argument, the torch paths, whose flash kernel has no place for
it, compute such a layer's attention in plain ops (_soft_capped_with_lse); cascade attention stays, both partial
softmaxes over capped scores. Only slots below a request's ``seq_len`` are ever read, so never-written cache
memory (even NaN garbage) cannot leak into the result.

The cache may hold bf16 while queries are float32 (a bfloat16 model with float32 activations, see
platforms/cpu.KernelChoice), or one byte an element (kv_cache_dtype fp8 or int8, kv_cache_dtype.py): the native
kernels read it so directly; the torch paths widen (dequantize) what they gather. Either way this step's own keys
and values are attended as the cache holds them (rounded or quantized), so a token's attention does not depend on
whether its context came from this step or an earlier one. An fp8 cache holds k / k_scale and v / v_scale (the layer's
checkpoint scales, per tensor or per KV head, AttentionImpl.kv_scales): the writes divide by them, the kernels take a
KV head's k_scale into its scores' scale and its v_scale into its outputs' normalisation, the torch paths multiply
what they widen.
"""

import torch

from pagedllm import native
from pagedllm.kv_cache_dtype import dequantize_rows, is_fp8, quantize_rows, row_width, unit_kv_scales
from pagedllm.layers.attention.backend import AttentionBackend, AttentionImpl, KVCache
from pagedllm.layers.attention.cpu_plan import AttentionPlan, PrefillChunk, build_plan
from pagedllm.layers.attention.metadata import AttentionMetadata
from pagedllm.native import build, fused
from pagedllm.native.attention import MAX_GROUP, MAX_HEAD_SIZE

_flash_with_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def _write_rows(cache_flat: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor) -> None:
    """Writes ``rows`` into the cache's ``slots``. A one-byte cache is written as its bytes: torch's CPU
    ``index_copy_`` has no float8 kernel, and a byte copy keeps every bit."""
    if cache_flat.dtype.itemsize == 1:
        cache_flat, rows = cache_flat.view(torch.uint8), rows.view(torch.uint8)
    cache_flat.index_copy_(0, slots, rows)


def _soft_capped_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
                          is_causal: bool, scale: float, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """What _flash_with_lse returns (the output in q's dtype, the float32 log-sum-exps ``[B, H, Lq]``) with the
    scaled scores soft-capped, cap * tanh(score / cap), before the mask and the softmax, as transformers' eager
    attention does. q ``[B, H, Lq, D]``, k and v ``[B, H, Lk, D]``; ``is_causal`` as flash's (top-left aligned)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)).mul_(scale / cap).tanh_().mul_(cap)
    if is_causal:
        scores.masked_fill_(torch.ones(scores.shape[-2:], dtype=torch.bool).triu_(1), float("-inf"))
    if attn_mask is not None:
        scores += attn_mask
    lse = scores.logsumexp(-1)
    out = torch.matmul(scores.sub_(lse.unsqueeze(-1)).exp_(), v.float())
    return out.to(q.dtype), lse


class TorchSDPABackendImpl(AttentionImpl):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int,
                 sliding_window: int | None = None, logits_soft_cap: float | None = None):
        super().__init__(num_heads, head_size, scale, num_kv_heads, sliding_window, logits_soft_cap)
        library = native.paged_attention()  # the sizes the kernels take do not depend on the cache's dtype
        self.native_decode_sizes = self.group <= MAX_GROUP and head_size <= MAX_HEAD_SIZE
        self.native_prefill_sizes = library is not None and library.prefill_supports(num_heads, num_kv_heads,
                                                                                      head_size)
        if build.mode() == "require" and library is not None and not (
                self.native_decode_sizes and (self.native_prefill_sizes or not library.has_prefill)):
            raise ValueError(f"PAGEDLLM_NATIVE_KERNELS=require, but the native attention kernels do not take "
                             f"{num_heads} heads of size {head_size} over {num_kv_heads} KV heads (decode rows: "
                             f"groups up to {MAX_GROUP}, head sizes up to {MAX_HEAD_SIZE}; prefill tiles: head "
                             "sizes 64, 128 and 256)")

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = kv_cache
        block_size = key_cache.shape[1]
        plan_key = ("torch_sdpa", self.sliding_window)  # one plan per window among the step's layers
        plan = attn_metadata.backend_cache.get(plan_key)
        if plan is None or plan.block_size != block_size or plan.dtype != query.dtype:
            plan = attn_metadata.backend_cache[plan_key] = build_plan(
                attn_metadata, block_size, query.dtype, self._native_decode(query.dtype, key_cache.dtype),
                self._native_prefill(query.dtype, key_cache.dtype), self.sliding_window)

        width = row_width(self.head_size, key_cache.dtype)
        key_flat = key_cache.view(-1, self.num_kv_heads, width)
        value_flat = value_cache.view(-1, self.num_kv_heads, width)
        slot_mapping = attn_metadata.slot_mapping.long()
        scales = self._cache_scales(key_cache.dtype)
        if not fused.write_kv(key, value, key_flat, value_flat, slot_mapping, scales):
            _write_rows(key_flat, slot_mapping, quantize_rows(key, key_flat.dtype, scales[0]))
            _write_rows(value_flat, slot_mapping, quantize_rows(value, value_flat.dtype, scales[1]))

        num_tokens = query.shape[0]
        # Outputs and log-sum-exps per [row, KV head, query of its group].
        out = query.new_empty(num_tokens, self.num_kv_heads, self.group, self.head_size)
        lse = torch.empty(num_tokens, self.num_kv_heads, self.group)
        if plan.decode_rows is not None:
            self._decode(query, key_flat, value_flat, scales, plan, out, lse)
        for chunk in plan.prefills:
            self._prefill(query, key, value, key_flat, value_flat, scales, chunk, out, lse)
        if plan.native_prefill is not None:
            self._prefill_in_place(query, key_flat, value_flat, scales, plan, out, lse)
        if plan.prefix is not None:
            out = self._merge_shared_prefix(query, key_flat, value_flat, scales, plan, out, lse)
        return out.reshape(num_tokens, self.num_heads, self.head_size)

    def _cache_scales(self, kv_dtype: torch.dtype) -> torch.Tensor:
        """The rows k_scale and v_scale ``[2, num_kv_heads]`` over a cache of ``kv_dtype``: the layer's for an fp8
        cache, else 1 (as vLLM sets them where the cache is not quantized)."""
        return self.kv_scales if is_fp8(kv_dtype) else unit_kv_scales(self.num_kv_heads)

    def _native_decode(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        return dtype == torch.float32 and self.native_decode_sizes and native.paged_decode(kv_dtype) is not None

    def _native_prefill(self, dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
        return dtype == torch.float32 and self.native_prefill_sizes and native.paged_prefill(kv_dtype) is not None

    def _prefill_in_place(self, query, key_flat, value_flat, scales, plan: AttentionPlan, out, lse) -> None:
        """Every prefill chunk in one native call that reads its context through the block table (tiles of
        query tokens x heads share each K/V load): no gathered copies, no repeated K/V heads, the query rows read
        in place."""
        chunks = plan.native_prefill
        native.paged_prefill(key_flat.dtype)(
            self._rows_as_read(query), key_flat, value_flat, chunks.block_table, chunks.query_start, chunks.query_len,
            chunks.seq_len, out, lse, start_pos=plan.prefix.num_tokens if plan.prefix else 0,
            block_size=plan.block_size, scale=self.scale, sliding_window=self.sliding_window,
            logits_soft_cap=self.logits_soft_cap, kv_scales=scales)

    def _attend(self, q, k, v, attn_mask=None, is_causal=False) -> tuple[torch.Tensor, torch.Tensor]:
        """The torch paths' attention with its log-sum-exp: torch's flash kernel, or under a soft cap plain ops."""
        if self.logits_soft_cap is None:
            return _flash_with_lse(q, k, v, is_causal=is_causal, attn_mask=attn_mask, scale=self.scale)
        return _soft_capped_with_lse(q, k, v, attn_mask, is_causal, self.scale, self.logits_soft_cap)

    def _rows_as_read(self, query: torch.Tensor) -> torch.Tensor:
        """The query rows as the kernels taking a row stride read them: in place when each row's heads are
        contiguous (a view of the QKV output), else a copy."""
        return query if query.stride(2) == 1 and query.stride(1) == self.head_size else query.contiguous()

    def _decode(self, query, key_flat, value_flat, scales, plan: AttentionPlan, out, lse) -> None:
        if plan.decode_block_table is not None:
            self._decode_in_place(query, key_flat, value_flat, scales, plan, out, lse)
        else:
            self._decode_gathered(query, key_flat, value_flat, scales, plan, out, lse)

    def _decode_in_place(self, query, key_flat, value_flat, scales, plan: AttentionPlan, out, lse) -> None:
        """The native kernel walks each request's block table: no history is copied. Where the decode rows
        lead the batch it reads them and writes their results in place."""
        num_reqs = plan.decode_rows.shape[0]
        if plan.decodes_lead:  # the query rows in place (a view of the QKV output), results straight into out
            q, out_rows, lse_rows = self._rows_as_read(query[:num_reqs]), out[:num_reqs], lse[:num_reqs]
        else:
            q = query.index_select(0, plan.decode_rows)
            out_rows, lse_rows = torch.empty_like(q), torch.empty(num_reqs, self.num_heads)
        native.paged_decode(key_flat.dtype)(
            q, key_flat, value_flat, plan.decode_block_table, plan.decode_seq_lens, out_rows, lse_rows,
            start_pos=plan.prefix.num_tokens if plan.prefix else 0, block_size=plan.block_size, scale=self.scale,
            sliding_window=self.sliding_window, logits_soft_cap=self.logits_soft_cap, kv_scales=scales)
        if not plan.decodes_lead:
            out.view(-1, self.num_heads, self.head_size).index_copy_(0, plan.decode_rows, out_rows)
            lse.view(-1, self.num_heads).index_copy_(0, plan.decode_rows, lse_rows)

    def _decode_gathered(self, query, key_flat, value_flat, scales, plan: AttentionPlan, out, lse) -> None:
        """One call for all decode rows: [Bd, KVH, group, D] queries against [Bd, KVH, S, D] histories, each
        KV head's query group folded into the query-length axis (no K/V repetition for grouped queries)."""
        num_reqs = plan.decode_rows.shape[0]
        q = query.index_select(0, plan.decode_rows).view(num_reqs, self.num_kv_heads, -1, self.head_size)
        shape = (num_reqs, plan.decode_seq_len, self.num_kv_heads, self.head_size)
        k, v = (self._widen(cache.index_select(0, plan.decode_slots), query.dtype, scale).view(shape).transpose(1, 2)
                for cache, scale in ((key_flat, scales[0]), (value_flat, scales[1])))
        out_rows, lse_rows = self._attend(q, k, v, attn_mask=plan.decode_mask)
        out.index_copy_(0, plan.decode_rows, out_rows)
        lse.index_copy_(0, plan.decode_rows, lse_rows)

    def _widen(self, rows: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor) -> torch.Tensor:
        """Cache rows ``[..., num_kv_heads, row_width]`` as ``dtype`` values ``[..., head_size]`` (times an fp8
        cache's scales, ``[num_kv_heads]``)."""
        return dequantize_rows(rows, self.head_size, dtype, scale)

    def _prefill(self, query, key, value, key_flat, value_flat, scales, chunk: PrefillChunk, out, lse) -> None:
        """One call per chunk. K/V heads are repeated for grouped queries: SDPA's own enable_gqa falls back to
        the unfused math kernel on CPU, several times slower than the flash kernel on long prompts."""
        q = query[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)
        if chunk.slots is None:  # as the cache holds them (rounded or quantized), in the queries' dtype
            k = quantize_rows(key[chunk.start : chunk.end], key_flat.dtype, scales[0])
            v = quantize_rows(value[chunk.start : chunk.end], value_flat.dtype, scales[1])
        else:
            k, v = key_flat.index_select(0, chunk.slots), value_flat.index_select(0, chunk.slots)
        k, v = (self._widen(x, query.dtype, scale) for x, scale in zip((k, v), scales))
        if self.group > 1:
            k, v = k.repeat_interleave(self.group, dim=1), v.repeat_interleave(self.group, dim=1)
        out_rows, lse_rows = self._attend(q, k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
                                          attn_mask=chunk.mask, is_causal=chunk.mask is None)
        rows = (-1, self.num_kv_heads, self.group)
        out[chunk.start : chunk.end] = out_rows[0].transpose(0, 1).view(*rows, self.head_size)
        lse[chunk.start : chunk.end] = lse_rows[0].transpose(0, 1).view(*rows)

    def _merge_shared_prefix(self, query, key_flat, value_flat, scales, plan: AttentionPlan, out_rest, lse_rest):
        """Cascade attention: every row against the shared prefix in one call, merged with the attention over
        the rest of its request's history by the two partial softmaxes' log-sum-exps."""
        if plan.native_prefix:
            return self._merge_shared_prefix_native(query, key_flat, value_flat, scales, plan, out_rest, lse_rest)
        num_tokens = query.shape[0]
        prefix = plan.prefix
        if prefix.slots is None:
            k_prefix = key_flat[prefix.start_slot : prefix.start_slot + prefix.num_tokens]
            v_prefix = value_flat[prefix.start_slot : prefix.start_slot + prefix.num_tokens]
        else:
            k_prefix, v_prefix = key_flat.index_select(0, prefix.slots), value_flat.index_select(0, prefix.slots)
        k_prefix, v_prefix = (self._widen(x, query.dtype, scale) for x, scale in zip((k_prefix, v_prefix), scales))
        # All rows' query groups folded into one query axis per KV head: [1, KVH, T * group, D].
        q = query.view(num_tokens, self.num_kv_heads, self.group, self.head_size).transpose(0, 1)
        out_prefix, lse_prefix = self._attend(
            q.reshape(1, self.num_kv_heads, num_tokens * self.group, self.head_size),
            k_prefix.transpose(0, 1).unsqueeze(0), v_prefix.transpose(0, 1).unsqueeze(0))
        out_prefix = out_prefix.view(self.num_kv_heads, num_tokens, self.group, self.head_size).transpose(0, 1)
        lse_prefix = lse_prefix.view(self.num_kv_heads, num_tokens, self.group).transpose(0, 1)

        lse_max = torch.maximum(lse_prefix, lse_rest)
        w_prefix = (lse_prefix - lse_max).exp_()
        w_rest = (lse_rest - lse_max).exp_()
        total = w_prefix + w_rest
        merged = (out_prefix.float() * (w_prefix / total).unsqueeze(-1)
                  + out_rest.float() * (w_rest / total).unsqueeze(-1))
        return merged.to(query.dtype)

    def _merge_shared_prefix_native(self, query, key_flat, value_flat, scales, plan: AttentionPlan, out_rest,
                                    lse_rest):
        """The same in C: the prefill tiles over all rows against the prefix's blocks, read in place, then the
        merge. In a decode batch the whole step stays native calls, so a CPU graph can replay it."""
        q = self._rows_as_read(query)
        prefix_attention, merge = native.cascade(key_flat.dtype)
        out_prefix, lse_prefix = torch.empty_like(out_rest), torch.empty_like(lse_rest)
        prefix_attention(q, key_flat, value_flat, plan.prefix.block_ids, plan.prefix.num_tokens, out_prefix, lse_prefix,
                         block_size=plan.block_size, scale=self.scale, logits_soft_cap=self.logits_soft_cap,
                         kv_scales=scales)
        merged = torch.empty_like(out_rest)
        merge(merged, out_prefix, lse_prefix, out_rest, lse_rest)
        return merged


class TorchSDPABackend(AttentionBackend):
    @staticmethod
    def get_name() -> str:
        return "TORCH_SDPA"

    @staticmethod
    def get_impl_cls() -> type[AttentionImpl]:
        return TorchSDPABackendImpl
