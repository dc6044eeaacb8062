"""Typed calls of fused_ops.c, the decoder layer's element-wise work in float32 on CPU: each C function declared
once by name (FUSED_SIGNATURES) and called through one wrapper here.

Each returns its result (or True) when the native path applies, and None (or False) when it does not: no
kernel, another dtype or device, or a layout the kernel does not take. Callers then run their torch code, so
the two paths always coexist and the torch one stays the reference. With ``PAGEDLLM_NATIVE_CHECKS=1`` the
relations between the arguments (shapes, lengths) are checked before a call too (native/checks.py).
"""

import torch

from pagedllm import native
from pagedllm.kv_cache_dtype import is_fp8, row_width, unit_kv_scales
from pagedllm.native import checks
from pagedllm.native.checks import expect, require
from pagedllm.native.graph import launch
from pagedllm.native.signature import FLOAT, INT, INT64, POINTER, CFunction, arguments

_WRITE_KV_ARGS = arguments("key", "value", POINTER, "row_stride", INT64, "key_cache", "value_cache", POINTER,
                           "num_slots", INT64, "slot_mapping", POINTER, "rows", INT64, "row_floats", INT)
FUSED_SIGNATURES = (
    CFunction("add_rms_norm_f32", None, *arguments("x", "residual", "weight", "out", "sum_out", POINTER, "rows",
                                                   INT64, "hidden", INT, "eps", FLOAT)),
    CFunction("head_rms_norm_f32", None, *arguments("x", POINTER, "row_stride", INT64, "weight", POINTER, "rows",
                                                    INT64, "num_heads", "head_size", INT, "eps", FLOAT)),
    CFunction("silu_and_mul_f32", None, *arguments("x", "out", POINTER, "rows", INT64, "d", INT)),
    CFunction("gelu_tanh_and_mul_f32", None, *arguments("x", "out", POINTER, "rows", INT64, "d", INT)),
    CFunction("rotary_neox_f32", INT, *arguments("x", POINTER, "row_stride", INT64, "positions", "cos_sin_cache",
                                                 POINTER, "num_positions", "rows", INT64, "heads", "head_size",
                                                 "rotary_dim", INT)),
    CFunction("embedding_f32", INT, *arguments("ids", "weight", "out", POINTER, "rows", INT64, "dim", INT,
                                               "vocab_rows", INT64, "scale", FLOAT)),
    CFunction("embedding_q8_f32", INT, *arguments("ids", "codes", "scales", "out", POINTER, "rows", INT64, "dim",
                                                  INT, "vocab_rows", INT64, "scale", FLOAT, "block", INT)),
    CFunction("write_kv_f32", INT, *_WRITE_KV_ARGS),
    CFunction("write_kv_bf16", INT, *_WRITE_KV_ARGS),
    CFunction("write_kv_fp8_e4m3", INT, *_WRITE_KV_ARGS, *arguments("head_size", INT, "k_scale", "v_scale", POINTER)),
    CFunction("write_kv_fp8_e5m2", INT, *_WRITE_KV_ARGS, *arguments("head_size", INT, "k_scale", "v_scale", POINTER)),
    CFunction("write_kv_int8", INT, *_WRITE_KV_ARGS, *arguments("head_size", INT)),
    CFunction("argmax_rows_f32", None, *arguments("x", POINTER, "rows", "cols", INT64, "out", POINTER)),
    CFunction("add_sigmoid_gated_f32", None, *arguments("gate", "x", "out", POINTER, "rows", INT64, "d", INT)),
    CFunction("fused_moe_f32", INT, *arguments("x", "router_logits", "w13", "w2", "out", POINTER, "tokens", INT64,
                                               "hidden", "inter", "num_experts", "top_k", "renormalize", INT)),
)


