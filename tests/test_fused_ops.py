"""The native fused element-wise kernels (pagedllm/native/fused_ops.c) against the torch code they replace, on
small calls (one thread) and large ones (the parallel branch), and the cases where they must step aside."""

import shutil

import pytest
import torch
import torch.nn.functional as F

from pagedllm import native
from pagedllm.kv_cache_dtype import dequantize_rows, quantize_rows, row_width
from pagedllm.layers.layernorm import HeadRMSNorm
from pagedllm.layers.rotary import RotaryEmbedding
from pagedllm.native import fused

pytestmark = pytest.mark.skipif(shutil.which("cc") is None or native.fused_ops() is None,
                                reason="no C compiler: the torch path is the only one")

ROWS = [1, 7, 300]  # 300 rows cross PARALLEL_MIN_FLOATS for every kernel


def _close(actual, expected):
    torch.testing.assert_close(actual, expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(rows, with_residual):
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(2, rows, 200, generator=gen) * 3
    weight = torch.randn(200, generator=gen)
    result = fused.add_rms_norm(x, residual if with_residual else None, weight, 1e-2)
    summed = x + residual if with_residual else x
    expected = weight * (summed * torch.rsqrt(summed.pow(2).mean(-1, keepdim=True) + 1e-2))
    if with_residual:
        _close(result[0], expected)
        assert torch.equal(result[1], summed)
    else:
        _close(result, expected)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("kernel, reference, atol", [
    (fused.silu_and_mul, F.silu, 2e-6),
    # torch's 1 + tanh(y) rounds to 0 below y ~ -9, where g / (1 + exp(-2y)) keeps the tail (~1e-8 of g, times up)
    (fused.gelu_tanh_and_mul, lambda g: F.gelu(g, approximate="tanh"), 1e-5)])
def test_gated_activations_match_torch(rows, kernel, reference, atol):
    x = torch.randn(rows, 2 * 150, generator=torch.Generator().manual_seed(rows)) * 8  # exp far from 0 too
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(kernel(x), reference(gate) * up, rtol=2e-6, atol=atol)


@pytest.mark.parametrize("kernel, reference", [
    (fused.silu_and_mul, F.silu), (fused.gelu_tanh_and_mul, lambda g: F.gelu(g, approximate="tanh"))])
def test_gated_activations_of_extreme_gates_are_torchs(kernel, reference):
    """Gates far below -88 (whose exp(-g) overflows), infinite or NaN, times ups of every kind: NaN and infinite
    exactly where torch's are (silu(-inf) and 0 * inf are NaN), and -0 for a huge negative gate, not the gate times
    exp(-88) (-6e21 for a gate of -1e30 times an up of 1e30)."""
    special = torch.tensor([float("-inf"), -1e30, -1000.0, -100.0, -20.0, 0.0, 3.0, 1e30, float("inf"), float("nan")])
    gate, up = special.repeat_interleave(len(special)), special.repeat(len(special))
    torch.testing.assert_close(kernel(torch.cat([gate, up])[None]), (reference(gate) * up)[None], rtol=2e-6,
                               atol=1e-5, equal_nan=True)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("rotary_dim", [64, 32])
def test_rotary_in_place_matches_torch_on_a_strided_view(rows, rotary_dim):
    rope = RotaryEmbedding(64, rotary_dim, 10000.0, max_position=4000)
    positions = torch.randint(0, 4000, (rows,), generator=torch.Generator().manual_seed(rows))
    qkv = torch.randn(rows, 7 * 64)
    qk = qkv[:, : 5 * 64]  # 5 rotated heads, 2 untouched ones after them in each row
    cos, sin = rope._cos_sin(positions, torch.float32)
    expected = rope._rotate(qk, cos, sin)
    untouched = qkv[:, 5 * 64 :].clone()
    assert fused.rotary_neox_(qk, 5, 64, rotary_dim, positions, rope.cos_sin_cache)
    _close(qk, expected)
    assert torch.equal(qkv[:, 5 * 64 :], untouched)


@pytest.mark.parametrize("rows", ROWS)
def test_head_rms_norm_in_place_matches_torch_on_a_strided_view(rows):
    gen = torch.Generator().manual_seed(rows)
    qkv = torch.randn(rows, 7 * 64, generator=gen) * 3
    weight = torch.randn(64, generator=gen)
    k = qkv[:, 4 * 64 : 6 * 64]  # two heads in the middle of each row (Qwen3's k_norm on the QKV output)
    heads = k.reshape(rows, 2, 64)
    expected = weight * (heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + 1e-6))
    before, after = qkv[:, : 4 * 64].clone(), qkv[:, 6 * 64 :].clone()
    assert fused.head_rms_norm_(k, 2, 64, weight, 1e-6)
    _close(k.reshape(rows, 2, 64), expected)
    assert torch.equal(qkv[:, : 4 * 64], before) and torch.equal(qkv[:, 6 * 64 :], after)


