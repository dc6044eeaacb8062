"""The CPU paged-attention backend against plain causal attention over each
request's contiguous K/V; every case runs with the native kernels (decode and prefill) and with the torch path."""

import random
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedllm import native
from pagedllm.native import fused
from pagedllm.kv_cache_dtype import dequantize_rows, quantize_rows, row_width
from pagedllm.layers.attention import AttentionMetadata, allocate_kv_caches, cpu_plan, get_attn_backend
from pagedllm.layers.attention.layer import Attention
from tests.attention_reference import reference_attention
from tests.native_paths import LESSER_BUILDS, skip_lesser_build_that_is_native

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 3e-2}
# A one-byte cache's element is worth code x its row's scale: the kernels multiply a row's dot product (or softmax
# weight) by the scale once, the reference each element first, a float32 rounding apart.
QUANTIZED_TOLERANCE = 1e-4
# Rows the prefill tiles attend in bf16 pairs (native.paged_prefill_pairs) have their queries and softmax weights
# rounded to bf16 (and a one-byte cache's values, to bf16 as they widen). The reference rounds the queries and
# values too; the weights' rounding (up to 2^-9 of each) moves an output by up to ~2^-9 of the values it averages,
# which reach ~4 here: this bound.
PAIRED_TOLERANCE = 1e-2


@pytest.fixture(autouse=True, params=["native", "avx2", "portable", "torch"])
def decode_path(request, monkeypatch):
    """Rows in float32 go to the native kernels when they build ("native": the CPU's best bodies, AVX-512 where it
    has it; "avx2": the decode kernel's and the prefill tiles' AVX2 bodies where the CPU has AVX2, and "portable":
    the decode kernel's plain C body, with prefill on the torch path); "torch" forces the gather path and the
    torch write of K/V into the cache (PAGEDLLM_NATIVE_KERNELS=0's)."""
    if request.param == "torch":
        monkeypatch.setattr(native, "paged_decode", lambda kv_dtype=torch.float32: None)
        monkeypatch.setattr(native, "paged_prefill", lambda kv_dtype=torch.float32: None)
        monkeypatch.setattr(fused, "write_kv", lambda *cache_and_rows: False)
    elif request.param in LESSER_BUILDS:
        skip_lesser_build_that_is_native(request.param)
        flags = LESSER_BUILDS[request.param]
        # each cache dtype's lesser build made when a case first asks for it
        decode, prefill = native.paged_decode, native.paged_prefill
        monkeypatch.setattr(native, "paged_decode", lambda kv_dtype=torch.float32: decode(kv_dtype, flags))
        monkeypatch.setattr(native, "paged_prefill", lambda kv_dtype=torch.float32: prefill(kv_dtype, flags))
        assert (prefill(torch.float32, flags) is None) == (request.param == "portable")
    return request.param


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler: the torch path is the only one")
def test_native_kernel_builds_where_a_compiler_exists(decode_path):
    assert (native.paged_decode() is not None) == (decode_path != "torch")


def test_native_kernel_build_failure_falls_back(monkeypatch, tmp_path):
    monkeypatch.setenv("PAGEDLLM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler")
    assert native._build("paged_attention") is None
    monkeypatch.setenv("CC", "false")  # exists, always fails
    assert native._build("paged_attention") is None
    assert not list(tmp_path.rglob("*.so"))