def _lib_for(*tensors: torch.Tensor):
    for t in tensors:  # a plain loop: called ~10 times per layer and step
        if t.dtype != torch.float32 or t.device.type != "cpu":
            return None
    return native.fused_ops()


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """``norm(x)``, or ``(norm(x + residual), x + residual)``; None when the native path does not apply."""
    operands = (x, weight) if residual is None else (x, residual, weight)
    lib = _lib_for(*operands)
    if lib is None or not all(t.is_contiguous() for t in operands) or x.dim() != 2:
        return None
    if checks.ENABLED:
        require("add_rms_norm_f32", weight.shape == (x.shape[1],) and (residual is None or residual.shape == x.shape),
                f"weight {tuple(weight.shape)} and residual must fit x {tuple(x.shape)}")
    out = torch.empty_like(x)
    summed = None if residual is None else torch.empty_like(x)
    launch(lib.add_rms_norm_f32, x.data_ptr(), None if residual is None else residual.data_ptr(),
           weight.data_ptr(), out.data_ptr(), None if summed is None else summed.data_ptr(), x.shape[0],
           x.shape[1], eps)
    return out if residual is None else (out, summed)


def head_rms_norm_(x: torch.Tensor, num_heads: int, head_size: int, weight: torch.Tensor, eps: float) -> bool:
    """Normalise each of the first ``num_heads`` heads of each row of ``x`` ([T, >= num_heads * head_size], rows
    may be strided) in place, by its own RMS, times ``weight`` ([head_size]). False when it does not apply."""
    lib = _lib_for(x, weight)
    if lib is None or x.dim() != 2 or x.stride(1) != 1 or not weight.is_contiguous():
        return False
    if checks.ENABLED:
        require("head_rms_norm_f32", weight.shape == (head_size,) and x.shape[1] >= num_heads * head_size,
                f"x {tuple(x.shape)} and weight {tuple(weight.shape)} do not fit {num_heads} heads of {head_size}")
    launch(lib.head_rms_norm_f32, x.data_ptr(), x.stride(0), weight.data_ptr(), x.shape[0], num_heads, head_size,
           eps)
    return True


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``silu(x[:, :d]) * x[:, d:]`` for ``[T, 2d]``; None when the native path does not apply."""
    return _gated_activation("silu_and_mul_f32", x)


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``gelu(x[:, :d], approximate="tanh") * x[:, d:]`` (GeGLU) for ``[T, 2d]``; None when the native path does
    not apply."""
    return _gated_activation("gelu_tanh_and_mul_f32", x)


def _gated_activation(kernel: str, x: torch.Tensor) -> torch.Tensor | None:
    lib = _lib_for(x)
    if lib is None or not x.is_contiguous() or x.dim() != 2:
        return None
    if checks.ENABLED:
        require(kernel, x.shape[1] % 2 == 0, f"x {tuple(x.shape)} is not [gate | up]")
    d = x.shape[1] // 2
    out = x.new_empty(x.shape[0], d)
    launch(getattr(lib, kernel), x.data_ptr(), out.data_ptr(), x.shape[0], d)
    return out