def test_head_norm_layer_computes_the_same_without_the_kernel(monkeypatch):
    norm = HeadRMSNorm(64, eps=1e-6)
    norm.weight.data = torch.randn(64, generator=torch.Generator().manual_seed(0))
    qkv = torch.randn(9, 5 * 64, generator=torch.Generator().manual_seed(1))
    native_result, torch_result = qkv.clone(), qkv.clone()
    norm.forward_heads_(native_result[:, 64:], 3)
    monkeypatch.setattr(fused, "head_rms_norm_", lambda *args: False)
    norm.forward_heads_(torch_result[:, 64:], 3)
    _close(native_result, torch_result)
    assert torch.equal(torch_result[:, :64], qkv[:, :64]) and torch.equal(torch_result[:, 4 * 64 :], qkv[:, 4 * 64 :])


def test_rotary_table_holds_hf_values_and_grows_past_its_end():
    rope = RotaryEmbedding(64, 64, 10000.0, max_position=16)
    positions = torch.tensor([3, 40, 15])  # 40 is past the table: it grows
    qk = torch.randn(3, 2 * 64)
    rotated = rope(positions, qk.clone())
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float) / 64))
    freqs = positions.float()[:, None] * inv_freq  # HF's formula, per step
    expected = rope._rotate(qk, freqs.cos().unsqueeze(1), freqs.sin().unsqueeze(1))
    _close(rotated, expected)
    assert rope.cos_sin_cache.shape == (41, 64)
    with pytest.raises(IndexError, match="41 positions"):
        fused.rotary_neox_(qk, 2, 64, 64, torch.tensor([3, 41, 15]), rope.cos_sin_cache)  # one position a row


@pytest.mark.parametrize("rows", ROWS)
def test_embedding_gathers_dense_and_q8_rows(rows):
    ids = torch.randint(0, 50, (rows,), generator=torch.Generator().manual_seed(rows))
    weight = torch.randn(50, 64)
    assert torch.equal(fused.embedding(ids, weight), weight[ids])
    codes = torch.randint(-128, 128, (50, 64), dtype=torch.int8)
    scales = torch.rand(50, 2)
    expected = codes[ids].float() * scales[ids].repeat_interleave(32, dim=-1)
    assert torch.equal(fused.embedding(ids, codes, scales), expected)


def test_embedding_rejects_an_id_outside_the_vocab():
    with pytest.raises(IndexError, match="50 rows"):
        fused.embedding(torch.tensor([0, 50]), torch.randn(50, 64))
    with pytest.raises(IndexError, match="50 rows"):
        fused.embedding(torch.tensor([-1]), torch.zeros(50, 64, dtype=torch.int8), torch.ones(50, 2))


@pytest.mark.parametrize("rows", ROWS)
def test_write_kv_scatters_strided_rows(rows):
    qkv = torch.randn(rows, 3 * 2 * 16)
    key, value = qkv[:, 32:64].view(rows, 2, 16), qkv[:, 64:].view(rows, 2, 16)
    key_flat, value_flat = torch.zeros(2, 400, 2, 16)
    slots = torch.randperm(400)[:rows]
    assert fused.write_kv(key, value, key_flat, value_flat, slots)
    assert torch.equal(key_flat[slots], key) and torch.equal(value_flat[slots], value)
    others = torch.ones(400, dtype=torch.bool)
    others[slots] = False
    assert not key_flat[others].any() and not value_flat[others].any()