def _run_case(requests, heads, kv_heads, head_dim, block_size, dtype, seed, shared_blocks=0, consecutive=False,
              kv_dtype=None, sliding_window=None, logits_soft_cap=None, kv_scales=(1.0, 1.0)):
    """requests: list of (num_cached, num_new). Cached K/V is written to the cache
    beforehand; never-written cache memory is NaN and must not leak into the output.
    The first ``shared_blocks`` blocks (ids and K/V) are common to all requests, as
    prefix caching leaves them; ``consecutive`` allocates block ids in order. ``kv_dtype`` is the cache's dtype
    (default ``dtype``): a bf16 cache under float32 queries holds the keys rounded, and attention must see
    exactly those, so the reference takes them rounded too. ``sliding_window`` and ``logits_soft_cap``: the layer's,
    also the reference's; ``kv_scales``: the layer's (k_scale, v_scale), floats or ``[kv_heads]`` each (per KV head),
    which an fp8 cache's rows are divided by as they are written and multiplied by as they are read (the
    reference's too). Returns the step's attention plan."""
    kv_dtype = kv_dtype or dtype
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_needed = [-(-(c + n) // block_size) for c, n in requests]
    num_blocks = sum(blocks_needed) + 3
    width = row_width(head_dim, kv_dtype)
    # NaN everywhere (in an int8 cache, all bytes 0xff: each row's scale a NaN)
    key_cache, value_cache = (torch.full((num_blocks, block_size, kv_heads, width),
                                         -1 if kv_dtype == torch.int8 else float("nan"), dtype=kv_dtype)
                              for _ in range(2))
    free = list(range(num_blocks))[::-1]
    if not consecutive:
        rng.shuffle(free)
    shared_ids = [free.pop() for _ in range(shared_blocks)]
    block_ids = [shared_ids + [free.pop() for _ in range(n - shared_blocks)] for n in blocks_needed]
    shared_k = torch.randn(shared_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    shared_v = torch.randn(shared_blocks * block_size, kv_heads, head_dim, generator=gen).to(dtype)
    table_width = max(blocks_needed) + 2
    block_table = torch.tensor([ids + [rng.randrange(num_blocks)] * (table_width - len(ids)) for ids in block_ids],
                               dtype=torch.int32)

    def slot(i, pos):
        return block_ids[i][pos // block_size] * block_size + pos % block_size

    full_k, full_v, qs, slots, qsl = [], [], [], [], [0]
    for i, (cached, new) in enumerate(requests):
        k = torch.randn(cached + new, kv_heads, head_dim, generator=gen).to(dtype)
        v = torch.randn(cached + new, kv_heads, head_dim, generator=gen).to(dtype)
        k[: len(shared_k)], v[: len(shared_v)] = shared_k, shared_v
        for pos in range(cached):
            key_cache.view(-1, kv_heads, width)[slot(i, pos)] = quantize_rows(k[pos], kv_dtype, kv_scales[0])
            value_cache.view(-1, kv_heads, width)[slot(i, pos)] = quantize_rows(v[pos], kv_dtype, kv_scales[1])
        full_k.append(k)
        full_v.append(v)
        qs.append(torch.randn(new, heads, head_dim, generator=gen).to(dtype))
        slots += [slot(i, pos) for pos in range(cached, cached + new)]
        qsl.append(qsl[-1] + new)

    seq_lens = [c + n for c, n in requests]
    metadata = AttentionMetadata(
        num_actual_tokens=qsl[-1],
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.tensor(qsl),
        seq_lens=torch.tensor(seq_lens),
        block_table=block_table,
        max_query_len=max(n for _, n in requests),
        max_seq_len=max(seq_lens),
    )
    scale = head_dim**-0.5
    layer = Attention(heads, head_dim, scale, kv_heads, sliding_window=sliding_window, logits_soft_cap=logits_soft_cap)
    layer.set_kv_cache_scales(*kv_scales)
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, requests)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, requests)])
    with torch.inference_mode():
        out = layer(torch.cat(qs).flatten(1), new_k.flatten(1), new_v.flatten(1), (key_cache, value_cache), metadata)
    assert out.dtype == dtype and out.shape == (qsl[-1], heads * head_dim)

    # This step's K/V landed in the cache, as the torch path quantizes them (byte for byte where one byte each).
    for cache, new, kv_scale in ((key_cache, new_k, kv_scales[0]), (value_cache, new_v, kv_scales[1])):
        written = cache.view(-1, kv_heads, width)[metadata.slot_mapping]
        expected_rows = quantize_rows(new, kv_dtype, kv_scale)
        if kv_dtype.itemsize == 1:
            written, expected_rows = written.view(torch.uint8), expected_rows.view(torch.uint8)
        assert torch.equal(written, expected_rows)
    plan = metadata.backend_cache["torch_sdpa", sliding_window]
    paired = [native.paged_prefill_pairs(kv_dtype) and (
        plan.native_prefix or (plan.native_prefill is not None and new > 1)) for _, new in requests]
    for i, (q, k, v) in enumerate(zip(qs, full_k, full_v)):
        rows = out[qsl[i]:qsl[i + 1]].float().view_as(q)
        k, v = (dequantize_rows(quantize_rows(x, kv_dtype, kv_scale), head_dim, torch.float32, kv_scale)
                for x, kv_scale in zip((k, v), kv_scales))  # as cached
        if paired[i]:  # the tiles' operands: the queries and a one-byte row's widened values in bf16
            k, v = (x.to(torch.bfloat16) for x in (k, v))
            expected = reference_attention(q.to(torch.bfloat16), k, v, scale, sliding_window, logits_soft_cap)
            torch.testing.assert_close(rows, expected, atol=PAIRED_TOLERANCE, rtol=PAIRED_TOLERANCE)
        else:
            expected = reference_attention(q, k, v, scale, sliding_window, logits_soft_cap)
            tolerance = TOLERANCE[dtype] if kv_dtype.itemsize > 1 else QUANTIZED_TOLERANCE
            torch.testing.assert_close(rows, expected, atol=tolerance, rtol=tolerance)
    return plan


