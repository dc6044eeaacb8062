"""The KV cache's element type (vLLM's ``kv_cache_dtype``): what each choice stores, how rows are quantized into it
and widened out of it on the torch paths.

- ``auto``: the model's dtype;
- ``fp8`` / ``fp8_e4m3`` and ``fp8_e5m2``: one byte an element (torch's float8_e4m3fn / float8_e5m2), the values
  clamped to the format's finite range and rounded to nearest even, scale 1 (vLLM's default k_scale and v_scale);
- ``int8``: one signed byte an element, and each head's row of ``head_size`` codes followed by its float32 scale
  (``max |x| / 127`` over the row, so every row uses the whole int8 range): ``head_size + 4`` bytes a row.

The native kernels (native/write_kv.c writing, paged_attention.h reading) round exactly as
``quantize_rows`` does, so the native and torch paths hold the same bytes.
"""
from __future__ import annotations

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


def quantize_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x`` ``[..., head_size]`` (float) as the cache of ``dtype`` holds it: ``[..., row_width]``."""
    if dtype == torch.int8:
        x = x.float()
        amax = x.abs().amax(-1, keepdim=True)
        inverse = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
        codes = torch.round(x * inverse).to(torch.int8)
        return torch.cat([codes, (amax / 127.0).view(torch.int8)], dim=-1)
    if dtype.itemsize == 1:  # fp8: torch's conversion overflows to NaN/inf; the cache saturates
        limit = torch.finfo(dtype).max
        return x.float().clamp(-limit, limit).to(dtype)
    return x.to(dtype)


def dequantize_rows(rows: torch.Tensor, head_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows ``[..., row_width]`` as ``dtype`` values ``[..., head_size]``."""
    if rows.dtype == torch.int8:
        scale = rows[..., head_size:].contiguous().view(torch.float32)
        return (rows[..., :head_size].float() * scale).to(dtype)
    return rows.to(dtype)