@pytest.mark.parametrize("rows", ROWS)
def test_write_kv_rounds_into_a_bf16_cache_as_torch_does(rows):
    """A bfloat16 model with float32 activations keeps its cache in bf16: nearest-even rounding, ties included,
    infinities and NaNs kept."""
    qkv = torch.randn(rows, 3 * 2 * 16, generator=torch.Generator().manual_seed(rows)) * 100
    qkv[0, 32:36] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, float("inf"), float("nan")])  # two ties, inf, NaN
    key, value = qkv[:, 32:64].view(rows, 2, 16), qkv[:, 64:].view(rows, 2, 16)
    key_flat, value_flat = torch.zeros(2, 400, 2, 16, dtype=torch.bfloat16)
    slots = torch.randperm(400)[:rows]
    assert fused.write_kv(key, value, key_flat, value_flat, slots)
    torch.testing.assert_close(key_flat[slots], key.bfloat16(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(value_flat[slots], value.bfloat16(), rtol=0, atol=0)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
def test_write_kv_keeps_nans_and_infinities_in_a_one_byte_cache_as_torch_does(kv_dtype):
    """Heads holding a NaN or an infinity read back as the torch path's quantize_rows leaves them (an int8 head: NaN
    throughout, its scale a NaN or an infinity); the other heads as before."""
    key = torch.randn(3, 2, 16, generator=torch.Generator().manual_seed(0))
    key[0, 1, 5], key[1, 0, 0], key[2, 1, 15] = float("nan"), float("inf"), float("-inf")
    width = row_width(16, kv_dtype)
    key_flat, value_flat = (torch.zeros(8, 2, width, dtype=kv_dtype) for _ in range(2))
    slots = torch.tensor([6, 1, 3])
    assert fused.write_kv(key, key, key_flat, value_flat, slots)
    expected = dequantize_rows(quantize_rows(key, kv_dtype), 16, torch.float32)
    for cache in (key_flat, value_flat):
        torch.testing.assert_close(dequantize_rows(cache[slots], 16, torch.float32), expected, rtol=0, atol=0,
                                   equal_nan=True)


def test_write_kv_rejects_a_slot_outside_the_cache_and_writes_nothing():
    key = value = torch.randn(3, 2, 16)
    key_flat, value_flat = torch.zeros(2, 10, 2, 16)
    with pytest.raises(IndexError, match="10 slots"):
        fused.write_kv(key, value, key_flat, value_flat, torch.tensor([1, 2, 10]))
    assert not key_flat.any() and not value_flat.any()


@pytest.mark.parametrize("rows", ROWS)
def test_argmax_rows_matches_torch_with_ties_infinities_and_nans(rows):
    x = torch.randn(rows, 500, generator=torch.Generator().manual_seed(rows))
    x[0, 7] = x[0, 400] = 1e9  # a tie: the first wins
    if rows > 1:
        x[1] = float("-inf")  # all -inf: index 0
    if rows > 2:
        x[2, 300] = x[2, 30] = float("nan")  # a NaN counts as the largest: the first NaN
        x[3, 499] = float("inf")
    assert torch.equal(fused.argmax_rows(x), x.argmax(dim=-1))


def test_other_dtypes_and_layouts_step_aside():
    x = torch.randn(4, 32)
    assert fused.add_rms_norm(x.bfloat16(), None, torch.ones(32, dtype=torch.bfloat16), 1e-5) is None
    assert fused.silu_and_mul(x.t()) is None  # not contiguous
    assert fused.silu_and_mul(x.double()) is None
    assert fused.argmax_rows(x.t()) is None and fused.argmax_rows(x.half()) is None
    assert fused.embedding(torch.arange(4), x.bfloat16()) is None
    assert fused.embedding(torch.arange(4, dtype=torch.int32), x) is None
    key = torch.randn(4, 2, 16)
    assert not fused.write_kv(key[:, :, ::2], key[:, :, ::2],
                              torch.zeros(10, 2, 8), torch.zeros(10, 2, 8), torch.arange(4))


def test_everything_steps_aside_without_the_library(monkeypatch):
    monkeypatch.setattr(native, "fused_ops", lambda: None)
    x = torch.randn(4, 32)
    assert fused.add_rms_norm(x, x, torch.ones(32), 1e-5) is None
    assert fused.silu_and_mul(x) is None
    assert not fused.rotary_neox_(x, 2, 16, 16, torch.arange(4), torch.ones(8, 16))
    assert fused.embedding(torch.arange(4), x) is None
    assert fused.argmax_rows(x) is None
    assert not fused.write_kv(x.view(4, 2, 16), x.view(4, 2, 16), torch.zeros(8, 2, 16), torch.zeros(8, 2, 16),
                              torch.arange(4))