MIXED = [(0, 7), (5, 1), (30, 1), (17, 9), (0, 1), (12, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2), (8, 1)])
def test_mixed_batch(dtype, heads, kv_heads):
    _run_case(MIXED, heads, kv_heads, 16, block_size=4, dtype=dtype, seed=heads + kv_heads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_only_equal_lengths(dtype):
    _run_case([(9, 1), (9, 1), (9, 1)], 4, 2, 8, block_size=4, dtype=dtype, seed=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_only(dtype):
    _run_case([(0, 20), (0, 3), (8, 8)], 4, 2, 32, block_size=16, dtype=dtype, seed=2)


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (9, 3), (16, 1), (10, 2)])
@pytest.mark.parametrize("block_size", [1, 16, 32])
def test_prefill_tiles(decode_path, head_dim, heads, kv_heads, block_size):
    """Prompts over several tiles (32 / group tokens each), chunks after cached context, and decode rows."""
    requests = [(0, 37), (21, 19), (5, 1), (40, 2), (0, 1), (3, 16)]
    plan = _run_case(requests, heads, kv_heads, head_dim, block_size, torch.float32, seed=head_dim + heads)
    assert (plan.native_prefill is not None) == (native.paged_prefill() is not None)
    assert plan.prefills == [] or plan.native_prefill is None


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (8, 4), (4, 1)])
def test_head_size_256(decode_path, heads, kv_heads):
    """The Gemmas' head size: the vector decode bodies for groups 1, 2 and 4, and the prefill tiles."""
    requests = [(0, 37), (21, 19), (5, 1), (40, 2), (0, 1)]
    plan = _run_case(requests, heads, kv_heads, 256, 16, torch.float32, seed=heads + kv_heads)
    assert (plan.native_prefill is not None) == (native.paged_prefill() is not None)


def test_prefill_tiles_after_a_shared_prefix(low_cascade_threshold, decode_path):
    plan = _run_case([(12, 1), (13, 6), (20, 17), (12, 5)], 9, 3, 64, 4, torch.float32, seed=7, shared_blocks=3)
    assert plan.prefix is not None and plan.prefix.num_tokens == 12
    # The prefix itself goes to the native kernel where the prefill tiles do, read in place from its blocks.
    assert plan.native_prefix == (plan.native_prefill is not None)


@pytest.mark.parametrize("consecutive", [True, False])
def test_decode_rows_after_a_shared_prefix_on_the_native_prefix_kernel(low_cascade_threshold, decode_path,
                                                                       consecutive):
    requests = [(12 + 3 * i, 1) for i in range(11)]  # 11 rows x 3 heads: several 32-lane tiles
    plan = _run_case(requests, 9, 3, 64, 4, torch.float32, seed=11, shared_blocks=3, consecutive=consecutive)
    assert plan.prefix is not None and plan.decodes_lead
    assert plan.native_prefix == (native.paged_prefill() is not None)


@settings(max_examples=30, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 80), st.integers(1, 12)), min_size=1, max_size=6),
    kv_heads=st.sampled_from([1, 2, 4]),
    group=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([8, 64]),  # 64: the vector body (16-slot runs, split inside 32-slot blocks)
    block_size=st.sampled_from([1, 4, 16, 32]),
    seed=st.integers(0, 2**16),
)
def test_random_batches(requests, kv_heads, group, head_dim, block_size, seed):
    _run_case(requests, kv_heads * group, kv_heads, head_dim, block_size, torch.float32, seed)


