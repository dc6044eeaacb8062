"""The KV cache's element type (vLLM's ``kv_cache_dtype``): what each choice stores, how rows are quantized into it
and widened out of it on the torch paths.

- ``auto``: the model's dtype;
- ``fp8`` / ``fp8_e4m3`` and ``fp8_e5m2``: one byte an element (torch's float8_e4m3fn / float8_e5m2): each value
  divided by its layer's scale for its KV head (vLLM's k_scale and v_scale, a checkpoint's, else 1: per tensor, or
  per KV head under a kv_cache_scheme of strategy "attn_head"), clamped to the format's finite range and rounded to
  nearest even; read back, times that scale;
- ``int8``: one signed byte an element, and each head's row of ``head_size`` codes followed by its float32 scale
  (``max |x| / 127`` over the row, so every row uses the whole int8 range): ``head_size + 4`` bytes a row.

The native kernels (native/write_kv.c writing, paged_attention.h reading) round exactly as
``quantize_rows`` does, so the native and torch paths hold the same bytes.
"""
from __future__ import annotations

import functools

import torch

_STORED = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
           "int8": torch.int8}
_SCALE_BYTES = 4  # an int8 row's float32 scale


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache tensors' dtype for ``kv_cache_dtype`` (one CacheConfig has checked) in a model of ``model_dtype``."""
    return _STORED.get(cache_dtype, model_dtype)


def row_width(head_size: int, dtype: torch.dtype) -> int:
    """Cache elements a head's row takes: its values, and for int8 the scale's bytes after them."""
    return head_size + (_SCALE_BYTES if dtype == torch.int8 else 0)


def row_bytes(head_size: int, dtype: torch.dtype) -> int:
    return row_width(head_size, dtype) * dtype.itemsize


@functools.cache
def unit_kv_scales(num_kv_heads: int) -> torch.Tensor:
    """A layer's (k_scale, v_scale) rows ``[2, num_kv_heads]`` (float32, one a KV head) that scale nothing: those of
    every cache but an fp8 one, and of an fp8 one without a checkpoint's. One tensor per size, never written, so the
    kernel calls a CPU graph records keep pointing at it."""
    return torch.ones(2, num_kv_heads, dtype=torch.float32)  # whatever the default dtype (a model's, as it is built)


def is_fp8(dtype: torch.dtype) -> bool:
    """Whether a cache of ``dtype`` is an fp8 one, the only kind a layer's k_scale and v_scale apply to (the others
    hold their values unscaled, or int8 with each row's own scale): vLLM takes them as 1 for any other cache."""
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


def _per_head(scale: float | torch.Tensor) -> float | torch.Tensor:
    """A per-tensor scale as it is; one a KV head ``[num_kv_heads]`` as ``[num_kv_heads, 1]``, to scale rows
    ``[..., num_kv_heads, head_size]`` head by head."""
    return scale.unsqueeze(-1) if isinstance(scale, torch.Tensor) else scale


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``x`` ``[..., head_size]`` (float) as the cache of ``dtype`` holds it: ``[..., row_width]``; ``scale``: an fp8
    cache's, which the value is divided by (float32 division, as the native writer's): per tensor, or a float32
    ``[num_kv_heads]`` for rows ``[..., num_kv_heads, head_size]``."""
    if dtype == torch.int8:
        x = x.float()
        amax = x.abs().amax(-1, keepdim=True)
        inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        codes = torch.round(x * inverse).to(torch.int8)
        return torch.cat([codes, (amax / 127.0).view(torch.int8)], dim=-1)
    if is_fp8(dtype):  # torch's conversion overflows to NaN/inf; the cache saturates
        limit = torch.finfo(dtype).max
        return (x.float() / _per_head(scale)).clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def dequantize_rows(rows: torch.Tensor, head_size: int, dtype: torch.dtype,
                    scale: float | torch.Tensor = 1.0) -> torch.Tensor:
    """Cache rows ``[..., row_width]`` as ``dtype`` values ``[..., head_size]``; ``scale``: an fp8 cache's (as
    quantize_rows takes it), which the values are multiplied by in float32."""
    if rows.dtype == torch.int8:
        row_scale = rows[..., head_size:].contiguous().view(torch.float32)
        return (rows[..., :head_size].float() * row_scale).to(dtype)
    if is_fp8(rows.dtype):
        return (rows.float() * _per_head(scale)).to(dtype)
    return rows.to(dtype)