def rotary_neox_(x: torch.Tensor, num_heads: int, head_size: int, rotary_dim: int, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> bool:
    """Rotate the first ``num_heads`` heads of each row of ``x`` ([T, >= num_heads * head_size], rows may be
    strided) in place, row t by ``cos_sin_cache[positions[t]]`` (``rotary_dim / 2`` cosines, then sines).
    False when it does not apply; IndexError for a position past the cache."""
    lib = _lib_for(x, cos_sin_cache)
    if (lib is None or x.dim() != 2 or x.stride(1) != 1 or not cos_sin_cache.is_contiguous()
            or positions.dtype != torch.int64 or not positions.is_contiguous()):
        return False
    if checks.ENABLED:
        require("rotary_neox_f32", positions.shape == (x.shape[0],) and x.shape[1] >= num_heads * head_size
                and cos_sin_cache.shape[1] == rotary_dim and rotary_dim <= head_size and rotary_dim % 2 == 0,
                f"x {tuple(x.shape)}, positions {tuple(positions.shape)}, cache {tuple(cos_sin_cache.shape)} do not "
                f"fit {num_heads} heads of {head_size} rotating {rotary_dim}")
    if launch(lib.rotary_neox_f32, x.data_ptr(), x.stride(0), positions.data_ptr(), cos_sin_cache.data_ptr(),
              cos_sin_cache.shape[0], x.shape[0], num_heads, head_size, rotary_dim) != 0:
        raise IndexError(f"a position is past the rotary cache's {cos_sin_cache.shape[0]} positions")
    return True


def embedding(ids: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor | None = None, scale: float = 1.0):
    """``weight[ids] * scale`` as float32 rows; with ``scales`` the rows are int8 codes (Q8_0: a scale per 32,
    Q6_K: per 16), dequantized. None when the
    native path does not apply."""
    lib = native.fused_ops()
    dense = weight.dtype == torch.float32 and scales is None
    q8 = weight.dtype == torch.int8 and scales is not None and scales.dtype == torch.float32
    if (lib is None or not (dense or q8) or ids.dtype != torch.int64 or ids.dim() != 1 or weight.device.type != "cpu"
            or not (ids.is_contiguous() and weight.is_contiguous() and (scales is None or scales.is_contiguous()))):
        return None
    rows, dim = weight.shape
    block = dim // scales.shape[1] if q8 and scales.shape[1] else 0
    if checks.ENABLED and q8:
        require("embedding_q8_f32", block in (16, 32) and scales.shape == (rows, dim // block),
                f"scales {tuple(scales.shape)} must hold one per 16 or 32 of the {tuple(weight.shape)} codes")
    out = torch.empty(ids.shape[0], dim)
    if dense:
        status = launch(lib.embedding_f32, ids.data_ptr(), weight.data_ptr(), out.data_ptr(), ids.shape[0], dim, rows,
                        scale)
    else:
        status = launch(lib.embedding_q8_f32, ids.data_ptr(), weight.data_ptr(), scales.data_ptr(), out.data_ptr(),
                        ids.shape[0], dim, rows, scale, block)
    if status != 0:
        raise IndexError(f"a token id is outside the embedding's {rows} rows")
    return out


# by the cache's dtype (write_kv.c for the one-byte ones)
_WRITE_KV = {torch.float32: "write_kv_f32", torch.bfloat16: "write_kv_bf16", torch.float8_e4m3fn: "write_kv_fp8_e4m3",
             torch.float8_e5m2: "write_kv_fp8_e5m2", torch.int8: "write_kv_int8"}


def write_kv(key: torch.Tensor, value: torch.Tensor, key_flat: torch.Tensor, value_flat: torch.Tensor,
             slot_mapping: torch.Tensor, kv_scales: torch.Tensor | None = None) -> bool:
    """``key_flat[slot_mapping] = key`` and the same for value, for float32 ``[T, kv_heads, head_size]`` rows
    that may be strided views of the QKV output, into a cache of any kv_cache_dtype (rounded or quantized as
    kv_cache_dtype.quantize_rows does, an fp8 cache's keys of KV head h divided by ``kv_scales[0, h]`` and values by
    ``kv_scales[1, h]``: float32 ``[2, kv_heads]``, None for 1); False when it does not apply."""
    lib = _lib_for(key, value)
    kernel = _WRITE_KV.get(key_flat.dtype)
    row_floats = key.shape[1] * key.shape[2]
    dense_rows = all(t.stride(2) == 1 and t.stride(1) == t.shape[2] for t in (key, value))
    if (lib is None or kernel is None or value_flat.dtype != key_flat.dtype or key_flat.device.type != "cpu"
            or value_flat.device.type != "cpu" or not dense_rows
            or key.stride(0) != value.stride(0) or slot_mapping.dtype != torch.int64
            or not (key_flat.is_contiguous() and value_flat.is_contiguous() and slot_mapping.is_contiguous())):
        return False
    if checks.ENABLED:
        require(kernel, key.shape == value.shape and key_flat.shape == value_flat.shape
                and key_flat.shape[1:] == (*key.shape[1:2], row_width(key.shape[2], key_flat.dtype))
                and slot_mapping.shape == (key.shape[0],),
                f"key/value {tuple(key.shape)}, caches {tuple(key_flat.shape)}, slots {tuple(slot_mapping.shape)} "
                "do not fit")
    # what the kernel takes beyond the rows: an int8 cache's head size; an fp8 cache's, and its scales' rows
    extra = (key.shape[2],) if key_flat.dtype == torch.int8 else ()
    if is_fp8(key_flat.dtype):
        kv_scales = unit_kv_scales(key.shape[1]) if kv_scales is None else kv_scales
        if checks.ENABLED:
            expect(kernel, "kv_scales", kv_scales, torch.float32, (2, key.shape[1]), contiguous=True)
        extra = (key.shape[2], kv_scales[0].data_ptr(), kv_scales[1].data_ptr())
    if launch(getattr(lib, kernel), key.data_ptr(), value.data_ptr(), key.stride(0), key_flat.data_ptr(),
              value_flat.data_ptr(), key_flat.shape[0], slot_mapping.data_ptr(), key.shape[0], row_floats,
              *extra) != 0:
        raise IndexError(f"slot_mapping holds a slot outside the KV cache's {key_flat.shape[0]} slots")
    return True


def argmax_rows(x: torch.Tensor) -> torch.Tensor | None:
    """``x.argmax(dim=-1)`` for a ``[T, V]`` float32 tensor; None when the native path does not apply."""
    lib = _lib_for(x)
    if lib is None or x.dim() != 2 or not x.is_contiguous() or x.shape[1] == 0:
        return None
    out = torch.empty(x.shape[0], dtype=torch.int64)
    launch(lib.argmax_rows_f32, x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr())
    return out


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool) -> torch.Tensor | None:
    """A mixture-of-experts layer's output ``[T, hidden]`` for ``x`` and its router's logits ``[T, experts]``, every
    expert held here (``w13`` ``[experts, 2 * inter, hidden]``, ``w2`` ``[experts, hidden, inter]``), routed and
    computed as layers/fused_moe.py's select_experts and fused_experts do (native/fused_moe.c); None when the native
    path does not apply."""
    lib = _lib_for(x, router_logits, w13, w2)
    operands = (x, router_logits, w13, w2)
    if lib is None or x.dim() != 2 or not all(t.is_contiguous() for t in operands):
        return None
    experts, hidden = w13.shape[0], x.shape[1]
    inter = w2.shape[2]
    if checks.ENABLED:
        require("fused_moe_f32", router_logits.shape == (x.shape[0], experts) and w13.shape == (experts, 2 * inter,
                hidden) and w2.shape == (experts, hidden, inter) and 0 < top_k <= experts,
                f"x {tuple(x.shape)}, logits {tuple(router_logits.shape)}, w13 {tuple(w13.shape)}, w2 "
                f"{tuple(w2.shape)}, top_k {top_k} do not fit")
    out = torch.empty_like(x)
    status = launch(lib.fused_moe_f32, x.data_ptr(), router_logits.data_ptr(), w13.data_ptr(), w2.data_ptr(),
                    out.data_ptr(), x.shape[0], hidden, inter, experts, top_k, int(renormalize))
    if status == -1:
        raise ValueError(f"fused_moe_f32: top_k {top_k} must be in 1..{experts}, the sizes positive")
    if status != 0:
        raise MemoryError("fused_moe_f32 could not allocate its scratch")
    return out


def add_sigmoid_gated_(out: torch.Tensor, gate: torch.Tensor, x: torch.Tensor) -> bool:
    """``out += sigmoid(gate) * x`` in place, for ``[T, d]`` rows and ``gate`` ``[T, 1]``; False when it does not
    apply."""
    lib = _lib_for(out, gate, x)
    operands = (out, gate, x)
    if lib is None or x.dim() != 2 or not all(t.is_contiguous() for t in operands):
        return False
    if checks.ENABLED:
        require("add_sigmoid_gated_f32", out.shape == x.shape and gate.shape == (x.shape[0], 1),
                f"out {tuple(out.shape)}, gate {tuple(gate.shape)}, x {tuple(x.shape)} do not fit")
    launch(lib.add_sigmoid_gated_f32, gate.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1])
    return True