@pytest.mark.parametrize("head_dim,block_size", [(8, 4), (64, 16), (128, 1), (256, 4)])
def test_bf16_cache_under_float32_queries(decode_path, head_dim, block_size):
    """A bfloat16 model with float32 activations: the kernels widen the bf16 cache as they read it (every
    decode body, the prefill tiles), the torch path widens what it gathers; float32 results either way."""
    requests = [(0, 37), (21, 19), (5, 1), (40, 2), (0, 1), (3, 16), (70, 1)]
    plan = _run_case(requests, 9, 3, head_dim, block_size, torch.float32, seed=head_dim, kv_dtype=torch.bfloat16)
    native_prefill = native.paged_prefill(torch.bfloat16) is not None
    assert (plan.native_prefill is not None) == (native_prefill and head_dim in (64, 128, 256))


@pytest.mark.parametrize("consecutive", [True, False])
def test_bf16_cache_after_a_shared_prefix(low_cascade_threshold, decode_path, consecutive):
    requests = [(12 + 3 * i, 1) for i in range(11)] + [(13, 6)]
    plan = _run_case(requests, 9, 3, 64, 4, torch.float32, seed=5, shared_blocks=3, consecutive=consecutive,
                     kv_dtype=torch.bfloat16)
    assert plan.prefix is not None
    assert plan.native_prefix == (native.paged_prefill(torch.bfloat16) is not None)


@pytest.fixture
def low_cascade_threshold(monkeypatch):
    monkeypatch.setattr(cpu_plan, "CASCADE_MIN_PREFIX_TOKENS", 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("consecutive", [True, False])
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)])
def test_shared_prefix_is_attended_once(low_cascade_threshold, dtype, consecutive, heads, kv_heads):
    """Decode rows and prefill chunks after a 3-block common prefix: cascade attention, same result."""
    requests = [(12, 1), (13, 1), (20, 1), (12, 5), (17, 3)]
    plan = _run_case(requests, heads, kv_heads, 16, 4, dtype, seed=heads, shared_blocks=3, consecutive=consecutive)
    assert plan.prefix is not None and plan.prefix.num_tokens == 12
    assert (plan.prefix.slots is None) == consecutive


def test_no_cascade_when_a_query_is_inside_the_prefix(low_cascade_threshold):
    # The last request computes tokens 4.. of the shared blocks itself: only the first block is before
    # every query, which is below the threshold of 8 tokens.
    plan = _run_case([(12, 1), (12, 1), (4, 9)], 4, 2, 8, 4, torch.float32, seed=3, shared_blocks=3)
    assert plan.prefix is None


def test_cascade_threshold(low_cascade_threshold):
    plan = _run_case([(7, 1), (9, 1)], 4, 2, 8, 4, torch.float32, seed=4, shared_blocks=1)
    assert plan.prefix is None  # 4 shared tokens < 8
    plan = _run_case([(9, 1), (9, 1)], 4, 2, 8, 4, torch.float32, seed=4, shared_blocks=2)
    assert plan.prefix is not None and plan.prefix.num_tokens == 8


@settings(max_examples=30, deadline=None)
@given(
    requests=st.lists(st.tuples(st.integers(0, 30), st.integers(1, 9)), min_size=2, max_size=6),
    shared_blocks=st.integers(1, 3),
    kv_heads=st.sampled_from([1, 2]),
    group=st.sampled_from([1, 3]),
    head_dim=st.sampled_from([8, 64]),  # 64: the prefix on the native kernel too
    consecutive=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_random_batches_with_shared_prefix(requests, shared_blocks, kv_heads, group, head_dim, consecutive, seed):
    block_size = 4
    # Every request holds the shared blocks (cached, or partly computed in this step).
    requests = [(max(c, shared_blocks * block_size - n + 1), n) for c, n in requests]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cpu_plan, "CASCADE_MIN_PREFIX_TOKENS", 4)
        _run_case(requests, kv_heads * group, kv_heads, head_dim, block_size, torch.float32, seed, shared_blocks,
                  consecutive)


# Decode rows and prefill chunks (whole prompts, chunks after cached context, over several 32-lane tiles) whose
# histories are shorter than, as long as, and longer than the windows below, windows ending inside blocks.
WINDOW_REQUESTS = [(0, 37), (21, 19), (5, 1), (40, 2), (0, 1), (3, 16), (7, 1), (70, 1), (0, 8)]


@pytest.mark.parametrize("sliding_window", [1, 5, 8, 16, 37, 100])
@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (4, 2, 128), (6, 2, 8)])
def test_sliding_window(decode_path, sliding_window, block_size, heads, kv_heads, head_dim):
    """Every path (the decode kernel's bodies, the prefill tiles where head sizes 64, 128 and 256 take them, the torch
    path's batched decode and per-chunk prefill) attends only each query's window."""
    plan = _run_case(WINDOW_REQUESTS, heads, kv_heads, head_dim, block_size, torch.float32, seed=sliding_window,
                     sliding_window=sliding_window)
    native_prefill = native.paged_prefill() is not None and head_dim in (64, 128, 256)
    assert (plan.native_prefill is not None) == native_prefill


@pytest.mark.parametrize("sliding_window", [3, 12, 40])
def test_sliding_window_bf16_cache(decode_path, sliding_window):
    _run_case(WINDOW_REQUESTS, 9, 3, 64, 4, torch.float32, seed=3, kv_dtype=torch.bfloat16,
              sliding_window=sliding_window)


@pytest.mark.parametrize("sliding_window", [5, 12, 13, 30])
def test_sliding_window_takes_no_shared_prefix(low_cascade_threshold, decode_path, sliding_window):
    """Requests sharing a 3-block prefix, which the layer without a window attends once (cascade): a windowed
    layer, whose rows' windows start inside the prefix or past it, attends each request's own window instead."""
    requests = [(12 + 3 * i, 1) for i in range(6)] + [(13, 6), (20, 17)]
    plan = _run_case(requests, 9, 3, 64, 4, torch.float32, seed=sliding_window, shared_blocks=3,
                     sliding_window=sliding_window)
    assert plan.prefix is None
    assert _run_case(requests, 9, 3, 64, 4, torch.float32, seed=1, shared_blocks=3).prefix is not None


# Scores here are about N(0, 1) (unit queries and keys, scale head_dim ** -0.5) and reach ~4: caps of 1 and 3 bend
# most of them and the largest, and a row's capped scores give another softmax than its uncapped ones.
@pytest.mark.parametrize("logits_soft_cap", [1.0, 3.0])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(4, 4, 64), (9, 3, 64), (4, 2, 128), (6, 2, 8), (8, 1, 16),
                                                     (8, 4, 256)])
def test_logit_soft_cap(decode_path, logits_soft_cap, heads, kv_heads, head_dim):
    """Every path (the decode kernel's bodies, the prefill tiles where head sizes 64, 128 and 256 take them, the torch
    path's batched decode and per-chunk prefill in plain ops) caps the scores before the softmax."""
    plan = _run_case(WINDOW_REQUESTS, heads, kv_heads, head_dim, 4, torch.float32, seed=heads,
                     logits_soft_cap=logits_soft_cap)
    native_prefill = native.paged_prefill() is not None and head_dim in (64, 128, 256)
    assert (plan.native_prefill is not None) == native_prefill


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_logit_soft_cap_under_a_window_and_a_shared_prefix(low_cascade_threshold, decode_path, kv_dtype):
    """Capped scores under a sliding window, and in cascade attention: the shared prefix (the native prefix kernel
    where the prefill tiles build, else torch's plain ops) and the rest, merged by their capped log-sum-exps."""
    requests = [(12 + 3 * i, 1) for i in range(6)] + [(13, 6), (20, 17)]
    _run_case(WINDOW_REQUESTS, 9, 3, 64, 4, torch.float32, seed=2, kv_dtype=kv_dtype, sliding_window=12,
              logits_soft_cap=2.0)
    plan = _run_case(requests, 9, 3, 64, 4, torch.float32, seed=3, shared_blocks=3, kv_dtype=kv_dtype,
                     logits_soft_cap=2.0)
    assert plan.prefix is not None
    assert plan.native_prefix == (native.paged_prefill(kv_dtype) is not None)


def test_kv_cache_allocation():
    backend = get_attn_backend()
    assert backend.get_name() == "TORCH_SDPA"
    assert backend.get_kv_cache_shape(10, 16, 3, 64) == (10, 16, 3, 64)
    caches = allocate_kv_caches(2, 10, 16, 3, 64, torch.bfloat16)
    assert len(caches) == 2 and caches[0][0] is not caches[0][1] and caches[0][0] is not caches[1][0]
    for key_cache, value_cache in caches:
        assert key_cache.shape == value_cache.shape == (10, 16, 3, 64)
        assert key_cache.dtype == torch.bfloat16 and not key_cache.any()


QUANTIZED = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)  # the one-byte kv_cache_dtypes


@pytest.fixture
def quantized_path(decode_path, kv_dtype):
    """The one-byte caches on the native path and the torch path; the lesser decode bodies only for the caches
    whose widening they do differently (e4m3's and int8's; each lesser build costs the suite a compile)."""
    if decode_path == "portable" and kv_dtype != torch.int8 or decode_path == "avx2" and kv_dtype == torch.float8_e5m2:
        pytest.skip("covered by the other caches' lesser builds")
    return decode_path


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_quantized_cache(quantized_path, kv_dtype):
    """fp8 and int8 caches (kv_cache_dtype): every kernel reads exactly the values the write quantized (the
    reference attends to the dequantized rows), on decode rows, prefill tiles and windows, NaN never leaking."""
    requests = [(0, 37), (21, 19), (5, 1), (40, 2), (0, 1), (3, 16), (70, 1)]
    plan = _run_case(requests, 9, 3, 64, 16, torch.float32, seed=7, kv_dtype=kv_dtype)
    assert (plan.native_prefill is not None) == (native.paged_prefill(kv_dtype) is not None)
    _run_case(requests, 8, 2, 128, 4, torch.float32, seed=8, kv_dtype=kv_dtype, sliding_window=13)


@pytest.mark.parametrize("kv_dtype", QUANTIZED)
def test_quantized_cache_after_a_shared_prefix(low_cascade_threshold, quantized_path, kv_dtype):
    requests = [(12 + 3 * i, 1) for i in range(11)] + [(13, 6)]
    plan = _run_case(requests, 9, 3, 64, 4, torch.float32, seed=5, shared_blocks=3, kv_dtype=kv_dtype)
    assert plan.native_prefix == (native.paged_prefill(kv_dtype) is not None)


@pytest.mark.parametrize("kv_dtype", [*QUANTIZED, torch.bfloat16])
def test_fp8_cache_scales(low_cascade_threshold, quantized_path, kv_dtype):
    """A layer's k_scale and v_scale (a checkpoint's, vLLM's per-tensor fp8 scales): an fp8 cache holds k / k_scale
    and v / v_scale, byte for byte as the torch path writes them, and every path reads them back times the scales
    (decode rows, split over two threads too; prefill tiles; a window; a shared prefix), where a kernel reading the
    bytes unscaled gives 4x the scores and 1/20 of the values. Caches other than fp8 take no scale (vLLM's 1): int8
    rows carry their own."""
    kv_scales = (4.0, 0.05)
    requests = [(0, 37), (21, 19), (5, 1), (40, 2), (0, 1), (3, 16), (70, 1)]
    _run_case(requests, 9, 3, 64, 16, torch.float32, seed=7, kv_dtype=kv_dtype, kv_scales=kv_scales)
    _run_case(requests, 8, 2, 128, 4, torch.float32, seed=8, kv_dtype=kv_dtype, sliding_window=13, kv_scales=kv_scales)
    plan = _run_case([(12 + 3 * i, 1) for i in range(11)] + [(13, 6)], 9, 3, 64, 4, torch.float32, seed=5,
                     shared_blocks=3, kv_dtype=kv_dtype, kv_scales=kv_scales)
    assert plan.prefix is not None
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _run_case([(700, 1)], 9, 3, 64, 16, torch.float32, seed=1, kv_dtype=kv_dtype, kv_scales=kv_scales)
    finally:
        torch.set_num_threads(threads)


def test_fp8_cache_per_head_scales(low_cascade_threshold, decode_path):
    """Per-KV-head k_scale and v_scale (vLLM's under a kv_cache_scheme of strategy "attn_head"): each KV head's rows
    are cached divided by its own scales, byte for byte as the torch path writes them, and every path (each decode
    body, the prefill tiles, a window, a shared prefix) reads each head's back times its own, where one head's scales
    applied to another's rows put its scores and values off by up to 80x."""
    kv_dtype, kv_scales = torch.float8_e4m3fn, torch.tensor([[4.0, 0.5, 0.05], [0.05, 2.0, 0.5]])
    _run_case([(0, 37), (21, 19), (5, 1), (40, 2), (0, 1), (3, 16), (70, 1)], 9, 3, 64, 16, torch.float32, seed=7,
              kv_dtype=kv_dtype, sliding_window=29, kv_scales=kv_scales)
    plan = _run_case([(12 + 3 * i, 1) for i in range(11)] + [(13, 6)], 9, 3, 64, 4, torch.float32, seed=5,
                     shared_blocks=3, kv_dtype=kv_dtype, kv_scales=kv_scales)
    assert plan.prefix is not None



@pytest.mark.parametrize("requests", [[(700, 1)], [(300, 1), (520, 1)]])
@pytest.mark.parametrize("kv_dtype, sliding_window", [(torch.float32, None), (torch.float32, 200),
                                                      (torch.bfloat16, None), (torch.int8, None)])
def test_long_decode_rows_split_over_threads(monkeypatch, requests, kv_dtype, sliding_window):
    """One or two requests of 3 KV heads are too few items for 2 threads: the decode kernel splits each history in
    shares of whole runs (the last of the shorter request's empty) and merges them by their log-sum-exps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        _run_case(requests, 9, 3, 64, block_size=16, dtype=torch.float32, seed=len(requests), kv_dtype=kv_dtype,
                  sliding_window=sliding_window)
    finally:
        torch.set_num_threads(threads)


def test_empty_batches_write_nothing(decode_path):
    """The kernels called for no requests return having written nothing, on two threads too (where the decode kernel
    splits histories over the threads by its number of items: zero items once divided it by zero)."""
    decode, prefill = native.paged_decode(), native.paged_prefill()
    if decode is None:
        pytest.skip("the torch path has no kernel to call")
    cache, table, lens = torch.zeros(32, 2, 64), torch.zeros(0, 2, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    q, out, lse = torch.zeros(3, 4, 64), torch.full((3, 4, 64), 7.0), torch.full((3, 4), 7.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        decode(q[:0], cache, cache, table, lens, out[:0], lse[:0], start_pos=0, block_size=16, scale=0.125)
        if prefill is not None:  # three query rows, but no chunk holds them
            prefill(q, cache, cache, table, lens, lens, lens, out, lse, start_pos=0, block_size=16, scale=0.125)
    finally:
        torch.set_num_threads(threads)
    assert bool((out == 7.0).all() and (lse == 7.0).all())


def _assert_same_nans(out, expected):
    """out equals expected, NaN exactly where it is NaN (a whole head's row)."""
    assert torch.equal(out.isnan().any(-1), expected.isnan().any(-1))
    torch.testing.assert_close(out, expected, atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32],
                               equal_nan=True)


def test_nans_reach_the_outputs_that_attend_to_them(decode_path):
    """A NaN in a query, or in a key or value a query sees, makes that query's head's output NaN, as torch's softmax
    does (a diverged model stays visibly diverged), where the vector bodies' exp once clamped a NaN score to a weight
    of exp(-87); every other output is the reference's, a NaN key outside a query's window or past it included."""
    decode, prefill = native.paged_decode(), native.paged_prefill()
    if decode is None:
        pytest.skip("the torch path has no kernel to call")
    gen, scale = torch.Generator().manual_seed(0), 64**-0.5
    k_cache, v_cache = torch.randn(2, 3 * 48, 2, 64, generator=gen)
    q = torch.randn(3, 4, 64, generator=gen)
    q[0, 0, 7] = k_cache[48 + 5, 1, 3] = v_cache[96 + 30, 0, 9] = float("nan")  # a query; request 1's key, 2's value
    table = torch.arange(9, dtype=torch.int32).view(3, 3)  # request r: slots 48 r .. 48 r + 47
    out, lse = torch.empty(3, 4, 64), torch.empty(3, 4)
    decode(q, k_cache, v_cache, table, torch.full((3,), 40, dtype=torch.int32), out, lse, start_pos=0, block_size=16,
           scale=scale)
    for r in range(3):
        history = slice(48 * r, 48 * r + 40)
        _assert_same_nans(out[r], reference_attention(q[r:r + 1], k_cache[history], v_cache[history], scale)[0])
    if prefill is None:
        return
    # request 1's last 20 positions, a window of 8: its NaN key (position 5) is seen by none, a NaN put at position
    # 25 by the queries at 25 .. 32 alone
    k_cache[48 + 25, 1, 0] = float("nan")
    q = torch.randn(20, 4, 64, generator=gen)
    q[3, 2, 0] = float("nan")
    out, lse = torch.empty(20, 4, 64), torch.empty(20, 4)
    one = torch.ones(1, dtype=torch.int32)
    prefill(q, k_cache, v_cache, table[1:2], 0 * one, 20 * one, 40 * one, out, lse, start_pos=0,
            block_size=16, scale=scale, sliding_window=8)
    expected = reference_attention(q, k_cache[48:88], v_cache[48:88], scale, sliding_window=8)
    _assert_same_nans(out, expected)
    assert out[5:13, 2:].isnan().all() and not out[13:, 2:].isnan().any()


@pytest.fixture
def vdpbf16ps_tiles(decode_path, monkeypatch, kv_dtype):
    """On a CPU with AMX, the bf16-pair prefill tiles and cascade prefix of the build without it (vdpbf16ps), so that
    the body the AMX one replaces stays checked here too; skipped elsewhere (there it is the native body)."""
    if decode_path != "native":
        pytest.skip("one build, checked once")
    skip_lesser_build_that_is_native("no_amx")
    flags = LESSER_BUILDS["no_amx"]
    assert not native.paged_attention(kv_dtype, flags).prefill_amx
    library = native.paged_attention
    monkeypatch.setattr(native, "paged_prefill", lambda kv_dtype=torch.float32: library(kv_dtype, flags).prefill)
    monkeypatch.setattr(native, "cascade", lambda kv_dtype=torch.float32: (library(kv_dtype, flags).prefix,
                                                                         library(kv_dtype, flags).merge))


def test_prefill_tiles_on_amx_where_the_os_allows():
    """The bf16-pair tiles multiply on AMX exactly where gemm_bf16 does (the CPU has it and the OS grants it)."""
    if native.gemm_bf16() is None:
        pytest.skip("no gemm_bf16 here to compare with (the CPU has no AVX512-BF16)")
    for kv_dtype in (torch.bfloat16, *QUANTIZED):
        library = native.paged_attention(kv_dtype)
        if library is not None and library.prefill_pairs:
            assert library.prefill_amx == native.gemm_bf16_uses_amx()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.int8])
def test_vdpbf16ps_tiles(low_cascade_threshold, vdpbf16ps_tiles, kv_dtype):
    """The vdpbf16ps body: groups of 3 (48 lanes) and 4 (32), head sizes 64, 128 and 256, short runs (blocks of
    4), a window, soft-capping and a shared prefix."""
    requests = [(0, 37), (21, 19), (5, 1), (40, 2), (0, 1), (3, 16), (70, 1)]
    _run_case(requests, 9, 3, 64, 16, torch.float32, seed=1, kv_dtype=kv_dtype)
    _run_case(requests, 8, 2, 128, 4, torch.float32, seed=2, kv_dtype=kv_dtype, sliding_window=13)
    _run_case(requests, 4, 1, 256, 16, torch.float32, seed=3, kv_dtype=kv_dtype, logits_soft_cap=2.0)
    plan = _run_case([(12 + 3 * i, 1) for i in range(6)] + [(13, 6), (20, 17)], 9, 3, 64, 4, torch.float32, seed=4,
                     shared_blocks=3, kv_dtype=kv_dtype)
    assert plan.native_prefix and plan.native_prefill is not None
